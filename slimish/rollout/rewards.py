"""Built-in verifiers, and the marker for group-form reward functions.

A reward function is `async def fn(ctx, sample) -> float` (or a dict of named rewards, with
`rollout.reward_key` choosing the one advantages use); `@group_reward` marks the group form.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from slimish.types import Sample

BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces balanced), or None when there is none.

    The last one, because a model that reasons before answering may box intermediate values.
    """
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED) : i - 1]
        start = text.rfind(BOXED, 0, start)  # unclosed: an earlier, closed one may still count
    return None


def group_reward(fn: Callable[..., Awaitable[list[Any]]]) -> Callable[..., Awaitable[list[Any]]]:
    """Marks `async def fn(ctx, samples) -> list[float | dict]` as a reward over a whole finished
    group (one reward per sample, in order), e.g. a pairwise judge or a group-relative score."""
    fn.__slimish_group_reward__ = True  # type: ignore[attr-defined]
    return fn


def is_group_reward(fn: Any) -> bool:
    return getattr(fn, "__slimish_group_reward__", False) is True


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
        from slimish.rollout.tasks import get_task  # tasks.py imports this module

        return get_task(task).score(text, sample.label)
    answer = extract_boxed(text)
    return float(answer is not None and _normalise(answer) == _normalise(str(sample.label)))


def _normalise(answer: str) -> str:
    return " ".join(answer.split())
