"""Built-in verifiers, and the marker for group-form reward functions.

A reward function is `async def fn(ctx, sample) -> float` (or a dict of named rewards, with
`rollout.reward_key` choosing the one advantages use); `@group_reward` marks the group form (it is
defined with the loader that reads the mark, slimish.plugins). The graders of math and QA RL
(math-verify equivalence, DAPO, F1 / exact match) and reward functions on them are in
slimish/rollout/graders.py.
"""

from __future__ import annotations

from typing import Any

from slimish.plugins import group_reward, is_group_reward
from slimish.rollout.tasks import extract_boxed, get_task
from slimish.types import Sample

__all__ = ["extract_boxed", "final_turn_text", "group_reward", "is_group_reward", "math_reward", "overlong_penalty"]


def final_turn_text(tokenizer: Any, sample: Sample) -> str:
    """The model's last turn: the last run of mask-1 tokens, decoded. For a single-turn sample
    that is the whole response; for an agent it is the answer after the tool calls, so a tool's
    output (mask 0) can never be scored as the model's answer."""
    mask = sample.loss_mask
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return tokenizer.decode(sample.response_ids[start:end], skip_special_tokens=True)


async def math_reward(ctx: Any, sample: Sample) -> float:
    """1.0 for a right final answer, else 0.0: the built-in task's own `score` when the sample
    comes from `task:NAME`, otherwise the last `\\boxed{...}` compared with the label."""
    text = final_turn_text(ctx.tokenizer, sample)
    task = sample.metadata.get("task")
    if task:
        return get_task(task).score(text, sample.label)
    answer = extract_boxed(text)
    return float(answer is not None and _normalise(answer) == _normalise(str(sample.label)))


def _normalise(answer: str) -> str:
    return " ".join(answer.split())


def overlong_penalty(length: int, limit: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to `limit - buffer` tokens, then falling linearly to
    `-penalty` at `limit` (and beyond). The signal starts before the cut does, so a policy learns
    to finish in time; a truncated response alone carries no such signal (its reward is its
    answer's, and nothing in the loss sees that it never ended)."""
    if buffer <= 0 or length <= limit - buffer:
        return 0.0
    return -penalty * min(length - (limit - buffer), buffer) / buffer
