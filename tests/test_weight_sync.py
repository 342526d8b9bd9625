"""Weight sync end to end: `WeightSync` (trainer rank 0, this process) and two real engines.

Pushed tensors are derived from a seed, so this process can rebuild them and check what each
engine serves (every name, exactly) and generates. The trainer test closes the loop: rollouts
from the engines, a `TorchTrainer` step, a push, and fresh rollouts whose engine logprobs match
the trainer's.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
import torch
from helpers import generate, metric_total, running_engines, wait_for

from slimish.config import load_run_config
from slimish.distributed import init_custom_process_group, master_store
from slimish.launch.local import engine_process
from slimish.rollout.api import sample_from_reply
from slimish.trainer.backend import WeightExport
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import WeightSync, WeightSyncError
from slimish.types import Sample

WAIT_S = 120.0
BF16 = {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}  # sent as bf16 to fp32 params
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
ASK = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}


@functools.cache
def http() -> httpx.Client:
    """One client per process: each bare `httpx.post` builds an SSL context (~50 ms here)."""
    return httpx.Client(timeout=WAIT_S)


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return http().post(url + path, json=body or {})


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    with running_engines(tiny_model_dir, tmp_path_factory, timeout=WAIT_S, weight_sync_timeout_s=120) as procs:
        yield [p.url for p in procs]


def sync_config(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(**{"timeout_s": 60.0, **kw})


@pytest.fixture(scope="module")
def sync(engines):
    """A small bucket size, so a tiny model's push takes several buckets."""
    ws = WeightSync(sync_config(bucket_mb=0.1), engines)
    try:
        ws.connect()
        yield ws
    finally:
        ws.close()


def hf_model(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module) -> list[int]:
    n = GREEDY["max_new_tokens"]
    out = model.generate(
        torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(PROMPT) :].tolist()


def served(url: str, name: str, rows: int) -> torch.Tensor:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


def assert_serves(url: str, model: torch.nn.Module) -> None:
    """Every parameter name (a tied head under both names), bit for bit."""
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(served(url, name, param.shape[0]), param.detach().float()), (url, name)


def model_info(url: str) -> dict:
    return http().get(url + "/model_info").json()


def seeded(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (name, torch.randn(p.shape, generator=g).to(torch.bfloat16 if name in BF16 else torch.float32))
        for name, p in model.named_parameters()
    ]


# -- pushes of given tensors --------------------------------------------------------------------


@pytest.mark.parametrize("flattened, seed", [(False, 1), (True, 2)], ids=["default", "flattened_bucket"])
def test_push_all_parameters(engines, sync, tiny_model_dir, flattened, seed):
    reference = hf_model(tiny_model_dir)
    before = generate(engines[0], **ASK)["output_ids"]
    tensors = seeded(reference, seed)
    sync.cfg.flattened = flattened
    try:
        timings = sync.push(WeightExport(tensors), seed)
    finally:
        sync.cfg.flattened = False
    assert timings["buckets"] > 2 and timings["bytes"] == sum(t.numel() * t.element_size() for _, t in tensors)
    assert sync.engines.sessions is True  # the built-in engine has begin/end_weight_update

    params = dict(reference.named_parameters())
    with torch.no_grad():  # the reference now holds what was pushed (bf16 ones widened, as the engine does)
        for name, t in tensors:
            params[name].copy_(t)
    expected = hf_greedy(reference)
    assert expected != before
    for url in engines:
        assert_serves(url, reference)
        out = generate(url, **ASK)
        assert out["output_ids"] == expected
        assert out["meta_info"]["weight_version"] == str(seed)
        assert model_info(url)["weight_version"] == str(seed)


def test_a_drain_push_lets_the_running_generation_finish_on_its_weights(engines, sync, tiny_model_dir):
    """pause_mode=drain: the push's session opens only once no generation runs (SGLang's writer
    lock, which the engine's /begin_weight_update takes too), so a running generation finishes
    entirely on the weights it started with; generation then stays paused for the buckets."""
    url = engines[0]
    before = model_info(url)["weight_version"]
    with ThreadPoolExecutor(1) as pool:
        long = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
        running = pool.submit(generate, url, **{**ASK, "sampling_params": long})
        wait_for(lambda: metric_total(url, "sglang:num_running_reqs") >= 1, "the generation to run")
        sync.cfg.pause_mode = "drain"
        try:
            sync.push(WeightExport(seeded(hf_model(tiny_model_dir), 9)), 9)
        finally:
            sync.cfg.pause_mode = "retract"
        meta = running.result(timeout=WAIT_S)["meta_info"]
    assert [span["version"] for span in meta["weight_versions"]] == [before] and meta["completion_tokens"] == 200
    assert model_info(url)["weight_version"] == "9"


def test_refused_bucket_fails_the_push(engines, sync, tiny_model_dir):
    """An engine that rejects a bucket (here: a wrong shape) fails the push with its message,
    instead of leaving the broadcast waiting; and the group's teardown does not wait for the
    send that no engine will receive (it used to, for the whole timeout)."""
    second = WeightSync(sync_config(group_name="refusal"), engines)
    try:
        second.connect()
        with pytest.raises(WeightSyncError, match="does not match the parameter's shape"):
            second.push(WeightExport([("model.norm.weight", torch.zeros(3))]), 666)
        assert model_info(engines[0])["weight_version"] != "666"
        assert generate(engines[0], **ASK)["meta_info"]["finish_reason"]["type"] == "length"  # generation resumed
    finally:
        started = time.monotonic()
        second.close()
    assert time.monotonic() - started < second.cfg.timeout_s / 4


def test_second_group_and_destroy(engines, sync):
    second = WeightSync(sync_config(group_name="second"), engines)
    second.connect()
    second.close()
    second.close()  # idempotent
    r = post(engines[0], "/destroy_weights_update_group", {"group_name": "second"})
    assert (r.status_code, r.json()) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )


def test_disk_transport(engines, tiny_model_dir, tiny_model_dir_other_seed, tmp_path):
    other = hf_model(tiny_model_dir_other_seed)
    with WeightSync(sync_config(transport="disk", disk_dir=str(tmp_path)), engines) as disk:
        timings = disk.push(WeightExport(other.named_parameters()), 11)
        assert timings["bytes"] > 0
        for url in engines:
            assert_serves(url, other)
            out = generate(url, **ASK)
            assert out["output_ids"] == hf_greedy(other)
            assert out["meta_info"]["weight_version"] == "11"
        disk.push(WeightExport(hf_model(tiny_model_dir).named_parameters()), 12)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights-12"]  # the previous push is removed


def test_a_runs_scratch_directory_is_emptied_at_its_first_push_and_removed_at_close(engines, tiny_model_dir, tmp_path):
    """Unlike a temporary directory, a run's own (RUN_DIR/weights, train.py) is found again by
    the next run there, which removes what a killed run left (a push it never cleaned up)."""
    scratch = tmp_path / "run" / "weights"
    (scratch / "weights-7").mkdir(parents=True)
    (scratch / "weights-7" / "model.safetensors").write_bytes(b"a killed run's push")
    with WeightSync(sync_config(transport="disk"), engines, scratch=scratch) as disk:
        disk.push(WeightExport(hf_model(tiny_model_dir).named_parameters()), 8)
        assert sorted(p.name for p in scratch.iterdir()) == ["weights-8"]
    assert not scratch.exists() and (tmp_path / "run").is_dir()
    with pytest.raises(ValueError, match=r"weight_sync.disk_dir: an empty path; leave it unset"):
        WeightSyncConfig(disk_dir="")  # read as "unset" it was kept by close(), as a directory given


def test_a_push_takes_an_int_version_and_an_export_of_its_kind():
    """The version is an int inside slimish (a string only on SGLang's wire); an adapter export
    needs a WeightSync made for that adapter, an HF one a WeightSync made without: each refused
    before anything is sent (nothing listens at these addresses)."""
    nowhere = "http://127.0.0.1:9"
    weights, adapter = WeightExport([("w", torch.zeros(1))]), WeightExport([("w", torch.zeros(1))], {"r": 4})
    full, lora = WeightSync(sync_config(), [nowhere]), WeightSync(sync_config(), [nowhere], "k", "a", nowhere)
    try:
        with pytest.raises(TypeError, match="weight version: expected an int .*got str '3'"):
            full.push(weights, "3")
        with pytest.raises(WeightSyncError, match="an adapter export, but this WeightSync was made without an adapter"):
            full.push(adapter, 3)
        with pytest.raises(WeightSyncError, match="an HF weights export, but this WeightSync was made for adapter 'a'"):
            lora.push(weights, 3)
    finally:
        full.close()
        lora.close()


def test_update_from_disk_errors(engines, tmp_path):
    r = post(engines[0], "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
    assert r.status_code == 400 and "is not a directory" in r.json()["message"], r.text


# -- the trainer's loop: rollouts, a step, a push, fresh rollouts ---------------------------------


def rollouts(url: str, prompts: list[list[int]], n: int, seed: int) -> list[list[Sample]]:
    """Engine samples at temperature 1 (ids and logprobs exactly as served); reward: the first
    response token is even, so groups have spread."""
    groups = []
    for g, prompt in enumerate(prompts):
        group = []
        for k in range(n):
            params = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": seed * 1000 + g * 10 + k}
            out = generate(url, input_ids=prompt, sampling_params=params, return_logprob=True)
            s = sample_from_reply(prompt, out, group_id=g, index=k)
            s.reward = float(out["output_ids"][0] % 2 == 0)
            group.append(s)
        groups.append(group)
    return groups


def mismatch(trainer: TorchTrainer, samples: list[Sample]) -> float:
    diffs = [(lp - torch.tensor(s.rollout_logprobs)).abs() for s, lp in zip(samples, trainer.logprobs(samples))]
    return torch.cat(diffs).mean().item()


def test_trainer_step_push_and_fresh_rollouts(engines, sync, tiny_model_dir):
    cfg = load_run_config(None, [f"model={tiny_model_dir}", "data.source=unused", "trainer.lr=1e-2"])
    trainer = TorchTrainer(cfg)
    sync.push(trainer.export(), 0)  # the engines served other weights in earlier tests
    prompts = [[3, 14, 15, 92], [6, 53, 58, 97, 93], [2, 38, 46]]
    groups = rollouts(engines[0], prompts, n=4, seed=1)
    metrics = trainer.train_step(groups, step=1)
    assert metrics["train/mismatch"] < 1e-4, metrics
    assert metrics["train/grad_norm"] > 0

    initial = hf_model(tiny_model_dir)
    sync.push(trainer.export(), 1)
    assert not torch.equal(trainer.model.lm_head.weight, initial.lm_head.weight)  # the step moved the weights
    for url in engines:
        assert_serves(url, trainer.model)
        fresh = [s for g in rollouts(url, prompts, n=2, seed=2) for s in g]
        assert {v for s in fresh for v in s.weight_versions} == {1}
        assert mismatch(trainer, fresh) < 1e-4


@pytest.mark.parametrize("arch, dtype", [("qwen3_moe", "float32"), ("qwen2_moe", "bfloat16")])
def test_a_moe_push_sends_the_checkpoint_names(request, tmp_path, arch, dtype):
    """What a torch-backend push carries is what `save_pretrained` writes (and SGLang loads):
    the same names, one tensor per expert, the same values in the wire dtype, each contiguous."""
    from safetensors.torch import load_file

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    cfg = load_run_config(None, [f"model={model_dir}", "data.source=unused", f"trainer.dtype={dtype}"])
    trainer = TorchTrainer(cfg)
    pushed = list(trainer.export().tensors)
    trainer.save_hf(str(tmp_path))
    saved = {k: v for f in tmp_path.glob("*.safetensors") for k, v in load_file(f).items()}
    names = [n for n, _ in pushed]
    assert len(names) == len(set(names)) and set(names) == set(saved)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in saved
    for name, t in pushed:
        assert t.is_contiguous() and t.dtype == getattr(torch, dtype), name
        assert torch.equal(t, saved[name].to(t.dtype)), name


def test_engine_refusing_the_group_fails_connect_at_once(engines):
    refused = WeightSync(sync_config(backend="nccl", group_name="nccl", timeout_s=600.0), engines)
    try:
        with pytest.raises(WeightSyncError, match="Failed to initialize custom process group.*nccl"):
            refused.connect()  # well before the 600 s group timeout
    finally:
        refused.close()


# -- a trainer that dies mid-broadcast ------------------------------------------------------------


def dying_trainer(ports: mp.Queue, shapes: list[list[int]]) -> None:
    """Rank 0 of a 2-rank group: puts its store's port on `ports`, broadcasts the first of
    `shapes`, then dies by SIGKILL."""
    torch.set_num_threads(1)
    store = master_store("127.0.0.1", 2, timedelta(seconds=60))
    ports.put(store.port)
    group = init_custom_process_group("gloo", store, 2, 0, "dying", timedelta(seconds=60))
    torch.distributed.broadcast(torch.ones(shapes[0]), src=0, group=group)
    os.kill(os.getpid(), signal.SIGKILL)


def start_dying_trainer(shapes: list[list[int]]) -> tuple[mp.Process, int]:
    """`dying_trainer` in a child, and the port its store listens on (picked by the OS there)."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    child = ctx.Process(target=dying_trainer, args=(ports, shapes), daemon=True)
    child.start()
    return child, ports.get(timeout=WAIT_S)


def test_trainer_killed_mid_broadcast_leaves_torn_weights_that_the_engine_refuses(engines, sync, tiny_model_dir):
    """Weights are received in place, so a broadcast that dies halfway leaves them half new: the
    engine says so, refuses to generate and reports unhealthy until a full push arrives."""
    url, model = engines[0], hf_model(tiny_model_dir)
    names, shapes = zip(*[(n, list(p.shape)) for n, p in model.named_parameters()])
    child, port = start_dying_trainer(list(shapes))
    try:
        join = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "dying",
            "backend": "gloo",
        }
        assert post(url, "/init_weights_update_group", join).json()["success"]
        reply = {}
        update = {
            "names": list(names),
            "dtypes": ["float32"] * len(names),
            "shapes": list(shapes),
            "group_name": "dying",
        }
        poster = threading.Thread(
            target=lambda: reply.update(post(url, "/update_weights_from_distributed", update).json())
        )
        poster.start()
        child.join(timeout=WAIT_S)
        poster.join(timeout=WAIT_S)
        assert child.exitcode == -signal.SIGKILL
        assert reply["success"] is False and "were half-received" in reply["message"], reply

        r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        assert r.status_code == 503 and "weights are not whole" in r.json()["error"]["message"], r.text
        assert http().get(url + "/health").status_code == 503
        assert http().get(engines[1] + "/health").status_code == 200  # not in that group

        sync.push(WeightExport(list(model.named_parameters())), 21)  # every parameter again, by the module's group
        assert http().get(url + "/health").status_code == 200
        assert_serves(url, model)
        assert generate(url, **ASK)["meta_info"]["weight_version"] == "21"
        assert post(url, "/destroy_weights_update_group", {"group_name": "dying"}).json()["success"]
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=10)


def test_an_engine_started_to_await_weights_serves_only_after_a_full_push(tiny_model_dir, tmp_path):
    """How a restarted engine rejoins a run: nothing is served (503, /health too) until every
    parameter has been pushed, so the router cannot send it rollouts on its initial weights."""
    proc = engine_process(tiny_model_dir, log_path=tmp_path / "engine.log", await_weights=True)
    proc.health_path = "/model_info"  # /health is 503 by design until the push
    try:
        proc.start(WAIT_S)
        assert http().get(proc.url + "/health").status_code == 503
        r = post(proc.url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
        assert r.status_code == 503 and "have not been pushed" in r.json()["error"]["message"], r.text
        model = hf_model(tiny_model_dir)
        named = list(model.named_parameters())
        with WeightSync(sync_config(group_name="late"), [proc.url]) as late:
            late.push(WeightExport(named[:-1]), 6)  # all but one parameter: still not whole
            assert http().get(proc.url + "/health").status_code == 503
            late.push(WeightExport(named), 7)
        assert http().get(proc.url + "/health").status_code == 200
        assert generate(proc.url, **ASK)["meta_info"]["weight_version"] == "7"
    finally:
        proc.stop()
