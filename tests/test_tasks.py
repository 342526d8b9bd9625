"""Built-in tasks: deterministic, disjoint splits; exact scoring; format-only demonstrations."""

from __future__ import annotations

import random

import pytest

from slimish.rollout.rewards import extract_boxed
from slimish.rollout.tasks import TASKS, get_task, split_of

NAMES = sorted(TASKS)


@pytest.mark.parametrize("name", NAMES)
def test_splits_are_deterministic_distinct_and_disjoint(name: str) -> None:
    task = get_task(name)
    train, test = task.make("train", 2000, seed=0), task.make("test", 500, seed=0)
    assert task.make("train", 2000, seed=0) == train
    assert task.make("train", 2000, seed=1) != train
    assert len(train) == 2000 and len(test) == 500
    train_prompts, test_prompts = {r["prompt"] for r in train}, {r["prompt"] for r in test}
    assert len(train_prompts) == 2000 and len(test_prompts) == 500
    assert not train_prompts & test_prompts
    # Disjoint whatever the seeds: membership is a function of the prompt alone.
    assert not {r["prompt"] for r in task.make("test", 500, seed=7)} & train_prompts
    assert all(split_of(p) == "test" for p in test_prompts)
    assert all(r["task"] == name and isinstance(r["label"], str) for r in train + test)


@pytest.mark.parametrize("name", NAMES)
def test_score_of_right_wrong_and_unformatted_answers(name: str) -> None:
    task = get_task(name)
    for row in task.make("test", 50, seed=0):
        label = row["label"]
        assert task.score(f"\\boxed{{{label}}}", label) == 1.0
        assert task.score(f"So the answer is \\boxed{{ {label} }}.", label) == 1.0
        assert task.score(f"\\boxed{{{label}}} then \\boxed{{{label}9}}", label) == 0.0  # the last box counts
        assert task.score(f"\\boxed{{{label}9}} then \\boxed{{{label}}}", label) == 1.0
        assert task.score(label, label) == 0.0  # no box, no reward
        assert task.score(f"\\boxed{{{label}", label) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_demonstrations_have_the_format_but_not_the_answer(name: str) -> None:
    """Demonstrations are guesses independent of the prompt: they teach the format, not the task."""
    task = get_task(name)
    rows = task.make("train", 400, seed=0)
    rng = random.Random(0)
    demos = [task.demonstration(r, rng) for r in rows]
    rng = random.Random(0)
    assert [task.demonstration(r, rng) for r in rows] == demos
    assert all(d.startswith("\\boxed{") and d.endswith("}") for d in demos)
    answers = [extract_boxed(d) for d in demos]
    if name in ("max_digit", "sort"):  # guesses are made of the listed items
        assert all(set(a.split()) <= set(r["prompt"].split(":")[1].split()) for a, r in zip(answers, rows))
        assert all(len(a.split()) == len(r["label"].split()) for a, r in zip(answers, rows))
    accuracy = sum(task.score(d, r["label"]) for d, r in zip(demos, rows)) / len(rows)
    assert accuracy < 0.3, f"{name}: demonstrations give away the answer ({accuracy:.2f} correct)"


def test_max_digit_answers_are_uniform() -> None:
    """No constant answer is right often, so held-out accuracy at the start of RL is low.
    (Small maxima have few distinct problems, so a large split holds fewer of them.)"""
    labels = [r["label"] for r in get_task("max_digit").make("test", 2000, seed=0)]
    counts = {d: labels.count(str(d)) for d in range(10)}
    assert max(counts.values()) / len(labels) < 0.2, counts


def test_labels_are_the_true_answers() -> None:
    for row in get_task("max_digit").make("test", 20, seed=0):
        digits = row["prompt"].split(":")[1].split()
        assert row["label"] == max(digits) and digits.count(row["label"]) == 1
    for row in get_task("add").make("test", 20, seed=0):
        a, b = row["prompt"].removeprefix("What is ").removesuffix("?").split(" + ")
        assert row["label"] == str(int(a) + int(b))
    for row in get_task("sort").make("test", 20, seed=0):
        assert row["label"].split() == sorted(row["prompt"].split(":")[1].split())
    for row in get_task("count").make("test", 20, seed=0):
        head, items = row["prompt"].split(":")
        assert row["label"] == str(items.split().count(head.split()[-3]))


def test_extract_boxed() -> None:
    assert extract_boxed("a \\boxed{3} b \\boxed{x{y}z}") == "x{y}z"
    assert extract_boxed(r"so \boxed{3} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_boxed("\\boxed{7} then \\boxed{8") == "7"
    assert extract_boxed("\\boxed{}") == ""
    assert extract_boxed("no box") is None


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="unknown task 'nope'.*max_digit"):
        get_task("nope")
    with pytest.raises(ValueError, match="split must be one of"):
        get_task("add").make("val", 10, seed=0)
    with pytest.raises(ValueError, match="n must be >= 0"):
        get_task("add").make("train", -1, seed=0)
    with pytest.raises(ValueError, match="could not draw 5000 distinct 'test' problems"):
        get_task("add").make("test", 5000, seed=0)  # 100 x 100 sums, a fifth of them held out
