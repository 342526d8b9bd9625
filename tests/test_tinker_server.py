"""`slimish tinker` through the real Tinker SDK (0.38.0) and raw HTTP: the wire (protobuf in and out,
futures), per-model seq_id order, sampling semantics, checkpoints and keys. One server for the module,
on the tiny llama model, with a short long-poll so a pending future answers `try_again` quickly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import request_conv, response_conv

from slimish.net import listening_socket
from slimish.processes import ServerProcess

KEY = "tml-test-key"
ADAM = types.AdamParams(learning_rate=1e-2, eps=1e-8)


@pytest.fixture(scope="module")
def url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root, sock = tmp_path_factory.mktemp("tinker-root"), listening_socket()
    port = sock.getsockname()[1]
    argv = ["tinker", "--model", str(tiny_model_dir), "--port", str(port), "--root", str(root)]
    argv += ["--api-key", KEY, "--poll-s", "0.5", "--seq-gap-s", "30"]
    server = ServerProcess(argv, port=port, health_path="/api/v1/healthz", log_path=root / "server.log", sock=sock)
    with server.start(300) as s:
        yield s.url


@pytest.fixture(scope="module")
def service(url: str) -> Iterator[tinker.ServiceClient]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
            yield sc


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights if weights is not None else [1.0] * n},
    )


TOKENS = [5, 17, 99, 4, 250, 31, 7, 77, 300, 12, 6, 40]


def post(url: str, path: str, body: dict | bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"X-API-Key": key} if key else {}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/x-protobuf"
        return httpx.post(url + path, content=body, headers=headers, timeout=30)
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_forward_backward_decoded_and_logprobs_exact(service, base) -> None:
    """The protobuf request arrives whole (tokens, negative and fractional weights, a 2-D torch input
    sent as sparse CSR) and the per-datum logprobs and `loss:sum` come back as the model computes them:
    a fresh adapter is the base model (B = 0)."""
    tc = service.create_lora_training_client(base_model=str(base.name_or_path), rank=4, seed=1).result()
    weights = [1.0, -0.5, 0.0, 2.25, 1.0, 0.0, 0.0, 3.0, -1.0, 1.0, 0.5]
    targets_2d = torch.tensor(TOKENS[1:]).unsqueeze(1)  # (N, 1): a top-K target of K = 1, sent sparse
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": targets_2d, "weights": torch.tensor(weights).unsqueeze(1)},
    )
    out = tc.forward([datum(TOKENS, weights), sparse], "cross_entropy").result()
    with torch.no_grad():
        logits = base(torch.tensor([TOKENS[:-1]])).logits[0]
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(TOKENS[1:]).unsqueeze(1)).squeeze(1)
    got = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5)
    assert out.loss_fn_outputs[1]["logprobs"].shape == [11, 1]
    np.testing.assert_allclose(out.loss_fn_outputs[1]["logprobs"].to_numpy()[:, 0], got, atol=1e-6)
    loss = -(expected * torch.tensor(weights)).sum().item()
    assert out.metrics["loss:sum"] == pytest.approx(2 * loss, abs=1e-4)


def raw_model(url: str, base_model: str, seed: int) -> str:
    """A model created by raw HTTP (its seq_ids are ours to send)."""
    session = post(url, "/api/v1/create_session", {"tags": [], "user_metadata": None, "sdk_version": "t"}).json()
    body = {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "other/model"}
    refused = post(url, "/api/v1/create_model", body | {"lora_config": {"rank": 4}})
    assert refused.status_code == 400 and "base_model" in refused.json()["detail"]
    body |= {"base_model": base_model, "lora_config": {"rank": 4, "seed": seed}}
    rid = post(url, "/api/v1/create_model", body).json()["request_id"]
    return retrieve(url, rid)["model_id"]


def retrieve(url: str, rid: str, proto: bool = False) -> dict | bytes:
    for _ in range(120):  # each poll waits up to --poll-s on the server
        r = post(url, "/api/v1/retrieve_future", {"request_id": rid})
        assert r.status_code == 200, r.text
        if r.headers["content-type"].startswith("application/x-protobuf"):
            assert proto
            return r.content
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{rid} still pending")


def fwd_request(model_id: str, seq_id: int, forward_only: bool) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(TOKENS)], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    msg = request_conv.forward_backward_request_to_proto(req)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def test_seq_id_order_and_pending_futures(url, service, tiny_model_dir) -> None:
    """Requests sent 3, 2, 1 run 1, 2, 3: the forward (seq 3) sees the step (seq 2) taken on the
    gradient of seq 1, exactly as the SDK's in-order run on a twin adapter; until seq 1 arrives, seq 3's
    future answers try_again. A failed request answers the SDK's error body, an unknown id a 404."""
    model_id = raw_model(url, str(tiny_model_dir), seed=7)
    third = post(url, "/api/v1/forward_backward", fwd_request(model_id, 3, forward_only=True)).json()["request_id"]
    pending = post(url, "/api/v1/retrieve_future", {"request_id": third}).json()
    assert pending == {"type": "try_again", "request_id": third, "queue_state": "active"}
    adam = {"learning_rate": ADAM.learning_rate, "eps": ADAM.eps}
    post(url, "/api/v1/optim_step", {"adam_params": adam, "model_id": model_id, "seq_id": 2})
    first = post(url, "/api/v1/forward_backward", fwd_request(model_id, 1, forward_only=False)).json()["request_id"]
    retrieve(url, first, proto=True)
    out = response_conv.deserialize_forward_backward_output(retrieve(url, third, proto=True))
    raw = out.loss_fn_outputs[0]["logprobs"].to_numpy()

    twin = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=7).result()
    before = twin.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    twin.forward_backward([datum(TOKENS)], "cross_entropy").result()
    twin.optim_step(ADAM).result()
    after = twin.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(after - before).max() > 1e-3  # the step moved the model
    np.testing.assert_allclose(raw, after, atol=1e-6)

    with pytest.raises(tinker.RequestFailedError, match="no_such_loss") as failed:
        twin.forward([datum(TOKENS)], "no_such_loss").result()
    assert failed.value.category == types.RequestErrorCategory.User
    assert post(url, "/api/v1/retrieve_future", {"request_id": "req-nope"}).status_code == 404


def test_keys(url) -> None:
    assert post(url, "/api/v1/client/config", {"sdk_version": "t"}, key=None).status_code == 401
    assert post(url, "/api/v1/client/config", {"sdk_version": "t"}, key="tml-wrong").status_code == 401
    assert post(url, "/api/v1/client/config", {"sdk_version": "t"}).json()["use_pyqwest_transport"] is False


def test_sampling_semantics(service, tiny_model_dir) -> None:
    """Stop tokens end the sample and are in it once; stop strings too; seed j of n is seed + j;
    prompt logprobs are the trainer's (NaN, i.e. None, at 0); the top-k list starts with the pick."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    sc = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    greedy = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    free = sc.sample(prompt, 1, greedy, topk_sample_logprobs=3).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 10
    assert [row[0][0] for row in free.topk_logprobs] == free.tokens
    np.testing.assert_allclose([row[0][1] for row in free.topk_logprobs], free.logprobs, atol=1e-5)
    k = next(i for i in range(2, 10) if free.tokens[i] not in free.tokens[:i])
    stopped = sc.sample(prompt, 1, types.SamplingParams(max_tokens=10, temperature=0.0, stop=[free.tokens[k]]))
    seq = stopped.result().sequences[0]
    assert (seq.tokens, seq.stop_reason) == (free.tokens[: k + 1], "stop")
    j = next(
        i
        for i in range(1, 10)
        if (s := tok.decode(free.tokens[i : i + 1])).strip() and s not in tok.decode(free.tokens[:i])
    )
    by_text = sc.sample(
        prompt, 1, types.SamplingParams(max_tokens=10, temperature=0.0, stop=[tok.decode([free.tokens[j]])])
    )
    assert by_text.result().sequences[0].tokens == free.tokens[: j + 1]

    hot = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    two = sc.sample(prompt, 2, hot).result().sequences
    again = sc.sample(prompt, 1, hot).result().sequences[0]
    shifted = sc.sample(prompt, 1, hot.model_copy(update={"seed": 12})).result().sequences[0]
    assert again.tokens == two[0].tokens and shifted.tokens == two[1].tokens and two[0].tokens != two[1].tokens

    lps = sc.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    trained = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lps[0] is None
    np.testing.assert_allclose(lps[1:], trained, atol=1e-5)
    tail = sc.sample(
        types.ModelInput.from_ints(TOKENS), 1, greedy, include_prompt_logprobs=True, prompt_logprobs_last_n=3
    )
    tail_lps = tail.result().prompt_logprobs
    assert tail_lps[:-3] == [None] * (len(TOKENS) - 3)
    np.testing.assert_allclose(tail_lps[-3:], lps[-3:], atol=1e-6)


def test_checkpoints_round_trip(url, service, tiny_model_dir) -> None:
    """State and sampler checkpoints are tinker:// paths that load again: the resumed model (with its
    optimizer) takes the same next step as the original; the sampler adapter, LM head included
    (train_unembed), samples with the trainer's logprobs; the run keeps its metadata; a deleted
    checkpoint is gone."""
    tc = service.create_lora_training_client(
        base_model=str(tiny_model_dir), rank=4, seed=3, user_metadata={"renderer": "role_colon"}
    ).result()
    for _ in range(2):
        tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(ADAM).result()
    state = tc.save_state("step2").result().path
    sampler_path = tc.save_weights_for_sampler("step2").result().path
    assert state.startswith("tinker://") and state.endswith("/weights/step2")

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    probes = []
    for client in (tc, resumed):
        client.forward_backward([datum(TOKENS[::-1])], "cross_entropy").result()
        client.optim_step(ADAM).result()
        probes.append(client.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"])
    np.testing.assert_allclose(probes[0].to_numpy(), probes[1].to_numpy(), atol=1e-6)

    sampled = (
        service.create_sampling_client(model_path=sampler_path)
        .result()
        .compute_logprobs(types.ModelInput.from_ints(TOKENS))
    )
    fresh = service.create_training_client_from_state(state).result()
    at_save = fresh.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(sampled.result()[1:], at_save, atol=1e-5)
    with pytest.warns(FutureWarning, match="load_state"):  # deprecated in the SDK, still sent
        resumed.load_state(state).result()  # back to the checkpoint, in the client's own order
    back = resumed.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(back, at_save, atol=1e-6)
    assert np.abs(back - probes[1].to_numpy()).max() > 1e-4  # it moved since

    rest = tinker.RestClient(base_url=url, api_key=KEY)
    assert rest.get_training_run_by_tinker_path(state).result().user_metadata == {"renderer": "role_colon"}
    rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(Exception, match="no checkpoint"):
        service.create_training_client_from_state(state).result()


def test_bad_create_names_the_field(url, service, tiny_model_dir) -> None:
    capabilities = httpx.get(url + "/api/v1/get_server_capabilities", headers={"X-API-Key": KEY}).json()
    assert capabilities["supported_models"][0]["model_name"] == str(tiny_model_dir)
    with pytest.raises(tinker.BadRequestError, match="lora_config.rank"):
        service.create_lora_training_client(base_model=str(tiny_model_dir), rank=10_000).result()


def test_session_finish_releases_its_models(url, service, tiny_model_dir) -> None:
    """A finished session's models leave the server's memory; their checkpoints still load."""
    with tinker.ServiceClient(base_url=url, api_key=KEY) as other:
        tc = other.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
        state = tc.save_state("kept").result().path
        model_id = tc.model_id
    gone = post(url, "/api/v1/get_info", {"model_id": model_id})
    assert gone.status_code == 400 and "not a model of this server" in gone.json()["detail"]
    assert service.create_training_client_from_state(state).result().model_id != model_id
