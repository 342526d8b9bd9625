"""On-policy distillation (algorithm.opd, launch.teacher): the per-token math, the trainer's use of
it, the teacher's log-probs from a real engine against HF's, the config errors, and end to end: a
student distils a teacher trained by GRPO (the session's quickstart run), with no task reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch
from helpers import SHORT_QUICKSTART, post, run_quickstart
from test_trainer_torch import config, make_groups, with_rollout_logprobs

from slimish.client import Client
from slimish.config import load_run_config
from slimish.launch import check_push_targets
from slimish.rollout.teacher import Teacher, TeacherChanged
from slimish.trainer.config import AlgorithmConfig
from slimish.trainer.losses import opd_advantages, rl_loss, teacher_log_ratio
from slimish.trainer.torch_backend import TorchTrainer
from slimish.types import Sample

TEACHER = "launch.teacher.router_url=http://127.0.0.1:9"  # never called by the trainer-only tests


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# -- the math ------------------------------------------------------------------------------------


def test_opd_advantages_hand_computed() -> None:
    old = t([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    teacher = t([[-1.5, -1.0, -4.0], [-0.1, -2.0, -9.0]])
    mask = t([[1, 1, 0], [1, 1, 0]])  # the last column: an environment token / padding
    ratio = teacher_log_ratio(old, teacher, mask)
    assert ratio.tolist() == [[0.5, -1.0, 0.0], [0.0, -1.0, 0.0]]
    adv = opd_advantages(t([1.0, -2.0]), ratio, coef=0.5)  # task advantage per sample, broadcast
    assert adv.tolist() == [[0.75, 1.5, 1.0], [-2.0, -1.5, -2.0]]
    assert opd_advantages(t([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), ratio, coef=2.0).tolist() == [
        [0.0, 3.0, 1.0],
        [0.0, 2.0, 0.0],
    ]
    old.requires_grad_(True)
    assert not teacher_log_ratio(old, teacher, mask).requires_grad  # a reward, not a loss term


def test_rl_loss_takes_per_sample_or_per_token_advantages() -> None:
    """[B] advantages and the same values repeated per token give the same loss and gradient;
    per-token ones that differ move the loss token by token (at ratio 1 PPO's loss is -A)."""
    cfg = AlgorithmConfig()
    old = t([[-1.0, -2.0, -0.5], [-0.1, -3.0, -1.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    losses, grads = [], []
    for adv in (t([1.0, -2.0]), t([[1.0] * 3, [-2.0] * 3])):
        lp = old.clone().requires_grad_(True)
        loss, _ = rl_loss(cfg, lp, old, adv, mask)
        loss.backward()
        losses.append(loss.item())
        grads.append(lp.grad)
    assert losses[0] == losses[1] == pytest.approx((-1.0 * 3 + 2.0 * 2) / 5)
    assert torch.equal(grads[0], grads[1])
    loss, _ = rl_loss(cfg, old.clone(), old, t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), mask)
    assert loss.item() == pytest.approx(-(1 + 2 + 3 + 4 + 5) / 5)
    with pytest.raises(ValueError, match=r"advantages: expected \[B\] or \[B, T\]"):
        rl_loss(cfg, old, old, t([[1.0, 2.0]] * 2), mask)


# -- the trainer ---------------------------------------------------------------------------------


def with_teacher(groups: list[list[Sample]], shift: float) -> list[list[Sample]]:
    """Teacher log-probs = the rollout's minus `shift` on model tokens (anything on env tokens)."""
    for s in (s for g in groups for s in g):
        s.teacher_logprobs = [lp - shift if m else 7.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask)]
    return groups


def test_trainer_adds_the_teacher_signal_per_token(tiny_model_dir: Path) -> None:
    """A teacher that agrees with the policy changes nothing (same step, same weights, teacher_kl
    0); one that finds every sampled token 0.5 nats less likely gives teacher_kl 0.5 and, with no
    task reward, PPO's loss -A = coef * 0.5 at ratio 1."""
    plain = TorchTrainer(config(tiny_model_dir))
    opd = TorchTrainer(config(tiny_model_dir, "algorithm.opd.coef=1.0", TEACHER))
    a = plain.train_step(with_rollout_logprobs(plain, make_groups(1), 0.0, 1), 1)
    b = opd.train_step(with_teacher(with_rollout_logprobs(opd, make_groups(1), 0.0, 1), 0.0), 1)
    assert b["train/teacher_kl"] == 0.0 and "train/teacher_kl" not in a
    assert b["train/loss"] == a["train/loss"] and b["train/grad_norm"] == a["train/grad_norm"]
    assert all(torch.equal(p, q) for p, q in zip(plain.model.parameters(), opd.model.parameters()))

    pure = TorchTrainer(
        config(
            tiny_model_dir,
            "algorithm.opd.coef=0.3",
            "algorithm.opd.task_reward=false",
            "rollout.filter_fn=null",
            TEACHER,
        )
    )
    m = pure.train_step(with_teacher(with_rollout_logprobs(pure, make_groups(2), 0.0, 2), 0.5), 1)
    assert m["train/teacher_kl"] == pytest.approx(0.5, abs=1e-6)
    assert m["train/policy_loss"] == pytest.approx(0.3 * 0.5, abs=1e-6)
    assert m["train/grad_norm"] > 0

    groups = with_rollout_logprobs(pure, make_groups(3), 0.0, 3)
    with pytest.raises(ValueError, match=r"sample 0/\d: no teacher_logprobs; algorithm.opd.coef > 0"):
        pure.train_step(groups, 2)


# -- the teacher's log-probs from a real engine --------------------------------------------------


def hf_logprobs(model_dir: Path, tokens: list[int], start: int, temperature: float) -> list[float]:
    """HF's log_softmax(logits / T) of tokens[start:], each from the position before it, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [lp[j - 1, tokens[j]].item() for j in range(start, len(tokens))]


def test_teacher_logprobs_equal_the_engine_and_hf(engine: str, tiny_model_dir: Path, tok) -> None:
    """A two-turn sample (model, environment, model tokens) made by the engine at T = 0.7, then
    scored by the same engine as teacher: every response token's teacher log-prob equals HF's at
    T = 0.7 within 1e-5, and on model tokens the engine's own rollout log-probs. A push into the
    teacher (its weight version moves) fails the next scoring."""
    temperature = 0.7

    async def main() -> tuple[Sample, Sample]:
        async with Client(engine) as client:
            s = Sample(prompt="")
            s.set_prompt(tok.encode("Largest digit: 8 7 9 0"))
            for turn in range(2):
                if turn:
                    s.append_env(tok.encode(" tool says 5"))
                r = await client.generate(
                    input_ids=s.tokens,
                    return_logprob=True,
                    sampling_params={
                        "temperature": temperature,
                        "max_new_tokens": 6,
                        "ignore_eos": True,
                        "sampling_seed": 3,
                    },
                )
                s.append_model(r.output_ids, [e[0] for e in r.meta_info.output_token_logprobs])
            teacher = Teacher(client, temperature)
            await teacher.score(s)
            assert post(engine, "/update_weight_version", {"new_version": "1"}).status_code == 200
            again = Sample.from_dict(s.to_dict())
            again.teacher_logprobs = None
            with pytest.raises(
                TeacherChanged, match="weight version default became 1: weights were pushed into the teacher"
            ):
                await teacher.score(again)
            return s, again

    s, again = asyncio.run(main())
    assert s.response_length == 6 + len(tok.encode(" tool says 5")) + 6 and s.teacher_logprobs is not None
    s.check()
    expected = hf_logprobs(tiny_model_dir, s.tokens, s.prompt_length, temperature)
    assert max(abs(a - b) for a, b in zip(s.teacher_logprobs, expected)) < 1e-5
    model_tokens = [(a, b) for a, b, m in zip(s.teacher_logprobs, s.rollout_logprobs, s.loss_mask) if m]
    assert len(model_tokens) == 12 and max(abs(a - b) for a, b in model_tokens) < 1e-5
    assert again.teacher_logprobs is None


def test_a_teacher_served_by_name_behind_the_policy_router(
    engine: str, tiny_model_dir_other_seed: Path, tok, tmp_path: Path
) -> None:
    """`launch.teacher.served_name`: the teacher's engine (another model) is started and registered
    on the policy's router by name. Its log-probs are the teacher model's (HF's, within 1e-5, and
    not the policy's); the policy's rollouts and a weight-version push through the router never
    reach it (its own request counter, its pinned version); the policy's engine list read from
    the router leaves it out; it is deregistered when the run ends."""
    from helpers import metric_total, running_router

    from slimish.launch import teacher_servers
    from slimish.launch.config import LaunchConfig, TeacherConfig
    from slimish.launch.workers import existing_engine_urls, key_client

    launch = LaunchConfig(
        start_timeout=120, teacher=TeacherConfig(model=str(tiny_model_dir_other_seed), served_name="teacher")
    )
    params = {"temperature": 1.0, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 1}

    async def main(router: str, teacher_url: str) -> list[Sample]:
        async with Client(router) as client:
            teacher = Teacher(Client(router), 1.0, "teacher")
            samples = []
            for i in range(3):
                s = Sample(prompt="")
                s.set_prompt(tok.encode(f"Largest digit: {i} 7 3"))
                r = await client.generate(input_ids=s.tokens, return_logprob=True, sampling_params=params)
                s.append_model(r.output_ids, [e[0] for e in r.meta_info.output_token_logprobs])
                await teacher.score(s)
                samples.append(s)
                assert post(router, "/update_weight_version", {"new_version": f"policy-{i}"}).status_code == 200
            await teacher.close()
            return samples

    with running_router(worker_urls=[engine]) as router, key_client(None) as http:
        with teacher_servers(launch, tmp_path / "teacher", router) as servers:
            (teacher_url,) = servers.engine_urls
            assert servers.router_url == router and existing_engine_urls(http, router) == [engine, teacher_url]
            check_push_targets(existing_engine_urls(http, router, skip_model="teacher"), servers.engine_urls)
            samples = asyncio.run(main(router, teacher_url))
            assert metric_total(teacher_url, "sglang:num_requests_total") == 3  # the scorings, nothing else
            assert metric_total(teacher_url, "sglang:generation_tokens_total") == 0
            assert httpx.get(teacher_url + "/get_weight_version").json()["weight_version"] == "default"
        assert [w["url"] for w in httpx.get(router + "/workers").json()["workers"]] == [engine]
    for s in samples:
        expected = hf_logprobs(tiny_model_dir_other_seed, s.tokens, s.prompt_length, 1.0)
        assert max(abs(a - b) for a, b in zip(s.teacher_logprobs, expected)) < 1e-5
        assert max(abs(a - b) for a, b in zip(s.teacher_logprobs, s.rollout_logprobs)) > 1e-3  # not the policy's


# -- config and launch errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.opd.coef=0.5"], "algorithm.opd.coef > 0 needs a teacher: set launch.teacher.model"),
        (
            ["algorithm.opd.task_reward=false"],
            "algorithm.opd.task_reward=false (pure distillation) needs algorithm.opd.coef > 0",
        ),
        (
            ["algorithm.opd.coef=1", "algorithm.opd.task_reward=false", "launch.teacher.model=/t"],
            "pure distillation) trains every group whatever its rewards: set rollout.filter_fn=null",
        ),
        (
            ["algorithm.opd.coef=1", "launch.teacher.model=/t", "launch.teacher.router_url=http://h:1"],
            "launch.teacher: set model (engines started by the run) or router_url (an existing server), not both",
        ),
        (
            ["algorithm.opd.coef=1", "launch.router_url=http://h:1/", "launch.teacher.router_url=http://h:1"],
            "launch.teacher.router_url is the policy's launch.router_url",
        ),
        (["algorithm.opd.coef=-1"], "algorithm.opd.coef must be >= 0"),
        (["launch.teacher.engine_kind=external"], "launch.teacher.engine_kind must be one of builtin, sglang"),
        (
            ["algorithm.opd.coef=1", "launch.teacher.served_name=t", "launch.teacher.router_url=http://h:1"],
            "launch.teacher.served_name: a non-empty name the teacher is served under on the policy's router; not with "
            "launch.teacher.router_url",
        ),
        (
            ["algorithm.opd.coef=1", "launch.teacher.served_name=t"],
            "launch.teacher.served_name without launch.teacher.model names a teacher already registered on the policy's router",
        ),
    ],
)
def test_config_errors_name_the_field(overrides: list[str], message: str) -> None:
    with pytest.raises(
        SystemExit, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.").replace(">", ".")
    ):
        load_run_config(None, ["model=/m", "data.source=task:max_digit", *overrides])


def test_weight_sync_never_targets_the_teacher() -> None:
    check_push_targets(["http://127.0.0.1:1"], ["http://127.0.0.1:2"])
    with pytest.raises(
        ValueError, match=r"launch.teacher: engines \['http://127.0.0.1:2'\] serve both the policy and the teacher"
    ):
        check_push_targets(["http://127.0.0.1:1", "http://127.0.0.1:2/"], ["http://127.0.0.1:2"])


# -- end to end ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "mode", [["async_training=false"], ["async_training=true", "buffer.max_staleness=1"]], ids=["sync", "async"]
)
def test_a_teacher_equal_to_the_start_has_zero_kl_until_the_policy_moves(tmp_path: Path, mode: list[str]) -> None:
    """The teacher is the policy's own starting model, served by engines of its own: the first
    step's samples (version 0) have teacher_kl 0 up to engine numerics; once the policy has
    moved it is not 0, and no sample failed, so the teacher was never pushed to (its pinned
    weight version would have failed its samples). No ptx: on this random model the
    quickstart's demonstrations would drive the first step (async once moved it 4e-6 in KL)."""
    from slimish.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    rows = run_quickstart(
        tmp_path,
        "steps=3",
        "sft.steps=0",
        "eval.every=0",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=8",
        "rollout.filter_fn=null",
        "algorithm.opd.coef=1.0",
        "algorithm.ptx_coef=0",
        f"launch.teacher.model={model}",
        *mode,
        model=model,
    )
    kl = [r["train/teacher_kl"] for r in rows[1:]]
    assert abs(kl[0]) < 1e-5, kl
    assert max(abs(k) for k in kl[1:]) > 1e-4, kl
    assert all(r["rollout/groups_failed"] == 0 for r in rows[1:])
    assert (tmp_path / "run" / "logs" / "teacher" / "engine0.log").exists()  # its own engine


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_with_its_teacher_served_by_name_on_the_policy_router(tmp_path: Path) -> None:
    """A short sync run whose teacher (the policy's starting model) is registered by name on the
    run's own router: its engine has a log of its own but no router; the first step's teacher_kl
    is 0 (the teacher's log-probs are the starting model's), later ones are not (the policy moved,
    the teacher did not); no sample failed, so the teacher's weight version never moved."""
    from slimish.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model", arch="llama", size="tiny", seed=0)
    rows = run_quickstart(
        tmp_path,
        "steps=3",
        *SHORT_QUICKSTART,
        "algorithm.opd.coef=1.0",
        f"launch.teacher.model={model}",
        "launch.teacher.served_name=teacher",
        model=model,
    )
    kl = [r["train/teacher_kl"] for r in rows[1:]]
    assert abs(kl[0]) < 1e-5 and max(abs(k) for k in kl[1:]) > 1e-4, kl
    assert all(r["rollout/groups_failed"] == 0 for r in rows[1:])
    logs = tmp_path / "run" / "logs" / "teacher"
    assert (logs / "engine0.log").exists() and not (logs / "router.log").exists()


# Measured (512 held-out prompts, greedy): after the 200-step SFT 0.14; a GRPO teacher of 40 steps
# 0.65-0.67 (30 steps: 0.52 on 64 prompts). Students (2026-12-04) at lr 1e-3 plateau near 0.44 by
# step 10. At 4e-3 (2026-12-07) Adam's first steps overshoot: with seed 0 the teacher KL went 0.15
# -> 2.0 and 3.6 at step 2 in 2 runs of 2 (6.9 at step 5 in one), the student ended at 0.39 (a CI
# run) and 0.65; seeds 1-4 ended at 0.64-0.68 with spikes up to 1.3. At 2e-3 (seeds 0-4, seed 0
# twice) 0.64-0.69 at step 25, teacher KL at most 0.62 at any step, its last 3 steps' sum 0.3-0.6 of
# half its first 3's.
STUDENT_STEPS, STUDENT_LR, EVAL_PROMPTS = 25, 2e-3, 512


@pytest.mark.slow
@pytest.mark.learning
@pytest.mark.timeout(3000)
def test_student_distils_a_grpo_teacher_without_task_reward(
    tmp_path: Path, quickstart_sft: Path, quickstart_grpo: tuple[list[dict], Path]
) -> None:
    """One SFT warm start (held-out accuracy near chance); a teacher trained from it by 40 GRPO
    steps on the quickstart task (the session's quickstart run, conftest.py); a student from the
    same warm start trained by the teacher's per-token signal alone (no task advantage, no reward
    filter): its held-out accuracy rises by 0.3 and its reverse KL to the teacher falls. Its
    teacher is served by engines of its own, never pushed to: the run would fail its samples if
    the teacher's weight version moved."""
    rows, teacher = quickstart_grpo
    assert rows[-1]["step"] == 40
    teacher_acc = rows[-1]["eval/accuracy"]
    assert teacher_acc >= 0.5, f"the teacher reached only {teacher_acc}"

    student = tmp_path / "student"
    rows = run_quickstart(
        student,
        f"steps={STUDENT_STEPS}",
        f"eval.every={STUDENT_STEPS}",
        f"eval.n_prompts={EVAL_PROMPTS}",
        "sft.steps=0",
        f"trainer.lr={STUDENT_LR}",
        "algorithm.opd.coef=1.0",
        "algorithm.opd.task_reward=false",
        "algorithm.ptx_coef=0",  # the teacher alone trains it, not the quickstart's demonstrations
        "rollout.filter_fn=null",
        f"launch.teacher.model={teacher / 'hf'}",
        model=quickstart_sft,
    )
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    kl = [r["train/teacher_kl"] for r in rows[1:]]
    print(f"teacher {teacher_acc}; student {before} -> {after}; teacher_kl {[round(k, 3) for k in kl]}")
    assert before < 0.3 and after >= before + 0.3, f"student accuracy {before} -> {after} (teacher {teacher_acc})"
    assert sum(kl[-3:]) < sum(kl[:3]) / 2, kl
    assert all(r["rollout/groups_failed"] == 0 for r in rows[1:])  # every sample scored by the teacher
