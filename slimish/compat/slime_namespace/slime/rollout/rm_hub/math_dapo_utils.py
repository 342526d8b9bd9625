"""slime.rollout.rm_hub.math_dapo_utils: DAPO's score (slimish.rollout.graders.dapo_score)."""

from __future__ import annotations

from typing import Any

from slimish.rollout.graders import dapo_score, extract_boxed, math_equal

from .math_utils import last_boxed_only_string, remove_boxed


def compute_score(
    solution_str: str, ground_truth: Any, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict[str, Any]:
    """{"score": 1.0 or -1.0, "acc", "pred"}: the last `Answer:` line (or, with
    `strict_box_verify`, the last `\\boxed{}` of the last 100 characters) checked against the label."""
    if not strict_box_verify:
        return dapo_score(solution_str, ground_truth)
    tail = solution_str[pause_tokens_index[-1] - 100 :] if pause_tokens_index else solution_str[-100:]
    pred = extract_boxed(tail)
    correct = math_equal(pred, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


__all__ = ["compute_score", "last_boxed_only_string", "remove_boxed"]
