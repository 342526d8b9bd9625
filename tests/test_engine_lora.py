"""LoRA serving in the built-in engine, against PEFT as the reference.

Three PEFT adapters of different ranks and targets (B randomised: PEFT starts it at zero) are
saved, served by a real engine process, and checked row by row against each `PeftModel` run
in this process: in one mixed /generate batch with base rows, with fewer batch slots than
adapters, through the OpenAI routes, and after broadcast pushes into a named adapter from this
process as trainer rank 0 (a real gloo group), including one whose trainer dies mid-push.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import signal
import threading
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from helpers import running_engines, running_router
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from test_trainer_torch import config
from test_weight_sync import start_dying_trainer
from transformers import AutoModelForCausalLM

from slimish.client import Client, ServerError
from slimish.distributed import init_custom_process_group, master_store
from slimish.engine.config import EngineConfig
from slimish.engine.lora import AdapterError, AdapterRef, LoraManager, read_adapter
from slimish.moe import PER_EXPERT, fused_experts
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.lora import write_adapter_dir
from slimish.trainer.torch_backend import TorchTrainer
from slimish.trainer.weight_sync import WeightSync

WAIT_S = 120.0
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [
    [5, 17, 42, 99, 7],
    [3, 1, 4, 1, 5, 9, 2],
    [8, 8, 8],
    [100, 200, 300, 400],
    [7, 6, 5],
    [11, 12, 13, 14, 15, 16],
]
ROWS = ["a1", None, "a2", "a3", None, "a1"]  # None: the base model
# name -> (rank, alpha, target modules, use_rslora): ranks below --max-lora-rank are padded.
SPECS = {
    "a1": (4, 8, ["q_proj", "v_proj"], False),
    "a2": (8, 16, "all-linear", True),
    "a3": (2, 3, ["o_proj", "down_proj"], False),
}


@functools.cache
def http() -> httpx.Client:
    return httpx.Client(timeout=WAIT_S)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return http().post(url + path, json=body)


def base_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, out: Path, seed: int, rank: int, alpha: int, targets, rslora: bool) -> Path:
    model = get_peft_model(
        base_model(model_dir),
        LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(tiny_model_dir, root / name, seed, *spec)
        for seed, (name, spec) in enumerate(SPECS.items(), 1)
    }


def reference(model_dir: Path, adapter: Path | None, state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """The base model, or it with a PEFT adapter (and `state` set into it, as a trainer's step would)."""
    if adapter is None:
        return base_model(model_dir)
    model = PeftModel.from_pretrained(base_model(model_dir), adapter).eval()
    if state is not None:
        set_peft_model_state_dict(model, state)
    return model


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, adapter_dirs, tmp_path_factory):
    """a1 from --lora-paths; a2 and a3 loaded over HTTP, as a run's first push does."""
    flags = dict(
        enable_lora=True, lora_paths=[f"a1={adapter_dirs['a1']}"], max_lora_rank=8, lora_target_modules=["all"]
    )
    with running_engines(tiny_model_dir, tmp_path_factory, n=1, timeout=WAIT_S, weight_sync_timeout_s=60, **flags) as (
        proc,
    ):
        for name in ("a2", "a3"):
            r = post(proc.url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dirs[name])})
            assert r.status_code == 200 and r.json()["success"], r.text
        yield proc.url


def logprobs_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_matches(reply: dict, prompt: list[int], model: torch.nn.Module) -> float:
    """Greedy tokens equal the model's argmax after each prefix; input and output logprobs within
    1e-4. Returns the largest difference."""
    out = reply["output_ids"]
    ref = logprobs_of(model, prompt + out)
    n = len(prompt)
    assert out == ref[n - 1 : n - 1 + len(out)].argmax(dim=-1).tolist()
    meta = reply["meta_info"]
    got_in = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    got_out = [lp for lp, _, _ in meta["output_token_logprobs"]]
    want_in = [ref[j - 1, prompt[j]].item() for j in range(1, n)]
    want_out = [ref[n - 1 + k, t].item() for k, t in enumerate(out)]
    diff = max(abs(a - b) for a, b in zip(got_in + got_out, want_in + want_out))
    assert diff < 1e-4, diff
    return diff


def mixed_batch(url: str, rows: list[str | None] = ROWS) -> list[dict]:
    body = {
        "input_ids": PROMPTS,
        "lora_path": rows,
        "sampling_params": GREEDY,
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = post(url, "/generate", body)
    assert r.status_code == 200, r.text
    return r.json()


# -- one batch, several adapters ------------------------------------------------------------------


def test_mixed_batch_matches_each_peft_model(lora_engine, tiny_model_dir, adapter_dirs):
    replies = mixed_batch(lora_engine)
    models = {name: reference(tiny_model_dir, adapter_dirs.get(name)) for name in set(ROWS)}
    for prompt, name, reply in zip(PROMPTS, ROWS, replies):
        assert_matches(reply, prompt, models[name])
        assert reply["meta_info"]["weight_version"] == "default"
    # The adapters matter: the same prompt under a1 and under the base model differ.
    base, a1 = logprobs_of(models[None], PROMPTS[0]), logprobs_of(models["a1"], PROMPTS[0])
    assert (base - a1).abs().max() > 0.1


def test_fewer_slots_than_adapters_rows_wait_and_stay_exact(
    tiny_model_dir, adapter_dirs, tmp_path_factory, lora_engine
):
    """One slot for three adapters: rows of a second adapter wait for the first's to finish."""
    paths = [json.dumps({"lora_name": n, "lora_path": str(p), "pinned": False}) for n, p in adapter_dirs.items()]
    with running_engines(
        tiny_model_dir, tmp_path_factory, n=1, timeout=WAIT_S, lora_paths=paths, max_loras_per_batch=1
    ) as (proc,):
        narrow = mixed_batch(proc.url)
    wide = mixed_batch(lora_engine)
    assert [r["output_ids"] for r in narrow] == [r["output_ids"] for r in wide]
    for a, b in zip(narrow, wide):
        lp = lambda r: [x[0] for x in r["meta_info"]["output_token_logprobs"]]  # noqa: E731
        assert max(abs(x - y) for x, y in zip(lp(a), lp(b))) < 1e-5


def test_openai_routes_take_the_adapter_as_model(lora_engine, tiny_model_dir, adapter_dirs):
    served = http().get(lora_engine + "/v1/models").json()["data"]
    base = served[0]["id"]
    assert [(m["id"], m["parent"]) for m in served] == [(base, None), ("a1", base), ("a2", base), ("a3", base)]
    assert served[2]["root"] == str(adapter_dirs["a2"])
    assert http().get(lora_engine + "/v1/models/a3").json()["parent"] == base

    native = post(
        lora_engine, "/generate", {"input_ids": PROMPTS[0], "lora_path": "a3", "sampling_params": GREEDY}
    ).json()
    for model in ("a3", f"{base}:a3"):
        body = {
            "model": model,
            "prompt": PROMPTS[0],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = post(lora_engine, "/v1/completions", body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == native["output_ids"]


def test_bad_adapter_requests_are_refused_naming_the_field(lora_engine, tiny_model_dir, adapter_dirs, tmp_path):
    r = post(lora_engine, "/generate", {"input_ids": PROMPTS[0], "lora_path": "nope", "sampling_params": GREEDY})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "lora_path: lora adapter 'nope' is not loaded"
    ), r.text
    r = post(lora_engine, "/generate", {"input_ids": PROMPTS[:2], "lora_path": ["a1"], "sampling_params": GREEDY})
    assert r.status_code == 400 and "lora_path: got 1 values for 2 prompts" in r.text
    r = post(lora_engine, "/v1/completions", {"model": "typo", "prompt": "hi", "max_tokens": 2})
    assert (
        r.status_code == 400
        and "model: 'typo' is neither the served model" in r.text
        and r.json()["error"]["param"] == "model"
    )

    def load(name: str, path: Path) -> dict:
        r = post(lora_engine, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        assert sorted(r.json()["loaded_adapters"]) == ["a1", "a2", "a3"]
        return r.json()["error_message"]

    assert "already loaded" in load("a1", adapter_dirs["a1"])
    assert "expected a PEFT adapter directory" in load("x", tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    assert "cannot read it (KeyError: 'r')" in load("x", tmp_path)
    big = make_adapter(tiny_model_dir, tmp_path / "big", 9, 16, 16, ["q_proj"], False)
    assert "rank 16 is over this engine's 8 (--max-lora-rank)" in load("big", big)
    r = post(lora_engine, "/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]


def test_client_loads_and_unloads_and_new_requests_are_refused(lora_engine, adapter_dirs):
    async def main() -> None:
        async with Client(lora_engine) as c:
            loaded = await c.load_lora_adapter("extra", str(adapter_dirs["a3"]))
            assert loaded.loaded_adapters == {
                **{n: str(p) for n, p in adapter_dirs.items()},
                "extra": str(adapter_dirs["a3"]),
            }
            same = [
                (await c.generate(input_ids=PROMPTS[3], lora_path=n, sampling_params=GREEDY)).output_ids
                for n in ("a3", "extra")
            ]
            assert same[0] == same[1]
            assert "extra" not in (await c.unload_lora_adapter("extra")).loaded_adapters
            assert "extra" not in [m["id"] for m in (await c.models())["data"]]
            with pytest.raises(ServerError, match="lora_path: lora adapter 'extra' is not loaded"):
                await c.generate(input_ids=PROMPTS[3], lora_path="extra", sampling_params=GREEDY)
            with pytest.raises(ServerError, match="HTTP 400: lora adapter 'extra' is not loaded"):
                await c.unload_lora_adapter("extra")

    asyncio.run(main())


def test_slots_are_reused_least_recently_used_never_from_a_running_row(tiny_model_dir, adapter_dirs):
    model = base_model(tiny_model_dir)
    lora = LoraManager(
        model,
        EngineConfig(model=str(tiny_model_dir), max_loras_per_batch=2, max_lora_rank=8, lora_target_modules=["all"]),
    )
    for name, path in adapter_dirs.items():
        lora.add(read_adapter(AdapterRef(name, str(path), pinned=name == "a1"), torch.float32, model.device))
    assert lora.acquire("a1", set()) and lora.acquire("a2", set())
    assert not lora.acquire("a3", busy={"a2"})  # a1 is pinned, a2 is in use: a3's row waits
    assert lora.acquire("a3", busy=set()) and list(lora.slot_of) == ["a1", "a3"]  # a2 made room
    assert not lora.acquire("a2", busy={"a3"})
    with pytest.raises(AdapterError, match="pinned adapters must leave one of the 2 slots free"):
        lora.add(read_adapter(AdapterRef("p2", str(adapter_dirs["a3"]), pinned=True), torch.float32, model.device))
    with pytest.raises(ValueError, match=r"max_lora_rank \(--max-lora-rank\) is required"):
        EngineConfig(model=str(tiny_model_dir), enable_lora=True)


# -- adapter pushes by broadcast --------------------------------------------------------------------


def join_group(url: str, name: str) -> torch.distributed.ProcessGroup:
    """This process as rank 0 of a 2-rank gloo group with the engine."""
    store = master_store("127.0.0.1", 2, timedelta(seconds=60))
    body = {
        "master_address": "127.0.0.1",
        "master_port": store.port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": name,
        "backend": "gloo",
    }
    reply: dict = {}
    joiner = threading.Thread(target=lambda: reply.update(post(url, "/init_weights_update_group", body).json()))
    joiner.start()
    group = init_custom_process_group("gloo", store, 2, 0, name, timedelta(seconds=60))
    joiner.join(WAIT_S)
    assert reply.get("success"), reply
    return group


def push(url: str, group, group_name: str, lora_name: str, named: dict[str, torch.Tensor], version: str) -> dict:
    body = {
        "names": list(named),
        "dtypes": ["float32"] * len(named),
        "shapes": [list(t.shape) for t in named.values()],
        "group_name": group_name,
        "lora_name": lora_name,
        "weight_version": version,
    }
    reply: dict = {}
    poster = threading.Thread(target=lambda: reply.update(post(url, "/update_weights_from_distributed", body).json()))
    poster.start()
    for t in named.values():
        torch.distributed.broadcast(t, src=0, group=group)
    poster.join(WAIT_S)
    return reply


def seeded_like(adapter: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(t.shape, generator=g) * 0.3
        for name, t in load_file(adapter / "adapter_model.safetensors").items()
    }


def served_tensor(url: str, lora_name: str, name: str, rows: int) -> torch.Tensor:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows, "lora_name": lora_name})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


def version(url: str, lora_name: str | None = None) -> str:
    return (
        http()
        .get(url + "/get_weight_version", params={"lora_name": lora_name} if lora_name else None)
        .json()["weight_version"]
    )


@pytest.fixture(scope="module")
def group(lora_engine):
    g = join_group(lora_engine, "lora_push")
    yield g
    post(lora_engine, "/destroy_weights_update_group", {"group_name": "lora_push"})
    torch.distributed.destroy_process_group(g)


def test_pushed_adapter_tensors_are_served_exactly_and_versioned_alone(
    lora_engine, group, tiny_model_dir, adapter_dirs
):
    pushed = seeded_like(adapter_dirs["a2"], 7)
    reply = push(lora_engine, group, "lora_push", "a2", pushed, "7")
    assert reply["success"] and "Weight version updated to 7" in reply["message"], reply
    for name, t in pushed.items():  # the PEFT names, bit for bit
        assert torch.equal(served_tensor(lora_engine, "a2", name, t.shape[0]), t), name
    assert (version(lora_engine), version(lora_engine, "a1"), version(lora_engine, "a2")) == ("default", "default", "7")

    replies = mixed_batch(lora_engine, ["a2", None, "a2", "a1", None, "a2"])
    assert [r["meta_info"]["weight_version"] for r in replies] == ["7", "default", "7", "default", "default", "7"]
    trained = reference(tiny_model_dir, adapter_dirs["a2"], pushed)
    for i in (0, 2, 5):
        assert_matches(replies[i], PROMPTS[i], trained)
    assert_matches(replies[3], PROMPTS[3], reference(tiny_model_dir, adapter_dirs["a1"]))


def test_refused_adapter_pushes_name_the_problem(lora_engine, group):
    """Refused before any receive (the trainer has not broadcast): nothing changes. The group
    exists (else the engine refuses for that first, whatever the adapter)."""
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    cases = [
        ({"lora_name": "nope", "names": [name], "shapes": [[4, 64]]}, "lora_name: lora adapter 'nope' is not loaded"),
        ({"lora_name": "a1", "names": [name], "shapes": [[8, 64]]}, "does not match the parameter's shape [4, 64]"),
        ({"lora_name": "a1", "names": ["model.norm.weight"], "shapes": [[64]]}, "is not a tensor of lora adapter 'a1'"),
    ]
    for body, message in cases:
        r = post(
            lora_engine, "/update_weights_from_distributed", {**body, "dtypes": ["float32"], "group_name": "lora_push"}
        )
        assert r.status_code == 400 and message in r.json()["message"], r.text
    assert version(lora_engine, "a1") == "default"


def test_trainer_killed_mid_adapter_push_leaves_only_that_adapter_refusing(
    lora_engine, group, tiny_model_dir, adapter_dirs
):
    url = lora_engine
    r = post(url, "/load_lora_adapter", {"lora_name": "torn", "lora_path": str(adapter_dirs["a3"])})
    assert r.json()["success"], r.text
    fresh = seeded_like(adapter_dirs["a3"], 11)
    child, port = start_dying_trainer([list(t.shape) for t in fresh.values()])
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
        body = {
            "names": list(fresh),
            "dtypes": ["float32"] * len(fresh),
            "shapes": [list(t.shape) for t in fresh.values()],
            "group_name": "dying",
            "lora_name": "torn",
            "weight_version": "never",
        }
        reply = post(url, "/update_weights_from_distributed", body).json()
        child.join(timeout=WAIT_S)
        assert child.exitcode == -signal.SIGKILL
        assert reply["success"] is False and "lora adapter 'torn' is not whole" in reply["message"], reply

        r = post(url, "/generate", {"input_ids": PROMPTS[0], "lora_path": "torn", "sampling_params": GREEDY})
        assert r.status_code == 503 and "lora adapter 'torn' is not whole" in r.json()["error"]["message"], r.text
        assert http().get(url + "/health").status_code == 200  # the base model and other adapters still serve
        replies = mixed_batch(url, ["a3", None, "a3", "a3", None, "a3"])
        assert all(r["meta_info"]["finish_reason"]["type"] == "length" for r in replies)
        assert version(url, "torn") == "default"

        assert push(url, group, "lora_push", "torn", fresh, "8")["success"]  # a complete push makes it whole again
        out = post(
            url,
            "/generate",
            {
                "input_ids": PROMPTS[0],
                "lora_path": "torn",
                "sampling_params": GREEDY,
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        ).json()
        assert out["meta_info"]["weight_version"] == "8"
        assert_matches(out, PROMPTS[0], reference(tiny_model_dir, adapter_dirs["a3"], fresh))
        assert post(url, "/destroy_weights_update_group", {"group_name": "dying"}).json()["success"]
    finally:
        if child.is_alive():
            child.kill()
        child.join(timeout=10)


def test_prefix_cache_never_serves_one_adapters_kv_to_another(lora_engine, tiny_model_dir, adapter_dirs):
    """A prompt of 2 whole cache pages, sent for the base, then an adapter, then a reload under the
    same name: each finds only its own KV (`cached_tokens`), and every reply equals its PEFT model."""
    prompt = [(7 * i) % 300 + 3 for i in range(140)]
    pages = 128  # 2 pages of the default --page-size 64; the last, partial page is never cached

    def ask(lora: str | None) -> dict:
        body = {"input_ids": prompt, "lora_path": lora, "sampling_params": GREEDY, "return_logprob": True}
        r = post(lora_engine, "/generate", body)
        assert r.status_code == 200, r.text
        return r.json()

    def check(reply: dict, model: torch.nn.Module) -> None:
        out, ref = reply["output_ids"], logprobs_of(model, prompt + reply["output_ids"])
        n = len(prompt)
        assert out == ref[n - 1 : n - 1 + len(out)].argmax(dim=-1).tolist()
        got = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        assert max(abs(g - ref[n - 1 + k, t].item()) for k, (g, t) in enumerate(zip(got, out))) < 1e-4

    base = ask(None)
    check(base, reference(tiny_model_dir, None))
    first, again = ask("a1"), ask("a1")
    assert (first["meta_info"]["cached_tokens"], again["meta_info"]["cached_tokens"]) == (0, pages)
    check(again, reference(tiny_model_dir, adapter_dirs["a1"]))
    assert ask(None)["meta_info"]["cached_tokens"] == pages
    for source in ("a2", "a3"):  # one name, two adapters: the second load must not see the first's KV
        r = post(lora_engine, "/load_lora_adapter", {"lora_name": "reloaded", "lora_path": str(adapter_dirs[source])})
        assert r.status_code == 200, r.text
        reply = ask("reloaded")
        assert reply["meta_info"]["cached_tokens"] == 0
        check(reply, reference(tiny_model_dir, adapter_dirs[source]))
        assert post(lora_engine, "/unload_lora_adapter", {"lora_name": "reloaded"}).status_code == 200


# -- MoE: adapters on attention and on each expert ---------------------------------------------------

MOE_ROWS = ["m1", "m2", None, "m2", None, "m1"]
# name -> (rank, alpha, targets). Each expert's gate and up get their own A: SGLang's general form.
MOE_SPECS = {
    "m1": (4, 8, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj")),
    "m2": (2, 3, ("o_proj", "gate_proj", "up_proj", "down_proj")),
}


def per_expert_adapter(model_dir: Path, out: Path, seed: int, rank: int, alpha: int, targets: tuple[str, ...]) -> Path:
    """A PEFT-format adapter directory in the per-expert form SGLang reads (`...experts.{e}.{proj}`):
    random A and B on the targeted linears (a shared expert's too) and on every expert's projections."""
    model = base_model(model_dir)
    shapes = {
        name: (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets
    }
    for name, experts in fused_experts(model).items():
        n, hidden, inter = experts.down_proj.shape
        dims = {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
        shapes.update({f"{name}.{e}.{p}": dims[p] for e in range(n) for p in dims if p in targets})
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (rows, cols) in shapes.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, cols, generator=g) * 0.3
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, rank, generator=g) * 0.3
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0}
    return write_adapter_dir(out, {**config, "target_modules": sorted(targets)}, tensors)


def merged(model_dir: Path, adapter: Path, experts: bool = True) -> torch.nn.Module:
    """A reference written from the per-expert form's meaning: the base with `scale * B @ A` added
    to each targeted weight, an expert's into its rows of the fused `gate_up_proj` / `down_proj`
    (`experts=False`: the attention's and shared expert's deltas only)."""
    model = base_model(model_dir)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    with torch.no_grad():
        for name, a in tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            delta = cfg["lora_alpha"] / cfg["r"] * tensors[name.replace("lora_A", "lora_B")] @ a
            if match := PER_EXPERT.match(module):
                if not experts:
                    continue
                fused, e = model.get_submodule(match["prefix"]), int(match["expert"])
                inter = fused.down_proj.shape[2]
                rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter)}.get(match["proj"])
                target = fused.down_proj[e] if rows is None else fused.gate_up_proj[e, rows]
            else:
                target = model.get_submodule(module).weight
            target += delta
    return model


@pytest.fixture(scope="module")
def moe_adapter_dirs(tiny_qwen3_moe_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-adapters")
    return {
        name: per_expert_adapter(tiny_qwen3_moe_dir, root / name, seed, *spec)
        for seed, (name, spec) in enumerate(MOE_SPECS.items(), 11)
    }


@pytest.fixture(scope="module")
def moe_engine(tiny_qwen3_moe_dir, moe_adapter_dirs, tmp_path_factory):
    """Both adapters from --lora-paths; the targets (experts' projections included) are theirs."""
    paths = [f"{name}={path}" for name, path in moe_adapter_dirs.items()]
    with running_engines(
        tiny_qwen3_moe_dir, tmp_path_factory, n=1, timeout=WAIT_S, weight_sync_timeout_s=60, lora_paths=paths
    ) as (proc,):
        yield proc.url


def test_moe_mixed_batch_matches_peft_row_by_row(moe_engine, tiny_qwen3_moe_dir, moe_adapter_dirs):
    """Rows of two expert adapters and the base in one batch, each equal to PEFT's model of its
    adapter alone (PEFT reads the per-expert form through its v4 converter: rank 2r, block-diagonal),
    which is itself the merged reference; without the experts' deltas the rows would differ."""
    replies = mixed_batch(moe_engine, MOE_ROWS)
    models = {name: reference(tiny_qwen3_moe_dir, moe_adapter_dirs.get(name)) for name in set(MOE_ROWS)}
    for prompt, name, reply in zip(PROMPTS, MOE_ROWS, replies):
        assert_matches(reply, prompt, models[name])
    for name, path in moe_adapter_dirs.items():
        peft = logprobs_of(models[name], PROMPTS[1])
        torch.testing.assert_close(peft, logprobs_of(merged(tiny_qwen3_moe_dir, path), PROMPTS[1]), atol=1e-4, rtol=0)
        assert (peft - logprobs_of(merged(tiny_qwen3_moe_dir, path, experts=False), PROMPTS[1])).abs().max() > 0.1


def test_moe_adapter_push_lands_in_its_slot(moe_engine, tiny_qwen3_moe_dir, moe_adapter_dirs, tmp_path):
    """A broadcast push of m1's per-expert tensors: served bit for bit by name, and m1's rows are
    those of the pushed adapter while m2's and the base's are unchanged."""
    group = join_group(moe_engine, "moe_push")
    try:
        pushed = seeded_like(moe_adapter_dirs["m1"], 7)
        reply = push(moe_engine, group, "moe_push", "m1", pushed, "7")
        assert reply["success"], reply
        name = "base_model.model.model.layers.1.mlp.experts.5.up_proj.lora_B.weight"
        assert torch.equal(served_tensor(moe_engine, "m1", name, pushed[name].shape[0]), pushed[name])
        config = json.loads((moe_adapter_dirs["m1"] / "adapter_config.json").read_text())
        now = {"m1": write_adapter_dir(tmp_path / "m1-7", config, pushed), "m2": moe_adapter_dirs["m2"], None: None}
        replies = mixed_batch(moe_engine, MOE_ROWS)
        versions = [r["meta_info"]["weight_version"] for r in replies]
        assert versions == ["7" if n == "m1" else "default" for n in MOE_ROWS]
        for prompt, name, reply in zip(PROMPTS, MOE_ROWS, replies):
            assert_matches(reply, prompt, reference(tiny_qwen3_moe_dir, now[name]))
    finally:
        post(moe_engine, "/destroy_weights_update_group", {"group_name": "moe_push"})
        torch.distributed.destroy_process_group(group)


def test_qwen2_moe_rows_equal_a_reference_and_the_router_is_refused(tiny_qwen2_moe_dir, tmp_path):
    """Qwen2-MoE (PEFT has no converter for its per-expert form, so the reference is `merged`): the
    engine's LoRA modules on the HF forward, one batch of {m1, m2, base} rows, the shared expert's
    plain linears and the routed experts adapted. With no adapter row the experts' own path runs."""
    dirs = {
        name: per_expert_adapter(tiny_qwen2_moe_dir, tmp_path / name, seed, *spec)
        for seed, (name, spec) in enumerate(MOE_SPECS.items(), 21)
    }
    model = base_model(tiny_qwen2_moe_dir)
    ids = torch.tensor([PROMPTS[0], [3, 1, 4, 1, 5], [100, 200, 300, 400, 7]])
    with torch.no_grad():
        plain = model(ids).logits
    cfg = EngineConfig(model=str(tiny_qwen2_moe_dir), max_loras_per_batch=2, max_lora_rank=4)
    lora = LoraManager(model, cfg)
    for name, path in dirs.items():
        lora.add(read_adapter(AdapterRef(name, str(path)), torch.float32, model.device))
        assert lora.acquire(name, set())
    rows = ["m1", "m2", None]
    with torch.no_grad(), lora.rows(rows):
        got = model(ids).logits
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)
        for i, name in enumerate(rows):
            want = (merged(tiny_qwen2_moe_dir, dirs[name]) if name else base_model(tiny_qwen2_moe_dir))(ids[i : i + 1])
            torch.testing.assert_close(got[i], want.logits[0], atol=1e-4, rtol=0)
    with pytest.raises(AdapterError, match=r"\['gate'\] is this model's MoE router \(e.g. model.layers.0.mlp.gate\)"):
        LoraManager(base_model(tiny_qwen2_moe_dir), dataclasses.replace(cfg, lora_target_modules=["gate"]))


def test_moe_trainer_push_serves_the_training_models_logprobs(moe_engine, tiny_qwen3_moe_dir):
    """The torch trainer's MoE adapter (experts through PEFT's ParamWrapper) pushed as a run pushes
    it (the first push creates it from its directory, the second broadcasts into its slot): the
    engine's log-probs under it are the training model's."""
    lora = ("enabled=true", "rank=4", "alpha=8", "name=t", "target_modules=[q_proj,gate_proj,up_proj,down_proj]")
    trainer = TorchTrainer(config(tiny_qwen3_moe_dir, *(f"trainer.lora.{o}" for o in lora)))
    g = torch.Generator().manual_seed(3)
    with (
        running_router(worker_urls=[moe_engine]) as router,
        WeightSync(WeightSyncConfig(timeout_s=60), [moe_engine], adapter="t", router_url=router) as sync,
    ):
        for version in (0, 1):
            with torch.no_grad():  # a step's worth of change: every A and B moves
                for name, p in trainer.model.named_parameters():
                    if ".lora_" in name:
                        p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            sync.push(trainer.export(), version)
    prompt = PROMPTS[1]
    body = {"input_ids": prompt, "lora_path": "t", "sampling_params": GREEDY, "return_logprob": True}
    body["logprob_start_len"] = 0
    reply = post(moe_engine, "/generate", body).json()
    assert reply["meta_info"]["weight_version"] == "1"
    assert_matches(reply, prompt, trainer.model)
