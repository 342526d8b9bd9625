"""slime.rollout.rm_hub.deepscaler: DeepScaleR's rule reward on slimish's graders."""

from __future__ import annotations

from typing import Any

from slimish.rollout.graders import extract_boxed, math_equal


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    """1 when the boxed answer after the reasoning (`</think>`, or `###Response`) is the label;
    0 without reasoning markers, without a boxed answer, or with an empty label."""
    if "</think>" in response:
        solution = response.split("</think>")[-1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0
    return int(label != "" and math_equal(extract_boxed(solution), label))


__all__ = ["get_deepscaler_rule_based_reward"]
