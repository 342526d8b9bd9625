"""Colocated mode (`launch.colocate`, docs/colocate.md): engines and trainer map one shared weight
store, a push is a version flip that copies nothing, and the engines' KV cache is released while
the trainer trains."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import torch
from helpers import generate, post, run_quickstart, running_router, wait_for
from transformers import AutoConfig, AutoModelForCausalLM

from slimish.colocate import DATA, PREFIX, SHM, WeightStore, plan_layout, shared_store
from slimish.config import load_run_config
from slimish.engine.config import EngineConfig
from slimish.launch.config import LaunchConfig
from slimish.launch.local import engine_process
from slimish.processes import start_all
from slimish.trainer.backend import WeightExport
from slimish.trainer.colocated import ColocatedSync
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.engine_control import WeightSyncError
from slimish.trainer.weight_sync import WeightSync

LORA = ["trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8"]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
IDS = [5, 17, 42, 99, 7, 300, 301, 302, 60, 61, 62, 63]


@pytest.fixture(scope="module")
def big_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~25M fp32 parameters (~100 MB) on the tiny model's tokenizer: a second copy of them in an
    engine's memory is plain to see."""
    out = tmp_path_factory.mktemp("big-model")
    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.update({"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8})
    config.update({"num_key_value_heads": 4, "head_dim": 64})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, out / f.name)
    return out


def private_kb(pid: int) -> int:
    """Memory only this process holds (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup)."""
    rows = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return sum(int(rows[key].split()[0]) for key in ("Private_Clean", "Private_Dirty"))


def store_mapping(pid: int, store: WeightStore) -> dict[str, int]:
    """The store's mapping in /proc/PID/smaps: its inode and kB figures (empty if not mapped)."""
    lines, found = Path(f"/proc/{pid}/smaps").read_text().splitlines(), {}
    for i, line in enumerate(lines):
        if line.endswith(str(store.path / DATA)):
            found = {"inode": int(line.split()[4])}
            for row in lines[i + 1 :]:
                key, _, value = row.partition(":")
                if not value.strip().endswith("kB"):
                    break
                found[key] = int(value.split()[0])
    return found


def input_logprobs(url: str, ids: list[int], **fields: object) -> tuple[torch.Tensor, str]:
    """The engine's logprobs of `ids[1:]` and the weight version it reports."""
    reply = generate(
        url, input_ids=ids, return_logprob=True, logprob_start_len=0, sampling_params={"max_new_tokens": 0}, **fields
    )
    rows = reply["meta_info"]["input_token_logprobs"][1:]
    return torch.tensor([lp for lp, _, _ in rows]), reply["meta_info"]["weight_version"]


def model_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's logprobs of `ids[1:]` (with their graph)."""
    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def test_engine_and_trainer_share_one_copy_and_a_push_copies_nothing(big_model: Path, tmp_path: Path) -> None:
    with shared_store(big_model) as store:
        trainer = AutoModelForCausalLM.from_pretrained(big_model, dtype=torch.float32)
        store.attach(trainer, fill=True, field="trainer")
        coloc = engine_process(
            big_model, log_path=tmp_path / "coloc.log", shared_weights=store.path, cpu_packed_linear=False
        )
        plain = engine_process(big_model, log_path=tmp_path / "plain.log", cpu_packed_linear=False)
        with ExitStack() as stack:
            stack.callback(coloc.stop)
            stack.callback(plain.stop)
            start_all([coloc, plain], 300)
            sync = ColocatedSync(store, WeightSync(WeightSyncConfig(timeout_s=60), [coloc.url]))
            try:
                sync.connect()
                before = model_logprobs(trainer, IDS).detach()
                for url in (coloc.url, plain.url):  # every weight read once
                    assert torch.allclose(input_logprobs(url, IDS)[0], before, atol=1e-4)
                # One copy: the engine maps the trainer's file (same inode), its pages are resident
                # and shared, and it holds a store's worth less private memory than an engine
                # that loaded the same checkpoint on its own.
                mine, theirs = store_mapping(coloc.proc.pid, store), store_mapping(os.getpid(), store)
                assert mine and mine["inode"] == theirs["inode"]
                assert mine["Shared_Clean"] + mine["Shared_Dirty"] >= 0.9 * store.nbytes / 1024
                saved = private_kb(plain.proc.pid) - private_kb(coloc.proc.pid)
                assert saved >= 0.8 * store.nbytes / 1024, (saved, store.nbytes)

                optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
                (-model_logprobs(trainer, IDS).mean()).backward()
                optimizer.step()  # in place: the engine's weights
                after = model_logprobs(trainer, IDS).detach()
                assert (after - before).abs().max() > 1e-2  # the step moved them

                sync.release()
                pushed = sync.push(WeightExport(trainer.named_parameters()), 1)
                assert pushed["bytes"] == 0 and pushed["buckets"] == 0
                served, version = input_logprobs(coloc.url, IDS)
                assert version == "1" and torch.allclose(served, after, atol=1e-4)
                # The trainer's weights are not the engine's to overwrite: a load into them is refused.
                refused = post(coloc.url, "/update_weights_from_disk", {"model_path": str(big_model)})
                assert refused.status_code == 400 and "--shared-weights" in refused.json()["message"]
                async_step(coloc.url, sync, trainer, optimizer)
                with pytest.raises(WeightSyncError, match="not in the weight store"):
                    sync.push(WeightExport([(n, p.detach().clone()) for n, p in trainer.named_parameters()]), 3)
            finally:
                sync.close()
    assert not store.path.exists()


def async_step(url: str, sync: ColocatedSync, trainer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An async step with a request running: `hold` pauses it between two engine steps (retract:
    its KV is recomputed after), the optimiser step writes the engine's weights, and the push
    flips the version to 2 and continues. Every token is the version it is labelled with: its
    logprob is that of the weights of its label, to the decimal, not of a half-written step."""

    def running() -> bool:
        return httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]["#running-req"] == 1

    old = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    wish = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(generate, url, input_ids=IDS, sampling_params=wish, return_logprob=True)
        wait_for(running, "the request to run")
        sync.hold()
        (-model_logprobs(trainer, IDS).mean()).backward()
        optimizer.step()
        optimizer.zero_grad()
        pushed = sync.push(WeightExport(trainer.named_parameters()), 2)
        meta = reply.result(timeout=120)["meta_info"]
    assert pushed["bytes"] == 0 and pushed["paused"] > 0 and sync.held is None
    spans = [(s["version"], s["start"], s["end"]) for s in meta["weight_versions"]]
    assert [v for v, _, _ in spans] == ["1", "2"] and spans[0][1:] == (0, spans[1][1]) and spans[1][2] == 48, spans
    assert meta["num_retractions"] == 1
    ids = IDS + [t for _, t, _ in meta["output_token_logprobs"]]
    served = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
    with torch.no_grad():
        by_old = torch.func.functional_call(trainer, old, (torch.tensor([ids]),)).logits[0]
        by_new = trainer(torch.tensor([ids])).logits[0]
    made = torch.tensor(ids[len(IDS) :])[:, None]
    old_lp, new_lp = (torch.log_softmax(x[len(IDS) - 1 : -1], -1).gather(1, made)[:, 0] for x in (by_old, by_new))
    cut = spans[1][1]
    assert torch.allclose(served[:cut], old_lp[:cut], atol=1e-4) and torch.allclose(
        served[cut:], new_lp[cut:], atol=1e-4
    )
    assert (old_lp - new_lp).abs().max() > 1e-2  # the two versions are told apart
    assert input_logprobs(url, IDS)[1] == "2"


def test_layout_ties_names_and_aligns_views(tiny_qwen2_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    layout = plan_layout(model.named_parameters(remove_duplicate=False))
    assert layout["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    entries = list(layout["tensors"].values())
    assert all(e["offset"] % 64 == 0 for e in entries) and entries[0]["offset"] == 0
    assert (
        sum(p.numel() for p in model.parameters()) * 4
        <= layout["nbytes"]
        < sum(p.numel() for p in model.parameters()) * 4 + 64 * len(entries)
    )


def test_trainer_parameters_are_views_and_a_resume_copies_into_them(tiny_model_dir: Path) -> None:
    from slimish.trainer.torch_backend import TorchTrainer

    cfg = load_run_config(None, [f"model={tiny_model_dir}", "data.source=task:max_digit", "launch.colocate=true"])
    with shared_store(tiny_model_dir) as store:
        trainer = TorchTrainer(cfg, store)
        assert all(store.holds(p) for p in trainer.model.parameters())
        state = trainer.state_dict()
        state["model"] = {name: t + 1 for name, t in state["model"].items()}
        trainer.load_state_dict(state)  # a checkpoint resume
        assert all(store.holds(p) for p in trainer.model.parameters())
        other = WeightStore(store.path)  # what an engine maps
        name = "model.layers.0.mlp.up_proj.weight"
        assert torch.equal(other.view(name), state["model"][name])


def test_a_colocated_adapter_is_mapped_and_a_push_refreshes_its_slot(tiny_model_dir: Path, tmp_path: Path) -> None:
    """trainer.lora colocated: the trainer's adapter parameters are views of a second store, which
    the first push loads on the engine (mapped, not read from a file). The trainer's writes reach
    the engine with no byte sent, at the next push's `/update_weight_version` with `lora_name`
    (its slot is refreshed then, and not before); a broadcast into the mapped adapter is refused."""
    from slimish.trainer.torch_backend import TorchTrainer

    cfg = load_run_config(
        None, [f"model={tiny_model_dir}", "data.source=task:max_digit", "launch.colocate=true", *LORA]
    )
    name = cfg.trainer.lora.adapter
    with shared_store(tiny_model_dir) as store, ExitStack() as stack:
        trainer = TorchTrainer(cfg, store)
        adapter = trainer.adapter_store
        stack.callback(shutil.rmtree, adapter.path, True)
        lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
        assert lora and all(adapter.holds(p) for p in lora)
        flags = {
            "cpu_packed_linear": False,
            "enable_lora": True,
            "max_lora_rank": 4,
            "lora_target_modules": list(cfg.trainer.lora.target_modules),
        }
        proc = engine_process(tiny_model_dir, log_path=tmp_path / "engine.log", shared_weights=store.path, **flags)
        url = stack.enter_context(proc).url
        router = stack.enter_context(running_router(worker_urls=[url]))
        sync = ColocatedSync(store, WeightSync(WeightSyncConfig(timeout_s=60), [url], adapter=name, router_url=router))
        stack.callback(sync.close)
        sync.connect()
        assert sync.push(trainer.export(), 1)["bytes"] == 0  # loaded from the store's directory
        served = lambda: input_logprobs(url, IDS, lora_path=name)  # noqa: E731
        trained = lambda: model_logprobs(trainer.model, IDS).detach()  # noqa: E731
        before = served()
        assert before[1] == "1" and torch.allclose(before[0], trained(), atol=1e-4)
        with torch.no_grad():  # the optimiser's writes, into the engine's mapping
            for p in lora:
                p.add_(torch.randn_like(p) * 0.3)
        assert (trained() - before[0]).abs().max() > 1e-2
        assert torch.equal(served()[0], before[0])  # the slot still holds version 1
        assert sync.push(trainer.export(), 2)["bytes"] == 0
        after, version = served()
        assert version == "2" and torch.allclose(after, trained(), atol=1e-4)
        spec = {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "lora_name": name}
        refused = post(url, "/update_weights_from_distributed", spec)
        assert refused.status_code == 400 and "mapped from a colocated trainer" in refused.json()["message"]


def test_kv_cache_release_and_resume(engine: str) -> None:
    """Released: the KV is freed (`/server_info` memory_usage.kvcache 0) and a new request waits,
    queued, until the resume, then runs as it would have. Refused: a release while a request
    runs, a resume of what is not released, a tag SGLang does not have."""

    def state() -> dict:
        return httpx.get(engine + "/server_info", timeout=10).json()["internal_states"][0]

    expected = generate(engine, input_ids=IDS, sampling_params=GREEDY)["output_ids"]
    assert state()["memory_usage"]["kvcache"] > 0  # the batch's buffers and the cached pages

    async def main() -> None:
        async with httpx.AsyncClient(base_url=engine, timeout=120) as client:
            long = asyncio.create_task(
                client.post("/generate", json={"input_ids": IDS, "sampling_params": {**GREEDY, "max_new_tokens": 1500}})
            )
            await asyncio.to_thread(wait_for, lambda: state()["#running-req"] == 1, "the long request to run")
            busy = await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
            assert busy.status_code == 400 and "idle" in busy.json()["error"]["message"]
            await client.post("/abort_request", json={"abort_all": True})
            await long

            released = await client.post("/release_memory_occupation", json={"tags": None})
            assert released.status_code == 200 and released.json() is None
            assert state()["memory_usage"]["kvcache"] == 0
            waiting = asyncio.create_task(client.post("/generate", json={"input_ids": IDS, "sampling_params": GREEDY}))
            await asyncio.to_thread(wait_for, lambda: state()["#queue-req"] == 1, "the request to queue")
            assert not waiting.done() and state()["memory_usage"]["kvcache"] == 0
            resumed = await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
            assert resumed.status_code == 200
            assert (await waiting).json()["output_ids"] == expected

    asyncio.run(main())
    again = post(engine, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert again.status_code == 400 and "not released" in again.json()["error"]["message"]
    bad = post(engine, "/release_memory_occupation", {"tags": ["kv"]})
    assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]
    assert post(engine, "/release_memory_occupation", {"tags": ["weights"]}).status_code == 200  # nothing to free
    assert generate(engine, input_ids=IDS, sampling_params=GREEDY)["output_ids"] == expected


@pytest.mark.parametrize(
    "overrides, needs",
    [
        (["trainer.nproc=2"], "trainer.nproc=1"),
        (["trainer.lora.enabled=true", "policies=[{name: a}, {name: b}]"], "no policies"),
        (["trainer.backend=megatron"], "trainer.backend=torch"),
        (["launch.engine_flag=[dtype=bfloat16]"], "launch.engine_flag dtype=float32"),
        (["trainer.dtype=bfloat16"], "trainer.dtype=float32"),
        (["launch.engine_kind=external"], "launch.engine_kind=builtin or sglang"),
        (["launch.engine_kind=sglang", "async_training=true", "buffer.max_staleness=1"], "async_training=false with"),
        (["launch.engine_kind=sglang", "trainer.lora.enabled=true"], "trainer.lora.enabled=false with"),
        (["launch.engine_kind=sglang", "launch.engines=2"], "launch.engines=1 and --tp-size 1"),
        (["launch.engine_kind=sglang", "launch.sglang_args=[--tp-size,2]"], "launch.engines=1 and --tp-size 1"),
        (["launch.router_url=http://127.0.0.1:1"], "no launch.router_url"),
    ],
)
def test_refusals_name_the_field(overrides: list[str], needs: str) -> None:
    with pytest.raises(SystemExit) as err:
        load_run_config(None, ["model=m", "data.source=task:max_digit", "launch.colocate=true", *overrides])
    assert "launch.colocate needs" in str(err.value) and needs in str(err.value)


@pytest.mark.parametrize(
    "overrides", [["async_training=true", "buffer.max_staleness=1"], ["launch.engine_kind=sglang"]]
)
def test_async_and_sglang_colocated_runs_are_accepted(overrides: list[str]) -> None:
    """Accepted; SGLang's engine goes on the trainer's GPU, able to release its memory."""
    from slimish.launch.commands import run_launch
    from slimish.launch.plan import first_free_gpu

    cfg = load_run_config(None, ["model=m", "data.source=task:max_digit", "launch.colocate=true", *overrides])
    sglang = cfg.launch.engine_kind == "sglang"
    assert ("--enable-memory-saver" in run_launch(cfg).sglang_args) == sglang and first_free_gpu(cfg, True) == 0


def test_engine_refuses_another_dtype_and_a_packed_copy(tiny_model_dir: Path) -> None:
    from slimish.engine.engine import Engine

    with pytest.raises(ValueError, match="cpu_packed_linear"):
        EngineConfig(model=str(tiny_model_dir), shared_weights="/nowhere")
    with shared_store(tiny_model_dir) as store:
        cfg = EngineConfig(
            model=str(tiny_model_dir), shared_weights=str(store.path), dtype="bfloat16", cpu_packed_linear=False
        )
        with pytest.raises(ValueError, match=r"engine\.dtype \(--dtype\): .* bfloat16 .* float32"):
            Engine(cfg)
    with pytest.raises(ValueError, match="launch.colocate"):
        LaunchConfig(colocate=True, mode="ray")


ASYNC = ["async_training=true", "buffer.max_staleness=1"]


@pytest.mark.parametrize("extra", [LORA, ASYNC], ids=["lora", "async"])
def test_a_colocated_run_trains_and_removes_its_store(tiny_model_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    """Two steps, sync with LoRA (the KV released while the trainer trains, the base shared, the
    adapter pushed) or async full (generation held from each step's optimiser step to its push):
    the engine computes what the trainer does (mismatch ~0 on the tokens of the trainer's version),
    each step trains on tokens of pushes before it, and the store is gone when the run ends. (The
    sync full run: tests/test_true_on_policy.py; its push, above.)"""
    rows = run_quickstart(
        tmp_path,
        "steps=2",
        "sft.steps=0",
        "eval.every=0",
        "checkpoint.every=0",
        "rollout.rollout_batch_size=4",
        "algorithm.ptx_coef=0",
        "launch.colocate=true",
        *extra,
        model=tiny_model_dir,
        timeout=600,
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["train/mismatch_fresh"] < 1e-4 for r in rows[1:])  # async: stale tokens are another version's
    paused = [r["time/generation_paused"] for r in rows]
    assert paused[0] == 0 and (all(p > 0 for p in paused[1:]) if extra == ASYNC else paused == [0, 0, 0]), paused
    trained = [json.loads(line) for line in (tmp_path / "run" / "trained_prompts.jsonl").read_text().splitlines()]
    assert [r["step"] for r in trained] == [1, 2]
    assert all({v for vs in r["versions"] for v in vs} <= set(range(r["step"])) for r in trained), trained
    gone = [p for p in SHM.glob(f"{PREFIX}*") if not Path("/proc", p.name.removeprefix(PREFIX).split("-")[0]).exists()]
    assert not gone, "a store outlived its run"
