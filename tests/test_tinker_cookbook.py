"""Acceptance of `slimish tinker` through the real Tinker SDK (0.38.0) and tinker-cookbook (0.6.1),
unchanged: the cookbook's recipes run against one server on a tiny model that has Qwen3's real
tokenizer, served as `Qwen/Qwen3-8B`, with no network (tests/tinker_offline.py says how)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import model_families
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types
from tinker_offline import MODEL_NAME, offline, read_jsonl, tinker_server

from slimish.trainer.lora import ADAPTER_WEIGHTS


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_families.build_family("qwen3", tmp_path_factory.mktemp("models") / "qwen3")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server's run directory (checkpoints under checkpoints/RUN/KIND/NAME)."""
    return tmp_path_factory.mktemp("tinker-root")


@pytest.fixture(scope="module")
def url(qwen3_dir: Path, root: Path) -> Iterator[str]:
    """One `slimish tinker` for the module, with the SDK and the cookbook offline around it."""
    with offline(qwen3_dir), tinker_server(qwen3_dir, root, root / "server.log") as s:
        yield s.url


def sl_datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction on every position of `tokens`."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def batches(seed: int, n: int, size: int = 2, length: int = 12) -> list[list[types.Datum]]:
    """`n` batches of random token sequences (ordinary Qwen ids)."""
    rng = np.random.default_rng(seed)
    return [[sl_datum(rng.integers(0, 150_000, length).tolist()) for _ in range(size)] for _ in range(n)]


PROBE = batches(99, 1, size=3, length=16)[0]
ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)


def logprobs(tc, data: list[types.Datum]) -> np.ndarray:
    """The trained model's logprobs of `data`'s targets (forward only: no gradient is kept)."""
    out = tc.forward(data, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def adapter(root: Path, tc, name: str) -> dict[str, torch.Tensor]:
    """The training client's adapter weights now, as the server writes them for `name`."""
    run, kind, name = tc.save_weights_for_sampler(name).result().path.removeprefix("tinker://").split("/")
    return load_file(root / "checkpoints" / run / kind / name / ADAPTER_WEIGHTS)


def train(tc, data: list[list[types.Datum]]) -> None:
    """One supervised step per batch, all submitted before any result is awaited (the SDK pipelines)."""
    futures = [(tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM)) for batch in data]
    for fb, opt in futures:
        fb.result()
        opt.result()


@pytest.mark.slow
def test_sl_loop_recipe_learns_and_its_checkpoints_load(url: str, tmp_path: Path) -> None:
    """tinker_cookbook.recipes.sl_loop as shipped: train_mean_nll falls, and its `tinker://`
    checkpoints (state at step 5, state + sampler weights at the end) load again into a training
    client and a sampling client that agree with each other and differ from the base model.
    The recipe never closes its ServiceClient, and the SDK's background loop keeps it alive, so its
    session heartbeat outlived this module's server (a "Session heartbeat failed" warning minutes
    later): the clients it made are closed here."""
    from tinker_cookbook.recipes import sl_loop

    made: list[tinker.ServiceClient] = []

    class Closed(tinker.ServiceClient):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        def create_lora_training_client(self, *args, **kwargs):
            # The recipe passes no seed, and the server then draws a fresh LoRA A each run: at lr
            # 1e-2 one such draw's nll fell to 7.8 by step 6, then rose to 10.6 (a CI rehearsal).
            kwargs.setdefault("seed", 0)
            return super().create_lora_training_client(*args, **kwargs)

    config = sl_loop.Config(
        base_url=url,
        log_path=str(tmp_path),
        model_name=MODEL_NAME,
        batch_size=8,
        max_steps=10,
        lora_rank=8,
        learning_rate=1e-2,  # at 1e-3 the random tiny model's nll falls only 4% in 10 steps
        save_every=5,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tinker, "ServiceClient", Closed)
        try:
            sl_loop.main(config)
        finally:
            for client in made:
                client.close("success").result()
    assert len(made) == 1

    nll = [row["train_mean_nll"] for row in read_jsonl(tmp_path / "metrics.jsonl") if "train_mean_nll" in row]
    assert len(nll) == 10 and nll[-1] < 0.8 * nll[0], nll
    checkpoints = {row["name"]: row for row in read_jsonl(tmp_path / "checkpoints.jsonl")}
    assert set(checkpoints) == {"000005", "final"}, checkpoints
    final = checkpoints["final"]
    for path in (checkpoints["000005"]["state_path"], final["state_path"], final["sampler_path"]):
        assert path.startswith("tinker://"), path

    tokens = PROBE[0].model_input.to_ints() + [PROBE[0].loss_fn_inputs["target_tokens"].tolist()[-1]]
    with tinker.ServiceClient(base_url=url) as sc:
        trained = logprobs(sc.create_training_client_from_state(final["state_path"]).result(), [PROBE[0]])
        midway = logprobs(
            sc.create_training_client_from_state(checkpoints["000005"]["state_path"]).result(), [PROBE[0]]
        )
        prompt = types.ModelInput.from_ints(tokens)
        sampled = sc.create_sampling_client(model_path=final["sampler_path"]).result().compute_logprobs(prompt).result()
        base = sc.create_sampling_client(base_model=MODEL_NAME).result().compute_logprobs(prompt).result()
    np.testing.assert_allclose(np.array(sampled[1:], dtype=np.float32), trained, rtol=0, atol=1e-4)
    assert np.abs(np.array(base[1:]) - trained).max() > 1e-3  # the checkpoint is not the base model
    assert np.abs(midway - trained).max() > 1e-3  # nor is step 5's state the final one


@pytest.mark.slow
def test_math_rl_recipe_sampler_and_trainer_agree(url: str, tmp_path: Path) -> None:
    """tinker_cookbook.recipes.math_rl.train (env=arithmetic, importance_sampling) as shipped runs
    3 steps from a trained state; the trainer's logprobs of what the sampler drew equal the
    sampler's (`optim/kl_sample_train_v1`, the mean difference, below 1e-4)."""
    from tinker_cookbook.recipes.math_rl import train as math_rl

    # A random model earns no reward here, so the recipe's own steps leave the adapter at its start:
    # start it away from the base (a few supervised steps), so that a sampler not serving the
    # adapter would show in the KL.
    with tinker.ServiceClient(base_url=url) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=8, seed=0).result()
        train(tc, batches(4, 3))
        start = tc.save_state("start").result().path
    config = math_rl.CLIConfig(
        model_name=MODEL_NAME,
        env="arithmetic",
        loss_fn="importance_sampling",
        group_size=4,
        groups_per_batch=2,
        max_tokens=8,
        max_steps=3,
        eval_every=0,
        save_every=0,
        lora_rank=8,
        load_checkpoint_path=start,
        base_url=url,
        log_path=str(tmp_path),
        behavior_if_log_dir_exists="delete",
    )
    asyncio.run(math_rl.cli_main(config))

    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if "optim/kl_sample_train_v1" in row]
    assert [row["step"] for row in rows] == [0, 1, 2], rows
    kl = [row["optim/kl_sample_train_v1"] for row in rows]
    assert max(abs(k) for k in kl) < 1e-4, kl


def rl_loop(url: str, steps: int = 8, group: int = 8) -> list[float]:
    """A direct-SDK RL loop (importance sampling, group-centred advantages) on a dense reward: the
    fraction of sampled tokens whose id is in the vocabulary's lower half. Sampling is top-8, so
    the same candidates recur and the adapter can move them. Returns each step's mean reward."""
    with tinker.ServiceClient(base_url=url) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=8, seed=0).result()
        half = 151_936 // 2  # Qwen3's vocab_size
        prompt = tc.get_tokenizer().encode("Write some tokens:")
        means = []
        for step in range(steps):
            params = types.SamplingParams(max_tokens=4, temperature=1.0, top_k=8, seed=step)
            sampler = tc.save_weights_and_get_sampling_client().result()
            seqs = sampler.sample(types.ModelInput.from_ints(prompt), group, params).result().sequences
            rewards = np.array([np.mean([t < half for t in s.tokens]) for s in seqs])
            means.append(float(rewards.mean()))
            data = []
            for seq, advantage in zip(seqs, rewards - rewards.mean()):
                n, pad = len(seq.tokens), [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": prompt[1:] + seq.tokens,
                            "logprobs": pad + list(seq.logprobs),
                            "advantages": pad + [float(advantage)] * n,
                        },
                    )
                )
            tc.forward_backward(data, "importance_sampling").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return means


@pytest.mark.slow
@pytest.mark.learning
def test_direct_sdk_rl_loop_learns_a_dense_reward(url: str) -> None:
    means = rl_loop(url)
    assert np.mean(means[-3:]) > np.mean(means[:2]) + 0.2, means


def test_two_clients_at_once_train_as_each_alone(url: str, root: Path) -> None:
    """Two SDK clients (two sessions) training two adapters with their requests interleaved on one
    server end with the weights each gets alone, within 1e-6: per-model optimizer and gradients."""
    data = {"a": batches(1, 3), "b": batches(2, 3)}
    alone = {}
    for name, seed in (("a", 1), ("b", 2)):
        with tinker.ServiceClient(base_url=url) as sc:
            tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=seed).result()
            train(tc, data[name])
            alone[name] = adapter(root, tc, "alone")

    with tinker.ServiceClient(base_url=url) as sa, tinker.ServiceClient(base_url=url) as sb:
        clients = {
            "a": sa.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=1).result(),
            "b": sb.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=2).result(),
        }
        futures = []
        for step in range(3):  # a's and b's steps queued on the server together, interleaved
            for name, tc in clients.items():
                futures += [tc.forward_backward(data[name][step], "cross_entropy"), tc.optim_step(ADAM)]
        for f in futures:
            f.result()
        together = {name: adapter(root, tc, "together") for name, tc in clients.items()}
    for name in clients:
        assert together[name].keys() == alone[name].keys() and len(alone[name]) > 0
        for key, value in alone[name].items():
            torch.testing.assert_close(together[name][key], value, rtol=0, atol=1e-6, msg=f"{name}: {key}")
    # each adapter trained (B starts at 0), and the two differ, so a mix-up would show
    for name in clients:
        assert min(v.abs().max().item() for k, v in alone[name].items() if "lora_B" in k) > 1e-4
    assert max((alone["a"][k] - alone["b"][k]).abs().max().item() for k in alone["a"]) > 1e-3


def test_resume_with_optimizer_continues_as_uninterrupted(url: str, root: Path) -> None:
    """`create_training_client_from_state_with_optimizer` on a mid-run state takes the same next
    step as the run that never stopped (equal adapters within 1e-6); without the optimizer state
    (fresh Adam moments) it does not."""
    data = batches(3, 3)
    with tinker.ServiceClient(base_url=url) as sc:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=4, seed=3).result()
        train(tc, data[:2])
        state = tc.save_state("mid").result().path
        assert state.startswith("tinker://") and state.endswith("/weights/mid"), state
        train(tc, data[2:])
        uninterrupted = adapter(root, tc, "end")

        resumed = sc.create_training_client_from_state_with_optimizer(state).result()
        train(resumed, data[2:])
        weights_only = sc.create_training_client_from_state(state).result()
        train(weights_only, data[2:])
        resumed, weights_only = adapter(root, resumed, "end"), adapter(root, weights_only, "end")
    assert resumed.keys() == uninterrupted.keys() and len(resumed) > 0
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-6, msg=key)
    assert max((weights_only[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted) > 1e-4
