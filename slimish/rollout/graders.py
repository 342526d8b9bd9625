"""Graders for math and QA RL: answer extraction, math equivalence, DAPO's score, F1 / exact match,
and reward functions built on them that `--reward-fn` takes directly
(`slimish.rollout.graders:math_verify_reward`, `dapo_reward`, `f1_reward`, `exact_match_reward`).

Math equivalence is `math-verify`'s (HuggingFace's parser and checker: LaTeX and plain
expressions to sympy, sets, intervals, equations, matrices, percentages, units), not rules of our
own: hand-written normalisers drift from what models write. Its timeouts use SIGALRM, which only
the main thread may set, so elsewhere (slimish train's rollout loop) the check runs without one;
an answer longer than 300 characters is not parsed at all.
"""

from __future__ import annotations

import logging
import re
import signal
import string
import threading
from collections import Counter
from typing import Any

from slimish.rollout.rewards import final_turn_text
from slimish.rollout.tasks import extract_boxed
from slimish.types import Sample

__all__ = [
    "dapo_reward",
    "dapo_score",
    "exact_match",
    "exact_match_reward",
    "extract_boxed",
    "extract_final_answer",
    "f1_reward",
    "f1_score",
    "math_equal",
    "math_verify_reward",
    "normalize_qa",
]

# math-verify logs a warning on every call made without a timeout (ours, off the main thread).
logging.getLogger("math_verify").setLevel(logging.ERROR)

TAIL_CHARS = 300  # DAPO looks at the end of a response only: the answer is there
ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")
GSM8K_ANSWER = re.compile(r"####\s*([^\n]+)")


def extract_final_answer(text: str) -> str | None:
    """The answer a response gives: its last `\\boxed{...}`, else its last `Answer: ...` line
    (DAPO's and Minerva's format), else its last `#### ...` (GSM8K's); None when it gives none."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (ANSWER_LINE, GSM8K_ANSWER):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().rstrip(".").strip()
    return None


def _timeout() -> int | None:
    """math-verify's timeout: SIGALRM, so only on the main thread and only when no other timer is
    pending (its end cancels any: pytest-timeout's, for one)."""
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(signal.ITIMER_REAL)[0]:
        return None
    return 5


def _parse(answer: str) -> list[Any]:
    from math_verify import parse

    return parse(f"\\boxed{{{answer}}}", parsing_timeout=_timeout())


def math_equal(given: str | None, truth: Any) -> bool:
    """Whether `given` is mathematically the answer `truth` (math-verify: `1/2` = `0.5` =
    `\\frac{1}{2}`, `x=5` = `5`, `\\{1,2\\}` = `\\{2,1\\}`...). A truth that is itself a
    `\\boxed{}` solution is reduced to its box. Answers math-verify cannot read are compared as
    whitespace-collapsed strings."""
    if given is None or truth is None or str(truth).strip() == "":
        return False
    truth = str(truth)
    if "\\boxed" in truth:
        truth = extract_boxed(truth) or truth
    given, truth = given.strip(), truth.strip()
    if " ".join(given.split()) == " ".join(truth.split()):
        return True
    if len(given) > TAIL_CHARS:  # not an answer; and sympy could take unbounded time on it
        return False
    from math_verify import verify

    gold, pred = _parse(truth), _parse(given)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=_timeout()))


def dapo_score(response: str, label: Any) -> dict[str, Any]:
    """DAPO's reward: the last `Answer: X` line of the response's last 300 characters checked
    against the label (math equivalence): score 1.0 right, -1.0 wrong or missing; `acc` and the
    extracted `pred` ("[INVALID]" when there is none) as slime's `math_dapo_utils.compute_score`
    reports them."""
    found = ANSWER_LINE.findall(response[-TAIL_CHARS:])
    pred = found[-1].strip() if found else "[INVALID]"
    correct = bool(found) and math_equal(pred, label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def normalize_qa(text: str) -> str:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in str(text).lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str | None, truth: Any) -> bool:
    """Equal after `normalize_qa`; a list of truths matches when any does."""
    truths = truth if isinstance(truth, (list, tuple)) else [truth]
    return prediction is not None and any(normalize_qa(prediction) == normalize_qa(t) for t in truths)


def f1_score(prediction: str | None, truth: Any) -> tuple[float, float, float]:
    """Token-overlap (f1, precision, recall) after `normalize_qa`, as SQuAD and HotpotQA score
    it; a yes/no/noanswer answer scores only by matching exactly."""
    if prediction is None:
        return 0.0, 0.0, 0.0
    pred, gold = normalize_qa(prediction), normalize_qa(truth)
    if (pred in ("yes", "no", "noanswer") or gold in ("yes", "no", "noanswer")) and pred != gold:
        return 0.0, 0.0, 0.0
    common = sum((Counter(pred.split()) & Counter(gold.split())).values())
    if not common:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(pred.split()), common / len(gold.split())
    return 2 * precision * recall / (precision + recall), precision, recall


# ---- reward functions (`--reward-fn slimish.rollout.graders:NAME`) --------------------------------


def _answer_text(ctx: Any, sample: Sample) -> str:
    return final_turn_text(ctx.tokenizer, sample)


async def math_verify_reward(ctx: Any, sample: Sample) -> float:
    """1.0 when the model's final answer (`extract_final_answer` of its last turn) is equivalent
    to the label under math-verify, else 0.0."""
    return float(math_equal(extract_final_answer(_answer_text(ctx, sample)), sample.label))


async def dapo_reward(ctx: Any, sample: Sample) -> dict[str, Any]:
    """`dapo_score` of the last turn: a dict reward (train on it with `rollout.reward_key=score`)."""
    return dapo_score(_answer_text(ctx, sample), sample.label)


async def f1_reward(ctx: Any, sample: Sample) -> float:
    """Token F1 of the final answer (or the whole last turn when it gives none) against the label."""
    text = _answer_text(ctx, sample)
    return f1_score(extract_final_answer(text) or text, sample.label)[0]


async def exact_match_reward(ctx: Any, sample: Sample) -> float:
    """1.0 when the final answer (or the whole last turn) equals the label after `normalize_qa`."""
    text = _answer_text(ctx, sample)
    return float(exact_match(extract_final_answer(text) or text, sample.label))
