"""WeightUpdater against a real trainer process over real gloo groups.

The trainer (rank 0) runs in a spawned process and broadcasts tensors it derives from a seed;
this process regenerates the same tensors to check what arrived, so no tensor travels by any
channel but the broadcast itself.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
from safetensors.torch import save_file

from slimish.distributed import (
    broadcast_tensors,
    destroy_custom_process_group,
    flattened_layout,
    init_custom_process_group,
    master_store,
)
from slimish.engine.weights import WeightUpdater
from slimish.net import free_port
from slimish.protocol import InitWeightsUpdateGroupReq, UpdateWeightsFromDistributedReq

TIMEOUT = timedelta(seconds=30)
WAIT_S = 60.0
IDLE_S = 300.0  # a trainer child exits on its own if the test process vanished
CTX = mp.get_context("spawn")
GROUP = "weight_update_group"
BF16 = {"model.layers.0.mlp.down_proj.weight", "model.norm.weight"}  # sent as bf16 to fp32 params

Spec = tuple[str, str, list[int]]  # (name, wire dtype, shape)


def tiny_model(seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM  # lazy: the trainer child never needs it

    torch.manual_seed(seed)
    config = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).eval()


def all_specs(model: torch.nn.Module) -> list[Spec]:
    """Every distinct parameter; the tied embedding under its lm_head name; fp32 before bf16
    so a flattened bucket stays aligned."""
    specs = [
        (
            "lm_head.weight" if name == "model.embed_tokens.weight" else name,
            "bfloat16" if name in BF16 else "float32",
            list(p.shape),
        )
        for name, p in model.named_parameters()
    ]
    return sorted(specs, key=lambda s: s[1] == "bfloat16")


def make_tensors(seed: int, specs: list[Spec]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(getattr(torch, dtype)) for _, dtype, shape in specs]


def request(specs: list[Spec], flattened: bool = False, group_name: str = GROUP) -> UpdateWeightsFromDistributedReq:
    return UpdateWeightsFromDistributedReq(
        names=[s[0] for s in specs],
        dtypes=[s[1] for s in specs],
        shapes=[s[2] for s in specs],
        group_name=group_name,
        load_format="flattened_bucket" if flattened else None,
    )


def join_req(port: int, world_size: int, group_name: str, rank: int) -> InitWeightsUpdateGroupReq:
    return InitWeightsUpdateGroupReq(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=rank,
        world_size=world_size,
        group_name=group_name,
        backend="gloo",
    )


def params_equal(updater: WeightUpdater, specs: list[Spec], tensors: list[torch.Tensor]) -> bool:
    return all(torch.equal(updater.params[name], t.to(torch.float32)) for (name, _, _), t in zip(specs, tensors))


def snapshot(updater: WeightUpdater) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in updater.params.items()}


def unchanged(updater: WeightUpdater, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in updater.params.items())


# -- peer processes (spawned; module-level so they can be imported there) -----------------------


def trainer_main(world_size: int, group_name: str, commands, results) -> None:
    """Rank 0: put its store's port on `results`, join, then broadcast `make_tensors(seed, specs)`
    for each (seed, specs, flattened)."""
    torch.set_num_threads(1)
    store = master_store("127.0.0.1", world_size, TIMEOUT)
    results.put(store.port)
    pg = init_custom_process_group("gloo", store, world_size, 0, group_name, TIMEOUT)
    try:
        while (cmd := commands.get(timeout=IDLE_S)) is not None:
            seed, specs, flattened = cmd
            start = time.perf_counter()
            broadcast_tensors(make_tensors(seed, specs), pg, flattened)
            results.put(time.perf_counter() - start)
    finally:
        destroy_custom_process_group(pg)


def engine_main(port: int, rank: int, world_size: int, group_name: str, seed: int, results) -> None:
    """A second engine: join as `rank`, receive one push of every parameter, report if it matches."""
    torch.set_num_threads(1)
    updater = WeightUpdater(tiny_model(0), timeout=TIMEOUT)
    specs = all_specs(tiny_model(0))
    updater.init_group(join_req(port, world_size, group_name, rank))
    updater.update_from_distributed(request(specs, group_name=group_name))
    results.put(params_equal(updater, specs, make_tensors(seed, specs)))
    updater.destroy_group(group_name)


class Procs:
    """Spawned children, always joined or killed with bounded waits."""

    def __init__(self) -> None:
        self.procs: list = []

    def start(self, target, *args) -> None:
        proc = CTX.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)

    def close(self) -> list[int | None]:
        deadline = time.monotonic() + 20
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        return [p.exitcode for p in self.procs]


class Trainer:
    """Rank 0 in a child; `port`: its store's, picked by the OS there (never picked free, then bound)."""

    def __init__(self, procs: Procs, world_size: int, group_name: str) -> None:
        self.commands, self.results = CTX.Queue(), CTX.Queue()
        procs.start(trainer_main, world_size, group_name, self.commands, self.results)
        self.port: int = self.results.get(timeout=WAIT_S)

    def send(self, seed: int, specs: list[Spec], flattened: bool = False) -> None:
        self.commands.put((seed, specs, flattened))

    def sent(self) -> float:
        """Seconds the broadcast took on the trainer."""
        return self.results.get(timeout=WAIT_S)

    def stop(self) -> None:
        self.commands.put(None)


@dataclass
class Engine:
    updater: WeightUpdater
    trainer: Trainer
    specs: list[Spec]

    def push(self, seed: int, flattened: bool = False, specs: list[Spec] | None = None) -> list[torch.Tensor]:
        specs = specs or self.specs
        self.trainer.send(seed, specs, flattened)
        self.updater.update_from_distributed(request(specs, flattened))
        self.trainer.sent()
        return make_tensors(seed, specs)


@pytest.fixture(scope="module")
def engine():
    """This process as rank 1 of GROUP, with a trainer child as rank 0."""
    procs = Procs()
    model = tiny_model(0)
    updater = WeightUpdater(model, timeout=TIMEOUT)
    trainer = Trainer(procs, 2, GROUP)
    try:
        updater.init_group(join_req(trainer.port, 2, GROUP, rank=1))
        yield Engine(updater, trainer, all_specs(model))
        updater.destroy_group(GROUP)
    finally:
        trainer.stop()
        assert procs.close() == [0]


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("flattened", [False, True], ids=["default", "flattened_bucket"])
def test_push_lands_exactly_and_reuses_buffers(engine, flattened):
    names = [s[0] for s in engine.specs]
    assert "lm_head.weight" in names and "model.embed_tokens.weight" not in names

    first = engine.push(1, flattened)
    assert params_equal(engine.updater, engine.specs, first)
    assert torch.equal(engine.updater.params["model.embed_tokens.weight"], first[names.index("lm_head.weight")])
    norm = first[names.index("model.norm.weight")]
    assert norm.dtype == torch.bfloat16 and engine.updater.params["model.norm.weight"].dtype == torch.float32
    # Same-dtype tensors arrive straight in the parameters; only bf16 -> fp32 ones need buffers.
    assert flattened or set(engine.updater.recv_buffers) == BF16
    buffers = [engine.updater.bucket_buffer] if flattened else list(engine.updater.recv_buffers.values())
    ptrs = [b.data_ptr() for b in buffers]

    second = engine.push(2, flattened)
    assert params_equal(engine.updater, engine.specs, second)
    assert not torch.equal(first[0], second[0])
    buffers = [engine.updater.bucket_buffer] if flattened else list(engine.updater.recv_buffers.values())
    assert [b.data_ptr() for b in buffers] == ptrs and not engine.updater.torn


def test_get_weights_by_name(engine):
    pushed = engine.push(3)
    names = [s[0] for s in engine.specs]
    embed = pushed[names.index("lm_head.weight")]
    assert engine.updater.get_weights_by_name("model.embed_tokens.weight", 5) == embed[:5].tolist()
    norm = engine.updater.get_weights_by_name("model.norm.weight", 100)
    assert norm == pushed[names.index("model.norm.weight")].float().tolist() and len(norm) == 32
    with pytest.raises(ValueError, match="'nope' is not a parameter"):
        engine.updater.get_weights_by_name("nope", 5)


@pytest.mark.parametrize(
    "field, bad, message",
    [
        ("names", "model.nope.weight", r"names\[1\]: 'model.nope.weight' is not a parameter"),
        (
            "shapes",
            [32, 31],
            r"shapes\[1\]: \[32, 31\] for 'model.layers.0.self_attn.q_proj.weight' does not match the parameter's shape \[32, 32\]",
        ),
        (
            "dtypes",
            "floaty",
            r"dtypes\[1\] for 'model.layers.0.self_attn.q_proj.weight': 'floaty' is not a torch dtype",
        ),
        ("dtypes", "Tensor", r"dtypes\[1\] .*'Tensor' is not a torch dtype"),
        ("names", "model.norm.weight", r"names\[1\]: 'model.norm.weight' is listed twice"),
    ],
)
@pytest.mark.parametrize("flattened", [False, True], ids=["default", "flattened_bucket"])
def test_bad_request_raises_before_receiving(engine, field, bad, message, flattened):
    good = [("model.norm.weight", "float32", [32]), ("model.layers.0.self_attn.q_proj.weight", "float32", [32, 32])]
    req = request(good, flattened)
    getattr(req, field)[1] = bad
    before = snapshot(engine.updater)
    with pytest.raises(ValueError, match=message):
        engine.updater.update_from_distributed(req)
    assert unchanged(engine.updater, before)
    # Had the bad call posted a receive, it would swallow this push's first tensor.
    assert params_equal(engine.updater, good, engine.push(4, flattened, specs=good))


def test_unknown_and_duplicate_groups_fail_without_blocking(engine):
    with pytest.raises(ValueError, match="group_name 'other' is not an initialised"):
        engine.updater.update_from_distributed(request(engine.specs, group_name="other"))
    with pytest.raises(ValueError, match="^The group to be destroyed does not exist.$"):
        engine.updater.destroy_group("other")
    with pytest.raises(ValueError, match=f"group_name '{GROUP}' already exists"):
        engine.updater.init_group(join_req(free_port(), 2, GROUP, rank=1))
    with pytest.raises(ValueError, match="backend 'nccl' is not available"):
        engine.updater.init_group(join_req(free_port(), 2, "other", rank=1).model_copy(update={"backend": "nccl"}))


def test_two_engines_receive_the_same_broadcast(engine):
    """World of 3: trainer, this process (rank 1) and another engine process (rank 2), in a
    second group that coexists with the module's group."""
    procs, group = Procs(), "three"
    results = CTX.Queue()
    trainer = Trainer(procs, 3, group)
    procs.start(engine_main, trainer.port, 2, 3, group, 5, results)
    try:
        engine.updater.init_group(join_req(trainer.port, 3, group, rank=1))
        trainer.send(5, engine.specs)
        engine.updater.update_from_distributed(request(engine.specs, group_name=group))
        trainer.sent()
        assert params_equal(engine.updater, engine.specs, make_tensors(5, engine.specs))
        assert results.get(timeout=WAIT_S) is True
        engine.updater.destroy_group(group)
        with pytest.raises(ValueError, match="^The group to be destroyed does not exist.$"):
            engine.updater.destroy_group(group)
        assert params_equal(engine.updater, engine.specs, engine.push(6))  # the module group still works
    finally:
        trainer.stop()
        assert procs.close() == [0, 0]


def test_flattened_layout_alignment():
    assert flattened_layout(["a", "b", "c"], [torch.float32, torch.bfloat16, torch.uint8], [[2, 3], [3], [5]]) == [
        (0, 24),
        (24, 30),
        (30, 35),
    ]
    with pytest.raises(ValueError, match=r"'b' \(float32\) would start at byte 6, not a multiple of its itemsize 4"):
        flattened_layout(["a", "b"], [torch.bfloat16, torch.float32], [[3], [2]])
    # The sender checks before sending anything: no group is needed to get the error.
    with pytest.raises(ValueError, match=r"'tensors\[1\]' \(float32\) would start at byte 6"):
        broadcast_tensors([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2)], group=None, flattened=True)


# -- from disk ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF checkpoint of another seed, plus broken variants of its state dict."""
    root = tmp_path_factory.mktemp("ckpt")
    source = tiny_model(7)
    source.save_pretrained(root / "good")
    state = {k: v.contiguous() for k, v in source.state_dict().items() if k != "lm_head.weight"}
    variants = {
        "missing": {k: v for k, v in state.items() if k != "model.norm.weight"},
        "extra": {**state, "model.bogus.weight": torch.zeros(2)},
        "shape": {**state, "model.norm.weight": torch.zeros(31)},
    }
    for name, tensors in variants.items():
        (root / name).mkdir()
        save_file(tensors, root / name / "model.safetensors")
    # Sharded: the same weights over two files, without an index.
    (root / "sharded").mkdir()
    keys = sorted(state)
    save_file({k: state[k] for k in keys[::2]}, root / "sharded" / "a.safetensors")
    save_file({k: state[k] for k in keys[1::2]}, root / "sharded" / "b.safetensors")
    return root, source


@pytest.mark.parametrize("variant", ["good", "sharded"])
def test_update_from_disk_round_trip(checkpoints, variant):
    root, source = checkpoints
    updater = WeightUpdater(tiny_model(0))
    updater.update_from_disk(str(root / variant))
    expected = dict(source.named_parameters(remove_duplicate=False))
    assert all(torch.equal(p, expected[name]) for name, p in updater.params.items())


@pytest.mark.parametrize(
    "variant, message",
    [
        ("nowhere", "is not a directory"),
        ("missing", r"parameters missing from the checkpoint: \['model.norm.weight'\]"),
        ("extra", r"names not in this model: \['model.bogus.weight'\]"),
        ("shape", r"\[31\] for 'model.norm.weight' does not match the parameter's shape \[32\]"),
    ],
)
def test_update_from_disk_failure_keeps_old_weights(checkpoints, variant, message):
    root, _ = checkpoints
    updater = WeightUpdater(tiny_model(0))
    before = snapshot(updater)
    with pytest.raises(ValueError, match=message):
        updater.update_from_disk(str(root / variant))
    assert unchanged(updater, before)


# -- mixture of experts: checkpoint (per-expert) names onto fused parameters --------------------


def load_model(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def checkpoint_specs(path) -> list[Spec]:
    """The names and shapes SGLang would load from the checkpoint `path` (its safetensors keys);
    layer 1's experts travel as bf16, so both the in-place and the converting receive hit views."""
    from safetensors import safe_open

    specs = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                dtype = "bfloat16" if "layers.1.mlp.experts." in name else "float32"
                specs.append((name, dtype, list(f.get_slice(name).get_shape())))
    return sorted(specs, key=lambda s: s[1] == "bfloat16")


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe_dirs(request, tmp_path_factory):
    """A tiny MoE model's checkpoint and another seed's."""
    from slimish.tiny_model import make_tiny_model

    arch = request.param
    other = make_tiny_model(tmp_path_factory.mktemp("moe") / arch, arch=arch, size="tiny", seed=1)
    return request.getfixturevalue(f"tiny_{arch}_dir"), other


def test_moe_update_from_disk_equals_a_fresh_load(moe_dirs):
    base, other = moe_dirs
    model = load_model(base)
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    WeightUpdater(model).update_from_disk(str(other))
    fresh = dict(load_model(other).named_parameters())
    assert all(torch.equal(p, fresh[name]) for name, p in model.named_parameters())
    assert not torch.equal(before, model.model.layers[0].mlp.experts.gate_up_proj)


def test_moe_push_of_checkpoint_names_lands_in_the_fused_parameters(engine, moe_dirs):
    """The trainer broadcasts every checkpoint tensor by its checkpoint name; the model's fused
    `gate_up_proj [E, 2I, H]` is `cat(gate_e, up_e)` stacked over experts, `down_proj` the stack."""
    base, _ = moe_dirs
    model = load_model(base)
    updater = WeightUpdater(model, timeout=TIMEOUT)
    updater.groups[GROUP] = engine.updater.groups[GROUP]  # the module's trainer, received here
    updater.await_full_push()
    specs = checkpoint_specs(base)
    assert any(".experts.7.up_proj.weight" in s[0] for s in specs)
    for flattened, seed in [(False, 11), (True, 12)]:
        sent = dict(zip([s[0] for s in specs], Engine(updater, engine.trainer, specs).push(seed, flattened)))
        assert not updater.torn
        for name, p in model.named_parameters():
            prefix, kind = name.rsplit(".", 1)
            if kind == "gate_up_proj":
                expected = torch.stack(
                    [
                        torch.cat([sent[f"{prefix}.{e}.gate_proj.weight"], sent[f"{prefix}.{e}.up_proj.weight"]])
                        for e in range(len(p))
                    ]
                )
            elif name.endswith("experts.down_proj"):
                expected = torch.stack([sent[f"{prefix}.{e}.down_proj.weight"] for e in range(len(p))])
            else:
                expected = sent.get(name, sent["model.embed_tokens.weight"])  # a tied head is not in the checkpoint
            assert torch.equal(p, expected.to(torch.float32)), name
    # Each expert's view is a tensor of its own: one left out of a push is the one still missing.
    updater.await_full_push()
    Engine(updater, engine.trainer, specs[:-1]).push(13)
    assert list(updater.torn) == [specs[-1][0]] and ".experts." in specs[-1][0]


def test_moe_weights_by_name_and_fused_names_refused(moe_dirs):
    base, _ = moe_dirs
    model = load_model(base)
    updater = WeightUpdater(model)
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    width = fused.shape[1] // 2
    up = updater.get_weights_by_name("model.layers.0.mlp.experts.3.up_proj.weight", 5)
    assert up == fused[3, width:][:5].tolist()
    assert updater.get_weights_by_name("model.layers.1.mlp.experts.6.down_proj.weight", 100) == (
        model.model.layers[1].mlp.experts.down_proj[6].tolist()
    )
    per_expert = r"one tensor per expert: 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'"
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj' is not a parameter.*" + per_expert
    ):
        updater.get_weights_by_name("model.layers.0.mlp.experts.gate_up_proj", 5)
    req = request(
        [
            ("model.norm.weight", "float32", [64]),
            ("model.layers.0.mlp.experts.gate_up_proj", "float32", list(fused.shape)),
        ]
    )
    req.group_name = "any"
    updater.groups["any"] = object()  # refused before any receive: the group is never touched
    with pytest.raises(
        ValueError,
        match=r"names\[1\]: 'model\.layers\.0\.mlp\.experts\.gate_up_proj' is not a parameter.*" + per_expert,
    ):
        updater.update_from_distributed(req)
