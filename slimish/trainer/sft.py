"""Supervised warm start (`sft.steps` > 0): teach the answer format before RL teaches the goal.

Demonstrations come from a built-in task (`task:NAME`, its `demonstration` per prompt) or a JSONL
file of `prompt` and `response`. Prompts are rendered exactly as rollouts render them, so the
format the model learns here is the one it is asked for during RL.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Iterator
from typing import Any

from slimish.config import RunConfig
from slimish.formats.model import ModelFormat
from slimish.rollout.data import TASK_PREFIX, load_rows
from slimish.rollout.tasks import get_task
from slimish.types import Sample


def demonstrations(cfg: RunConfig) -> list[tuple[Any, str]]:
    """(prompt, response text) pairs, prompts normalised as the rollout's data stream does."""
    source = cfg.sft.source or cfg.data.source
    if source.startswith(TASK_PREFIX):
        task, rng = get_task(source.removeprefix(TASK_PREFIX)), random.Random(cfg.seed)
        raw = task.make("train", cfg.data.task_size, cfg.data.seed)
        rows = load_rows(source, cfg.data, "train")  # the same problems, in the same order
        return [(row["prompt"], task.demonstration(r, rng)) for r, row in zip(raw, rows)]
    rows = load_rows(source, dataclasses.replace(cfg.data, label_key=None))
    for row in rows:
        if not isinstance(row["metadata"].get("response"), str):
            raise SystemExit(f"sft.source {source}: row {row['metadata']['row_id']} needs a string `response`")
    return [(row["prompt"], row["metadata"]["response"]) for row in rows]


def sft_batches(cfg: RunConfig, tokenizer: Any) -> Iterator[list[Sample]]:
    """`sft.steps` batches of `sft.batch_size` samples, every response token trained on. A chat
    prompt's response is the assistant turn as the template renders it, up to the token that
    ends the turn (a GLM-style template's next-turn opener included); a text prompt's is the
    response's tokens and EOS."""
    pairs = demonstrations(cfg)
    if not pairs:
        raise SystemExit("sft: no demonstrations")
    fmt = ModelFormat(tokenizer, cfg.model, cfg.rollout.tool_call_parser, cfg.rollout.reasoning_parser)
    chat = fmt.chat(None, **cfg.rollout.chat_template_kwargs)

    @functools.cache
    def rendered(i: int) -> tuple[list[int], list[int]]:
        prompt, response = pairs[i]
        if isinstance(prompt, str):
            return fmt.prompt_ids(prompt), tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        return chat.prompt_ids(prompt), chat.assistant_ids(prompt, {"role": "assistant", "content": response})

    rng = random.Random(cfg.seed)
    order: list[int] = []
    for _ in range(cfg.sft.steps):
        batch = []
        for _ in range(cfg.sft.batch_size):
            if not order:  # epochs without replacement
                order = rng.sample(range(len(pairs)), len(pairs))
            i = order.pop()
            prompt_ids, ids = rendered(i)
            sample = Sample(prompt=pairs[i][0])
            sample.set_prompt(prompt_ids)
            sample.append_model(ids, [0.0] * len(ids))
            batch.append(sample)
        yield batch
