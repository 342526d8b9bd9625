"""slime.rollout.sglang_rollout: `GenerateState` and the default single-turn `generate`.

`GenerateState(args)` is one object per model (`args.hf_checkpoint`), holding the run's tokenizer
(slimish's own when created inside a rollout) and slime's default sampling params. Concurrency is
bounded by slimish's manager (`rollout.max_concurrency`), so its `semaphore` does not limit.
The whole-rollout functions of this module (`generate_rollout`, `generate_and_rm_group`...) are
slime's outer loop, which slimish's manager replaces: they are not provided.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from slime.utils.http_utils import post
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
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True)
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


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any], evaluation: bool = False) -> Sample:
    """One model turn on the sample's token ids (its prompt, encoded without special tokens, the
    first time), within what is left of `max_new_tokens`; appends the engine's ids and logprobs."""
    if sample.status not in (Sample.Status.PENDING, Sample.Status.ABORTED):
        raise ValueError(f"generate: sample status is {sample.status}; expected PENDING or ABORTED")
    state = GenerateState(args)
    if sample.tokens:
        prompt_ids = list(sample.tokens)
    elif isinstance(sample.prompt, list):
        prompt_ids = state.tokenizer.apply_chat_template(sample.prompt, tokenize=True, add_generation_prompt=True)
    else:
        prompt_ids = state.tokenizer.encode(sample.prompt, add_special_tokens=False)
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


__all__ = ["GenerateState", "generate", "get_model_url"]
