"""Weight sync against the real engine server, with a trainer (rank 0) in its own process.

The trainer child does what slime does against SGLang: it fires the HTTP call and, while that
call blocks, joins the group or broadcasts. It broadcasts tensors derived from a seed, so this
process can rebuild them and check what the engine serves and generates.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import pytest
import torch

from slimish.distributed import broadcast_tensors, destroy_custom_process_group, init_custom_process_group
from slimish.launch.local import free_port

CTX = mp.get_context("spawn")
WAIT_S = 120.0
BF16 = {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}  # sent as bf16 to fp32 params
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}

Spec = tuple[str, str, list[int]]  # (name, wire dtype, shape)


def make_tensors(seed: int, specs: list[Spec]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(getattr(torch, dtype)) for _, dtype, shape in specs]


@functools.cache
def http() -> httpx.Client:
    """One client per process: each bare `httpx.post` builds an SSL context (~50 ms here)."""
    return httpx.Client(timeout=WAIT_S)


def post(url: str, path: str, body: dict | None = None) -> httpx.Response:
    return http().post(url + path, json=body or {})


# -- the trainer child ----------------------------------------------------------------------------


def trainer_main(url: str, port: int, group: str, commands, results) -> None:
    """Rank 0. Commands: ("push", seed, specs, flattened, version), ("destroy",); None ends."""
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(1)

    def reply(r: httpx.Response) -> tuple[int, dict]:
        return r.status_code, r.json()

    init = pool.submit(post, url, "/init_weights_update_group", dict(
        master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=group, backend="gloo"))
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, group, timedelta(seconds=60))
    results.put([reply(init.result(timeout=WAIT_S))])
    try:
        while (cmd := commands.get(timeout=300)) is not None:
            if cmd[0] == "destroy":
                results.put([reply(post(url, "/destroy_weights_update_group", {"group_name": group}))])
                continue
            _, seed, specs, flattened, version = cmd
            begin = post(url, "/begin_weight_update", {"selector": "all"})
            update = pool.submit(post, url, "/update_weights_from_distributed", dict(
                names=[s[0] for s in specs], dtypes=[s[1] for s in specs], shapes=[s[2] for s in specs],
                group_name=group, load_format="flattened_bucket" if flattened else None, weight_version=version))
            broadcast_tensors(make_tensors(seed, specs), pg, flattened)
            update = update.result(timeout=WAIT_S)
            results.put([reply(begin), reply(update), reply(post(url, "/end_weight_update"))])
    finally:
        destroy_custom_process_group(pg)
        pool.shutdown()


class Trainer:
    def __init__(self, url: str, group: str) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        self.proc = CTX.Process(target=trainer_main, args=(url, free_port(), group, self.commands, self.results), daemon=True)
        self.proc.start()

    def joined(self) -> list[tuple[int, dict]]:
        """The engine's reply to /init_weights_update_group, once both sides joined."""
        return self.results.get(timeout=WAIT_S)

    def call(self, *cmd) -> list[tuple[int, dict]]:
        self.commands.put(cmd)
        return self.results.get(timeout=WAIT_S)

    def close(self) -> int | None:
        self.commands.put(None)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)
        return self.proc.exitcode


# -- fixtures and helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer(engine):
    trainer = Trainer(engine, "weight_update_group")
    try:
        assert trainer.joined() == [(200, {"success": True, "message": "Succeeded to initialize custom process group."})]
        yield trainer
    finally:
        assert trainer.close() == 0


def hf_model(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM  # lazy: the trainer child imports this module

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: torch.nn.Module) -> list[int]:
    n = GREEDY["max_new_tokens"]
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def generate(url: str) -> dict:
    r = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    return r.json()


def served_weights(url: str, name: str, rows: int) -> torch.Tensor:
    r = post(url, "/get_weights_by_name", {"name": name, "truncate_size": rows})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json(), dtype=torch.float32)


def model_info(url: str) -> dict:
    return http().get(url + "/model_info").json()


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flattened, seed", [(False, 1), (True, 2)], ids=["default", "flattened_bucket"])
def test_push_all_parameters(engine, trainer, tiny_model_dir, flattened, seed):
    reference = hf_model(tiny_model_dir)
    params = dict(reference.named_parameters())  # each tensor once, as a trainer sends them
    specs = sorted(
        ((name, "bfloat16" if name in BF16 else "float32", list(p.shape)) for name, p in params.items()),
        key=lambda s: s[1] == "bfloat16",  # fp32 first keeps a flattened bucket aligned
    )
    version = f"v{seed}"
    before = generate(engine)["output_ids"]

    replies = trainer.call("push", seed, specs, flattened, version)
    assert [status for status, _ in replies] == [200, 200, 200], replies
    assert replies[1][1] == {"success": True, "message": f"Succeeded to update parameter online. Weight version updated to {version}."}

    with torch.no_grad():  # the reference now holds what was pushed
        for (name, _, _), tensor in zip(specs, make_tensors(seed, specs)):
            params[name].copy_(tensor)
    for name, param in reference.named_parameters(remove_duplicate=False):  # a tied lm_head too
        assert torch.equal(served_weights(engine, name, param.shape[0]), param), name

    out = generate(engine)
    assert out["output_ids"] == hf_greedy(reference) != before
    assert out["meta_info"]["weight_version"] == version
    assert model_info(engine)["weight_version"] == version


def test_destroy_groups(engine, trainer):
    second = Trainer(engine, "second")  # coexists with the module's group
    try:
        joined = second.joined()
        assert joined[0][0] == 200, joined
        assert second.call("destroy") == [(200, {"success": True, "message": "Succeeded to destroy custom process group."})]
        assert second.call("destroy") == [(400, {"success": False, "message": "The group to be destroyed does not exist."})]
    finally:
        assert second.close() == 0


def test_update_from_disk(engine, tiny_model_dir_other_seed, tmp_path):
    r = post(engine, "/update_weights_from_disk", {"model_path": str(tiny_model_dir_other_seed), "weight_version": "disk"})
    assert r.status_code == 200 and r.json()["success"], r.text
    out = generate(engine)
    assert out["output_ids"] == hf_greedy(hf_model(tiny_model_dir_other_seed))
    assert out["meta_info"]["weight_version"] == "disk"
    assert model_info(engine)["model_path"] == str(tiny_model_dir_other_seed)

    r = post(engine, "/update_weights_from_disk", {"model_path": str(tmp_path / "nowhere")})
    assert r.status_code == 400 and "is not a directory" in r.json()["message"], r.text
    assert generate(engine)["output_ids"] == out["output_ids"]
