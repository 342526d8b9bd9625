"""Supervised warm start (`sft.steps` > 0): teach the answer format before RL teaches the goal.

Demonstrations come from a built-in task (`task:NAME`, its `demonstration` per prompt) or a JSONL
file of `prompt` and `response` (text, or an assistant message: a tool call), with the `tools` the
prompt offers. Prompts are rendered exactly as rollouts render them, so the
format the model learns here is the one it is asked for during RL.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from slimish.formats.model import ModelFormat
from slimish.rollout.data import TASK_PREFIX, load_rows
from slimish.rollout.tasks import get_task
from slimish.types import Sample

if TYPE_CHECKING:
    from slimish.config import RunConfig


@dataclasses.dataclass
class Demonstration:
    prompt: str | list[dict[str, Any]]  # text, or chat messages
    response: str | dict[str, Any]  # the reply's text, or a whole assistant message (tool calls included)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools the prompt offers (rendered by the template)


def demonstrations(cfg: RunConfig) -> list[Demonstration]:
    """The demonstrations, prompts normalised as the rollout's data stream does. A JSONL row has
    `prompt`, `response` (text, or an assistant message such as a tool call) and optional `tools`."""
    source = cfg.sft.source or cfg.data.source
    if source.startswith(TASK_PREFIX):
        task, rng = get_task(source.removeprefix(TASK_PREFIX)), random.Random(cfg.seed)
        raw = task.make("train", cfg.data.task_size, cfg.data.seed)
        rows = load_rows(source, cfg.data, "train")  # the same problems, in the same order
        return [Demonstration(row["prompt"], task.demonstration(r, rng)) for r, row in zip(raw, rows)]
    rows = load_rows(
        source, dataclasses.replace(cfg.data, label_key=None), flag="sft.source" if cfg.sft.source else "data.source"
    )
    out = []
    for row in rows:
        meta, where = row["metadata"], f"sft.source {source}: row {row['metadata']['row_id']}"
        response, tools = meta.get("response"), meta.get("tools")
        if not isinstance(response, str) and not (isinstance(response, dict) and response.get("role") == "assistant"):
            raise SystemExit(f"{where} needs a `response`: a string, or an assistant message")
        if tools is not None and not (isinstance(tools, list) and isinstance(row["prompt"], list)):
            raise SystemExit(f"{where}: `tools` must be a list of OpenAI tools, with a chat prompt")
        out.append(Demonstration(row["prompt"], response, tools))
    return out


class Rendered:
    """The demonstrations as token ids, rendered once each, on demand (rollouts' rendering)."""

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.pairs = demonstrations(cfg)
        if not self.pairs:
            raise SystemExit("sft: no demonstrations")
        self.cfg, self.tokenizer = cfg, tokenizer
        self.fmt = ModelFormat(tokenizer, cfg.model, cfg.rollout.tool_call_parser, cfg.rollout.reasoning_parser)
        self._ids = functools.cache(self._render)

    def __len__(self) -> int:
        return len(self.pairs)

    def _render(self, i: int) -> tuple[list[int], list[int]]:
        d, tokenizer = self.pairs[i], self.tokenizer
        if isinstance(d.prompt, str):
            text = d.response if isinstance(d.response, str) else d.response.get("content") or ""
            return self.fmt.prompt_ids(d.prompt), tokenizer.encode(text, add_special_tokens=False) + [
                tokenizer.eos_token_id
            ]
        chat = self.fmt.chat(d.tools, **self.cfg.rollout.chat_template_kwargs)
        message = {"role": "assistant", "content": d.response} if isinstance(d.response, str) else d.response
        return chat.prompt_ids(d.prompt), chat.assistant_ids(d.prompt, message)

    def sample(self, i: int) -> Sample:
        """Demonstration `i` as a sample whose every response token is trained on."""
        prompt_ids, ids = self._ids(i)
        sample = Sample(prompt=self.pairs[i].prompt)
        sample.set_prompt(prompt_ids)
        sample.append_model(ids, [0.0] * len(ids))
        return sample


def sft_batches(cfg: RunConfig, tokenizer: Any) -> Iterator[list[Sample]]:
    """`sft.steps` batches of `sft.batch_size` samples, every response token trained on. A chat
    prompt's response is the assistant turn as the template renders it, up to the token that
    ends the turn (a GLM-style template's next-turn opener included); a text prompt's is the
    response's tokens and EOS."""
    demos = Rendered(cfg, tokenizer)
    rng = random.Random(cfg.seed)
    order: list[int] = []
    for _ in range(cfg.sft.steps):
        batch = []
        for _ in range(cfg.sft.batch_size):
            if not order:  # epochs without replacement
                order = rng.sample(range(len(demos)), len(demos))
            batch.append(demos.sample(order.pop()))
        yield batch


def ptx_batches(cfg: RunConfig, tokenizer: Any) -> Callable[[int], list[Sample]]:
    """`algorithm.ptx_coef`: the `sft.batch_size` demonstrations RL step `step` trains on beside
    its rollouts. Drawn by (seed, step) alone, so every rank and a resumed run draw the same."""
    demos = Rendered(cfg, tokenizer)

    def batch(step: int) -> list[Sample]:
        rng = random.Random(f"{cfg.seed}/ptx/{step}")
        return [demos.sample(rng.randrange(len(demos))) for _ in range(cfg.sft.batch_size)]

    return batch
