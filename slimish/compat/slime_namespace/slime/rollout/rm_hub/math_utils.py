"""slime.rollout.rm_hub.math_utils: boxed-answer extraction and math grading, by slimish's graders
(equivalence through math-verify rather than slime's own normalisation rules)."""

from __future__ import annotations

from typing import Any

from slimish.rollout.graders import extract_boxed, math_equal


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` of `text`, box included."""
    inner = extract_boxed(text)
    return None if inner is None else f"\\boxed{{{inner}}}"


def remove_boxed(text: str) -> str:
    """`\\boxed{X}` -> `X`."""
    inner = extract_boxed(text)
    return text if inner is None else inner


def extract_boxed_answer(solution: str) -> str | None:
    return extract_boxed(solution)


def extract_answer(passage: str) -> str | None:
    """The last `\\boxed{}`'s content; None when the passage has none."""
    return extract_boxed(passage) if "\\boxed" in passage else None


def grade_answer_mathd(given_answer: str, ground_truth: Any) -> bool:
    return math_equal(given_answer, ground_truth)


def grade_answer_sympy(given_answer: str, ground_truth: Any) -> bool:
    return math_equal(given_answer, ground_truth)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the solution's last boxed answer is the ground truth (itself boxed or not)."""
    if not ground_truth:
        return False
    return math_equal(extract_answer(solution_str), ground_truth)


__all__ = [
    "extract_answer",
    "extract_boxed_answer",
    "grade_answer_mathd",
    "grade_answer_sympy",
    "grade_answer_verl",
    "last_boxed_only_string",
    "remove_boxed",
]
