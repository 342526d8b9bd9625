"""User hooks on the trainer and data side: `algorithm.advantage`, `algorithm.loss` and
`data.source` as `module:function`, and `Sample.exclude_from_loss`.

The hooks live in a plugin file written by the `plugin` fixture and are named by path
(`path/to/file.py:function`), as a user would; trainers are real (tiny llama on CPU).
"""

from __future__ import annotations

import copy
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_trainer_torch import FEATURES, config, make_groups, with_rollout_logprobs

from slimish.plugins import LoadError, load_function
from slimish.rollout.config import DataConfig
from slimish.rollout.data import PromptData, is_function_source, load_rows
from slimish.trainer.advantages import compute_advantages, trajectory_advantages
from slimish.trainer.config import AlgorithmConfig
from slimish.trainer.losses import loss_normalizer, rl_loss
from slimish.trainer.torch_backend import TorchTrainer

PLUGIN = '''
import torch


def grpo(rewards, group):
    """GRPO written as a user would: per group, (r - mean) / (std + eps); 0 for equal rewards."""
    out = torch.zeros_like(rewards)
    for g in group.unique():
        idx = group == g
        r = rewards[idx]
        if not (r == r[0]).all():
            out[idx] = (r - r.mean()) / (r.std() + 1e-6)
    return out


def rewards_only(rewards, group):
    return rewards * 2


def per_group(rewards, group):
    return rewards[:1]


def integers(rewards, group):
    return group


def a_list(rewards, group):
    return rewards.tolist()


def nan(rewards, group):
    return rewards / 0 * 0


def ppo_loss(logprobs, old_logprobs, advantages, mask):
    """The built-in PPO clipped token loss, eps 0.2."""
    ratio = (logprobs - old_logprobs).exp()
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))


def reduced(logprobs, old_logprobs, advantages, mask):
    return (-advantages * logprobs * mask).sum()


def detached(logprobs, old_logprobs, advantages, mask):
    return (-advantages * logprobs).detach()


def three_args(logprobs, advantages, mask):
    return logprobs


ROWS = [{"question": f"q{i}", "answer": str(i), "level": i % 3} for i in range(11)]


def rows(cfg, split):
    n = 11 if split == "train" else 4
    return [{cfg.prompt_key: f"{split} {r['question']}", "answer": r["answer"], "level": r["level"]} for r in ROWS[:n]]


def generated(cfg, split):
    for r in ROWS[:5]:
        yield {"question": r["question"], "answer": r["answer"]}


def one_dict(cfg, split):
    return {"question": "q", "answer": "a"}


def no_prompt(cfg, split):
    return [{"text": "q", "answer": "a"}]


def not_json(cfg, split):
    return [{"question": "q", "answer": object()}]


def empty(cfg, split):
    return []


def no_split(cfg):
    return []
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("hooks") / "hooks_plugin.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return str(path)


# -- custom advantage --------------------------------------------------------------------------


def _trajectory_case(sizes: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards per sample with trajectories of one or two samples, groups of `sizes` trajectories."""
    g = torch.Generator().manual_seed(seed)
    trajectory, group, rewards = [], [], []
    for gi, size in enumerate(sizes):
        for _ in range(size):
            t = len(group)
            group.append(gi)
            r = float(torch.randint(0, 3, (1,), generator=g)) / 2
            for _ in range(1 + t % 2):  # odd trajectories have two samples (segments), same reward
                trajectory.append(t)
                rewards.append(r)
    weights = torch.rand(len(trajectory), generator=g)
    return torch.tensor(rewards), torch.tensor(trajectory), torch.tensor(group), weights


@pytest.mark.parametrize("sizes", [[4, 4, 4], [4, 2, 3, 1]], ids=["equal", "ragged"])
def test_custom_grpo_advantage_is_bit_identical_to_the_built_in(plugin: str, sizes: list[int]) -> None:
    fn = load_function(f"{plugin}:grpo", "advantage")
    for seed in range(5):
        rewards, trajectory, group, weights = _trajectory_case(sizes, seed)
        built_in = trajectory_advantages("grpo", rewards, trajectory, group, weights)
        custom = trajectory_advantages(fn, rewards, trajectory, group, weights)
        assert torch.equal(custom, built_in), (custom - built_in).abs().max()
        assert built_in.abs().sum() > 0


def test_custom_advantage_gets_one_reward_per_trajectory(plugin: str) -> None:
    rewards, trajectory, group, weights = _trajectory_case([3, 2], 0)
    out = trajectory_advantages(
        load_function(f"{plugin}:rewards_only", "advantage"), rewards, trajectory, group, weights
    )
    assert torch.equal(out, rewards * 2 * weights)  # each sample: its trajectory's value, times its credit


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("per_group", r"returned shape \(1,\); it must return one advantage per trajectory, shape \(5,\)"),
        ("integers", "returned dtype torch.int64; it must return a floating-point tensor"),
        ("a_list", "returned a list; it must return a tensor"),
        ("nan", "returned non-finite advantages"),
    ],
)
def test_custom_advantage_bad_output_names_the_key(plugin: str, name: str, message: str) -> None:
    rewards, trajectory, group, weights = _trajectory_case([3, 2], 1)
    with pytest.raises(ValueError, match=f"algorithm.advantage .*{message}"):
        trajectory_advantages(load_function(f"{plugin}:{name}", "advantage"), rewards, trajectory, group, weights)


# -- custom policy loss ------------------------------------------------------------------------


def _loss_case(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 2, 7, 4]
    T = max(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    mask[2, 1:3] = 0  # environment tokens inside a response
    logprobs = torch.randn(4, T, generator=g) * 0.3 - 1
    old, ref, rollout = (logprobs + torch.randn(4, T, generator=g) * 0.3 for _ in range(3))
    old[0, 6] = -1e4  # padding garbage must not leak into the loss or its gradient
    entropy = torch.rand(4, T, generator=g)
    return logprobs, old, ref, rollout, entropy, mask, torch.tensor([1.0, -0.5, 2.0, -1.5])


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "loss_reduction": "sample",
            "kl_coef": 0.1,
            "kl_importance_weight": True,
            "entropy_coef": 0.01,
            "tis_cap": 1.5,
        },
        {"loss_reduction": "dr_grpo", "kl_coef": 0.2, "kl_estimator": "k2", "mis_cap": 1.2},
    ],
)
def test_custom_ppo_loss_equals_the_built_in(plugin: str, extra: dict) -> None:
    fn = load_function(f"{plugin}:ppo_loss", "policy_loss")
    logprobs, old, ref, rollout, entropy, mask, adv = _loss_case()
    norm = loss_normalizer(extra.get("loss_reduction", "token"), int(mask.sum()), 4, max_response_len=10)
    results = []
    for cfg in (AlgorithmConfig(**extra), AlgorithmConfig(loss=f"{plugin}:ppo_loss", **extra)):
        lp = logprobs.clone().requires_grad_(True)
        loss, stats = rl_loss(
            cfg,
            lp,
            old,
            adv,
            mask,
            norm,
            ref_logprobs=ref,
            rollout_logprobs=rollout,
            entropy=entropy,
            policy_loss_fn=fn if ":" in cfg.loss else None,
        )
        loss.backward()
        results.append((loss.detach(), stats, lp.grad))
    (ppo, ppo_stats, ppo_grad), (custom, custom_stats, custom_grad) = results
    assert torch.isfinite(custom) and ppo_grad.abs().sum() > 0
    torch.testing.assert_close(custom, ppo, rtol=0, atol=1e-6)
    torch.testing.assert_close(custom_grad, ppo_grad, rtol=0, atol=1e-6)
    for key in ("loss/policy", "loss/kl", "loss/entropy", "tokens", "ratio", "tis", "kl", "entropy"):
        if key in ppo_stats:
            torch.testing.assert_close(custom_stats[key], ppo_stats[key], rtol=0, atol=1e-5)
    assert custom_stats["clip_low"] == custom_stats["clip_high"] == 0  # not known for a custom loss


def test_custom_loss_bad_output_names_the_key(plugin: str) -> None:
    logprobs, old, _, _, _, mask, adv = _loss_case()
    lp = logprobs.clone().requires_grad_(True)
    for name, message in (
        ("reduced", r"returned shape \(\); it must return the per-token loss of shape \(4, 7\)"),
        ("detached", "does not depend on `logprobs`"),
    ):
        cfg = AlgorithmConfig(loss=f"{plugin}:{name}")
        with pytest.raises(ValueError, match=f"algorithm.loss .*{name}.*{message}"):
            rl_loss(cfg, lp, old, adv, mask, policy_loss_fn=load_function(cfg.loss, "policy_loss"))
    with pytest.raises(ValueError, match="algorithm.loss .*pass the loaded function as policy_loss_fn"):
        rl_loss(AlgorithmConfig(loss=f"{plugin}:ppo_loss"), lp, old, adv, mask)
    with pytest.raises(ValueError, match=r"algorithm.loss must be one of ppo, gspo, module:function, got 'clip'"):
        AlgorithmConfig(loss="clip")


# -- in the trainer ----------------------------------------------------------------------------


class Recording(TorchTrainer):
    """A TorchTrainer that keeps the gradients of each optimiser step."""

    def _optimizer_step(self, optimizer):
        self.grads = getattr(self, "grads", []) + [
            {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        ]
        return super()._optimizer_step(optimizer)


def _step(model_dir, groups, *overrides: str) -> tuple[Recording, dict[str, float]]:
    trainer = Recording(config(model_dir, *overrides))
    groups = with_rollout_logprobs(trainer, copy.deepcopy(groups), noise=0.3, seed=0)
    return trainer, trainer.train_step(groups, 1)


def _same_grads(a: Recording, b: Recording, atol: float) -> None:
    assert len(a.grads) == len(b.grads) and a.grads
    for ga, gb in zip(a.grads, b.grads):
        assert ga.keys() == gb.keys()
        worst = max((ga[n] - gb[n]).abs().max().item() for n in ga)
        assert worst <= atol, worst


def test_trainer_with_custom_hooks_equals_the_built_ins(plugin: str, tiny_model_dir) -> None:
    features = [f for f in FEATURES if "dual_clip" not in f and "eps_clip_high" not in f]  # what ppo_loss implements
    groups = make_groups(0)
    built_in, m1 = _step(tiny_model_dir, groups, *features)
    custom, m2 = _step(
        tiny_model_dir, groups, *features, f"algorithm.advantage={plugin}:grpo", f"algorithm.loss={plugin}:ppo_loss"
    )
    assert custom.advantage_fn is not None and custom.policy_loss_fn is not None
    _same_grads(built_in, custom, atol=1e-6)
    for key in (
        "train/loss",
        "train/policy_loss",
        "train/grad_norm",
        "train/kl",
        "train/entropy",
        "train/ratio",
        "train/tis",
    ):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    assert m1["train/clip_frac"] > 0 and m2["train/clip_frac"] == 0  # a custom loss reports no clipping


@pytest.mark.parametrize(
    ("key", "spec", "message"),
    [
        ("algorithm.advantage", ":grpoo", "algorithm.advantage '.*:grpoo': .* has no function 'grpoo'"),
        ("algorithm.loss", ":ppo_los", "algorithm.loss '.*:ppo_los': .* has no function 'ppo_los'"),
        (
            "algorithm.loss",
            ":three_args",
            r"algorithm.loss '.*:three_args': three_args\(logprobs, advantages, mask\) cannot be called with "
            r"\(logprobs, old_logprobs, advantages, mask\)",
        ),
        (
            "algorithm.advantage",
            "no_such_module:fn",
            "algorithm.advantage 'no_such_module:fn': no module named 'no_such_module'",
        ),
    ],
)
def test_a_bad_hook_fails_at_trainer_construction(
    plugin: str, tiny_model_dir, key: str, spec: str, message: str
) -> None:
    spec = spec if not spec.startswith(":") else plugin + spec
    with pytest.raises(LoadError, match=message):
        TorchTrainer(config(tiny_model_dir, f"{key}={spec}"))


def test_excluded_sample_trains_like_a_zeroed_mask_and_stays_in_the_baseline(tiny_model_dir) -> None:
    groups = make_groups(1)
    excluded, zeroed = copy.deepcopy(groups), copy.deepcopy(groups)
    excluded[1][0].exclude_from_loss = True  # reward 1.0 in a group with spread
    zeroed[1][0].loss_mask = [0] * zeroed[1][0].response_length
    for reduction in ("token", "trajectory"):
        a, ma = _step(tiny_model_dir, excluded, *FEATURES, f"algorithm.loss_reduction={reduction}")
        b, mb = _step(tiny_model_dir, zeroed, *FEATURES, f"algorithm.loss_reduction={reduction}")
        _same_grads(a, b, atol=0.0)
        assert ma["train/loss"] == mb["train/loss"] and ma["train/kl"] == mb["train/kl"]
    trained, _ = _step(tiny_model_dir, groups, *FEATURES, "algorithm.loss_reduction=trajectory")
    with pytest.raises(AssertionError):  # the exclusion changes the step
        _same_grads(a, trained, atol=1e-6)

    # the baseline: the excluded sample's reward is in its group's mean; dropping it changes the others'
    trainer = TorchTrainer(config(tiny_model_dir))
    batch = trainer._prepare(with_rollout_logprobs(trainer, copy.deepcopy(excluded), noise=0.3, seed=0), 1)
    rewards = torch.tensor([[s.reward for s in g] for g in excluded])
    torch.testing.assert_close(batch.advantages, compute_advantages("grpo", rewards).flatten(), rtol=0, atol=0)
    without = compute_advantages("grpo", rewards[1, 1:].view(1, -1)).flatten()
    assert not torch.allclose(batch.advantages[5:8], without)
    assert batch.advantages[4] != 0  # it has an advantage; it is just not trained on


# -- custom data source ------------------------------------------------------------------------


def test_function_rows_feed_prompt_data_and_resume_identically(plugin: str) -> None:
    cfg = DataConfig(source=f"{plugin}:rows", prompt_key="question", label_key="answer", seed=3)
    data = PromptData(cfg)
    assert len(data) == 11
    first = next(data)
    assert first["prompt"][-1]["role"] == "user" and first["prompt"][-1]["content"].startswith("train q")
    assert first["label"] == first["prompt"][-1]["content"].removeprefix("train q")
    assert set(first["metadata"]) == {"level", "row_id", "epoch"}
    taken = [first] + [next(data) for _ in range(14)]  # into the second epoch
    state = data.state_dict()
    rest = [next(data) for _ in range(10)]
    resumed = PromptData(cfg)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(10)] == rest
    assert sorted(r["metadata"]["row_id"] for r in taken[:11]) == list(range(11))

    test = load_rows(cfg.source, cfg, "test")  # eval.source: the test split
    assert [r["prompt"][-1]["content"] for r in test] == [f"test q{i}" for i in range(4)]
    gen = load_rows(f"{plugin}:generated", replace(cfg, apply_chat_template=False))
    assert [r["prompt"] for r in gen] == [f"q{i}" for i in range(5)]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("one_dict", "data.source '.*:one_dict': returned a dict; it must return"),
        ("no_prompt", "data.source '.*:no_prompt': row 0 has no 'question'"),
        ("not_json", "data.source '.*:not_json': row 0 is not a JSON value"),
        ("empty", "data.source '.*:empty': no rows"),
        ("missing", "data.source '.*:missing': .* has no function 'missing'"),
        ("no_split", r"data.source '.*:no_split': no_split\(cfg\) cannot be called with \(cfg, split\)"),
    ],
)
def test_bad_function_sources_name_the_key(plugin: str, name: str, message: str) -> None:
    cfg = DataConfig(source=f"{plugin}:{name}", prompt_key="question", label_key="answer")
    with pytest.raises(ValueError, match=message):
        PromptData(cfg)
    with pytest.raises(ValueError, match=message.replace("data.source", "eval.source")):
        load_rows(cfg.source, cfg, "test")


def test_paths_with_colons_are_files_not_functions(tmp_path: Path) -> None:
    path = tmp_path / "a:b.jsonl"
    path.write_text('{"prompt": "p", "label": 1}\n')
    assert not is_function_source(str(path)) and not is_function_source("task:gsm8k")
    assert is_function_source("pkg.data:rows") and is_function_source("data/rows.py:rows")
    assert load_rows(str(path), DataConfig(source=str(path)))[0]["label"] == 1
