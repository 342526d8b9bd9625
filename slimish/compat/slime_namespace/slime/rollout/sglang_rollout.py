"""slime.rollout.sglang_rollout: `GenerateState`, the default single-turn `generate`, and
`generate_and_rm` / `generate_and_rm_group` (generate, then reward by `rm_hub`).

`GenerateState(args)` is one object per model (`args.hf_checkpoint`), holding the run's tokenizer
(slimish's own when created inside a rollout) and slime's default sampling params. Concurrency is
bounded by slimish's manager (`rollout.max_concurrency`), so its `semaphore` does not limit.
`generate_rollout` (slime's whole-step loop, which slimish's manager replaces) is not provided.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import Iterator
from typing import Any

from slime.rollout.rm_hub import async_rm, batched_async_rm
from slime.utils.http_utils import post
from slime.utils.misc import load_function
from slime.utils.types import Sample

from slimish.compat.slime.calls import current_context


class _Unbounded:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class GenerateState:
    _by_model: dict[Any, "GenerateState"] = {}

    def __new__(cls, args: Any = None) -> "GenerateState":
        key = getattr(args, "hf_checkpoint", None)
        state = cls._by_model.get(key)
        if state is None:
            state = super().__new__(cls)
            state.tokenizer = None
            cls._by_model[key] = state
        return state

    def __init__(self, args: Any = None) -> None:
        self.args = args
        if self.tokenizer is None:
            ctx = current_context()
            if ctx is not None:
                self.tokenizer = ctx.tokenizer
            else:
                from slime.utils.processing_utils import load_tokenizer

                self.tokenizer = load_tokenizer(args.hf_checkpoint, trust_remote_code=True)
        self.processor = None
        self.semaphore = _Unbounded()
        self.sampling_params: dict[str, Any] = dict(
            temperature=args.rollout_temperature,
            top_p=args.rollout_top_p,
            top_k=args.rollout_top_k,
            max_new_tokens=args.rollout_max_response_len,
            stop=args.rollout_stop,
            stop_token_ids=getattr(args, "rollout_stop_token_ids", None),
            skip_special_tokens=getattr(args, "rollout_skip_special_tokens", False),
            no_stop_trim=True,
            spaces_between_special_tokens=False,
        )
        self.dp_counts = [0]
        self.dp_rank = 0
        self.reset()

    @contextlib.contextmanager
    def dp_rank_context(self) -> Iterator[int]:
        yield 0

    def reset(self) -> None:
        self.remaining_batch_size = 0
        self.pendings: set = set()
        self.aborted = False


def get_model_url(args: Any, model_name: str, endpoint: str = "/generate") -> str:
    """The router's URL (slimish serves one model)."""
    return f"http://{args.sglang_router_ip}:{args.sglang_router_port}{endpoint}"


def _prepare_prompt_ids(sample: Sample, tokenizer: Any, processor: Any = None) -> list[int]:
    """The ids to generate from: the sample's tokens when it has some, else its prompt encoded
    without special tokens (chat messages through the chat template). Text only: a processor
    for multimodal inputs is refused."""
    if processor is not None and any(v is not None for v in (sample.multimodal_inputs or {}).values()):
        raise NotImplementedError("slimish trains text models: multimodal_inputs cannot be processed")
    if sample.tokens:
        return list(sample.tokens)
    if isinstance(sample.prompt, list):
        return list(tokenizer.apply_chat_template(sample.prompt, tokenize=True, add_generation_prompt=True))
    return tokenizer.encode(sample.prompt, add_special_tokens=False)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """One model turn on the sample's token ids (its prompt, encoded without special tokens, the
    first time), within what is left of `max_new_tokens`; appends the engine's ids and logprobs."""
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"generate: sample status is {sample.status}; expected PENDING or ABORTED")
    state = GenerateState(args)
    prompt_ids = _prepare_prompt_ids(sample, state.tokenizer, state.processor)
    if not sample.tokens:
        sample.tokens = list(prompt_ids)
    budget = sampling_params["max_new_tokens"] - sample.response_length
    if budget <= 0:
        sample.status = Sample.Status.TRUNCATED
        return sample
    payload = {
        "input_ids": prompt_ids,
        "sampling_params": {**sampling_params, "max_new_tokens": budget},
        "return_logprob": True,
    }
    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    output = await post(url, payload)
    pairs = output["meta_info"].get("output_token_logprobs") or []
    sample.append_response_tokens(
        args,
        tokens=[p[1] for p in pairs],
        log_probs=[p[0] for p in pairs],
        trainable=True,
        meta_info=output["meta_info"],
        text=output.get("text", ""),
    )
    return sample


async def generate_and_rm(
    args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False
) -> Sample | list[Sample]:
    """The sample generated (its own `generate_function_path`, the run's custom generate, or
    `generate`), then rewarded by `rm_hub.async_rm` where nothing set a reward (not with a group
    rm: `generate_and_rm_group` scores the group). A finished sample is returned as it is."""
    if sample.status in (Sample.Status.COMPLETED, Sample.Status.TRUNCATED):
        return sample
    path = sample.generate_function_path or args.custom_generate_function_path
    fn = load_function(path) if path else generate
    if "evaluation" in inspect.signature(fn).parameters:
        sample = await fn(args, sample, sampling_params, evaluation=evaluation)
    else:
        sample = await fn(args, sample, sampling_params)
    if args.group_rm:
        return sample
    samples = sample if isinstance(sample, list) else [sample]
    if any(s.status == Sample.Status.ABORTED for s in samples):
        return sample
    if isinstance(sample, list):  # a fan-out: scored together, as slime does
        unscored = [s for s in sample if s.reward is None]
        for s, reward in zip(unscored, await batched_async_rm(args, unscored)):
            s.reward = reward
    elif sample.reward is None:
        sample.reward = await async_rm(args, sample)
    return sample


async def generate_and_rm_group(
    args: Any, group: list[Sample], sampling_params: dict[str, Any], evaluation: bool = False
) -> list[Any]:
    """`generate_and_rm` on every sample of the group at once (each with a session id), then the
    group rm over the group when `args.group_rm`."""
    for sample in group:
        sample.session_id = sample.session_id or str(uuid.uuid4())
    group = list(await asyncio.gather(*(generate_and_rm(args, s, dict(sampling_params), evaluation) for s in group)))
    if args.group_rm and not GenerateState(args).aborted:
        for sample, reward in zip(group, await batched_async_rm(args, group)):
            sample.reward = reward
    return group


__all__ = [
    "GenerateState",
    "_prepare_prompt_ids",
    "generate",
    "generate_and_rm",
    "generate_and_rm_group",
    "get_model_url",
]
