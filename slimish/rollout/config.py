"""The rollout side's schemas: prompts (DataConfig), rollouts (RolloutConfig) and evaluation
(EvalConfig): every default of the rollout side lives here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from slimish.engine.config import check_parsers
from slimish.schema import at_least, doc, doc_factory, one_of

ZERO_VARIANCE_FILTER = "slimish.rollout.filters:nonzero_std"  # drops groups whose rewards are all equal
# Help shared by a group of fields.
HOOKS_DOC = (
    "Hooks, each module:function (slimish/plugins.py has their shapes): on every sample the rollout fn "
    "returned, before scoring; and over a scored group, replacing its rewards."
)
SAMPLING_DOC = "Default sampling params for ctx.generate / ctx.chat."
OVERLONG_DOC = (
    "Overlong handling (DAPO). overlong_buffer > 0: each trajectory's reward gets a penalty falling linearly from "
    "0 to -overlong_penalty over the last overlong_buffer tokens before overlong_max_tokens (None: "
    "max_new_tokens), counting every token the model wrote in the trajectory; overlong_filter: truncated samples "
    "stay in their group's baseline, out of the loss."
)
PARSER_DOC = (
    "SGLang's parser names (`--tool-call-parser`, `--reasoning-parser`); None: detected from the chat template; "
    '"none": off.'
)


@dataclass
class DataConfig:
    """Prompts: a JSONL / Parquet file, a local `datasets` directory, `task:NAME` (built-in), or a function."""

    source: str = doc(
        MISSING,
        "a .jsonl / .parquet file, a `datasets` directory, task:NAME, or module:function, `fn(cfg: DataConfig, split: "
        "str) -> Iterable[dict]`: rows as in a JSONL file, called once per split (train; test for eval.source); it "
        "must return the same rows every time (resume)",
    )
    prompt_key: str = doc("prompt", "a string (text) or a list of messages (chat)")
    label_key: str | None = doc("label", "None: rows carry no label (e.g. a reward model scores them)")
    apply_chat_template: bool = doc(True, "text prompts become one user message")
    system_prompt: str | None = doc(None, "a system message before every chat prompt; None: none")
    shuffle: bool = doc(True, "reshuffled every epoch with seed + epoch")
    seed: int | None = doc(None, "shuffling and `task:NAME` prompts; None: the run's seed")
    task_size: int = doc(2000, "prompts per split for `task:NAME` sources")


@dataclass
class RolloutConfig:
    rollout_fn: str = doc("rollout_plugins.math:rollout", "module:function or path/to/file.py:function")
    reward_fn: str | None = doc(None, "async (ctx, sample) -> float, or a group form; None: the plugin sets rewards")
    filter_fn: str | None = doc(ZERO_VARIANCE_FILTER, "over a finished group; None: keep all")
    reward_key: str | None = doc(None, "for dict rewards: the numeric key advantages use (others are kept as metadata)")
    sample_hook: str | None = doc(None, HOOKS_DOC)
    reward_post_fn: str | None = doc(None, HOOKS_DOC)
    keep_when_insufficient: bool = doc(
        False,
        "When a step runs out of prompts (max_prompts_factor) with groups dropped by the filter, train on the newest "
        "of those to fill the batch instead of training short (rollout/groups_refilled).",
    )
    max_consecutive_failures: int = doc(
        8,
        "A rollout, reward or filter function that fails the same way (same exception type, same place) on this many "
        "groups in a row stops the run with that error; 0 = never.",
    )
    args: dict[str, Any] = doc_factory(
        dict,
        "The plugin's own settings (any YAML; `rollout.args.KEY=VALUE` on the command line): `ctx.args`.",
    )
    n_samples_per_prompt: int = doc(8, "samples per prompt: one group")
    rollout_batch_size: int = doc(8, "groups that must survive filtering each step")
    max_concurrency: int = doc(64, "samples in flight")
    over_sampling: float = doc(1.0, "start up to this many times the groups still needed")
    partial_rollout: bool = doc(
        False,
        "Keep samples aborted at a step's end and resume them next step. Their first tokens come from older weights: "
        "buffer.max_staleness must allow that (>= 1), else they restart from scratch.",
    )
    max_prompts_factor: float = doc(
        8.0,
        "A step that has taken this many times rollout_batch_size prompts without filling its batch (groups failing or "
        "filtered) trains on the groups that survived (metric rollout/groups_short), or, when none did, stops with an "
        "error naming the failures and filter reasons.",
    )
    abort_timeout: float = doc(60.0, "seconds leftovers get to return after the end-of-step abort; then cancelled")
    max_new_tokens: int = doc(64, SAMPLING_DOC)
    temperature: float = doc(1.0, SAMPLING_DOC)
    top_p: float = doc(1.0, SAMPLING_DOC)
    top_k: int = doc(-1, SAMPLING_DOC)
    stop: list[str] = doc_factory(list, SAMPLING_DOC)
    overlong_buffer: int = doc(0, OVERLONG_DOC)
    overlong_penalty: float = doc(1.0, OVERLONG_DOC)
    overlong_max_tokens: int | None = doc(None, OVERLONG_DOC)
    overlong_filter: bool = doc(False, OVERLONG_DOC)
    chat_template_kwargs: dict[str, Any] = doc_factory(
        dict,
        "The model's chat format (slimish/formats). Template variables for every prompt the run renders (e.g. "
        "{enable_thinking: false} for Qwen3, {thinking: true} for DeepSeek-V3.1): rollouts, the capture endpoint, SFT "
        "and evaluation alike.",
    )
    tool_call_parser: str | None = doc(None, PARSER_DOC)
    reasoning_parser: str | None = doc(None, PARSER_DOC)
    history: str = doc(
        "exact",
        "How the capture endpoint continues a conversation whose template re-renders history (Qwen3 and GLM drop "
        "reasoning of turns before the last user message): exact: the ids the model saw, chained turn after turn: one "
        "sample, trained on what the model really saw, though a served model would see that history re-rendered; "
        "template: each turn's prompt is the template's rendering of the conversation; a turn whose rendering does not "
        "extend the ids before it starts a new segment (a separate sample).",
    )
    realign_tokens: int = doc(
        8,
        "The gateway realigns a reply an agent sent back changed (reformatted, trimmed) when its rendering differs "
        "from the model's ids in at most this many of them (those are then the environment's, mask 0); a larger change "
        "starts a new segment.",
    )

    def __post_init__(self) -> None:
        at_least(
            1,
            self,
            "rollout.",
            "n_samples_per_prompt",
            "rollout_batch_size",
            "max_concurrency",
            "max_new_tokens",
            "over_sampling",
            "max_prompts_factor",
        )
        at_least(0, self, "rollout.", "max_consecutive_failures", "overlong_buffer", "overlong_penalty")
        limit = self.overlong_max_tokens or self.max_new_tokens
        if self.overlong_buffer > limit:
            raise ValueError(
                f"rollout.overlong_buffer ({self.overlong_buffer}) must be at most the length it ends at "
                f"(rollout.overlong_max_tokens or max_new_tokens: {limit})"
            )
        one_of("rollout.history", self.history, ("exact", "template"))
        check_parsers("rollout.", self.tool_call_parser, self.reasoning_parser)


@dataclass
class EvalDataset:
    """One held-out dataset of `eval.datasets`; a field left null takes the `eval` section's value
    (sampling: `eval.temperature`, the rest of `rollout`'s)."""

    name: str = doc(MISSING, "metrics are eval/NAME/...")
    source: str = doc(MISSING, "as eval.source")
    rollout_fn: str | None = doc(None, "None: rollout.rollout_fn")
    reward_fn: str | None = doc(None, "None: rollout.reward_fn")
    n_prompts: int | None = None
    n_samples_per_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts, all of it here: `source` is one dataset (metrics eval/...),
    `datasets` any number more (eval/NAME/...). Each reports reward, accuracy (reward >= 1),
    pass@k for k = 1, 2, 4, ... up to n_samples_per_prompt, and mean@n (mean accuracy)."""

    every: int = doc(5, "steps; 0 = never")
    source: str | None = doc(None, "held-out prompts; `task:NAME` uses the task's held-out split")
    n_prompts: int = 64
    n_samples_per_prompt: int = 1
    temperature: float = 0.0
    datasets: list[EvalDataset] = field(default_factory=list)

    def __post_init__(self) -> None:
        at_least(1, self, "eval.", "n_samples_per_prompt", "n_prompts")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.datasets: names must be unique, got {names}")
        for i, d in enumerate(self.datasets):
            at_least(1, d, f"eval.datasets[{i}].", "n_prompts", "n_samples_per_prompt", "max_new_tokens")
