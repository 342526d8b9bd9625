"""slime.rollout.rm_hub: `async_rm` and `batched_async_rm` with slime's rm types, on slimish's graders
(slimish.rollout.graders: math equivalence by math-verify).

`async_rm(args, sample)` calls the sample's or the run's custom rm (`custom_rm_path`, a user's
`slime:` reward function as slime names it) when there is one, else scores by `rm_type` (the
sample's `metadata["rm_type"]`, else `args.rm_type`, i.e. `rollout.args.rm_type`): `math`,
`deepscaler`, `dapo`, `f1`, `gpqa`, `random`, `remote_rm` (POST to `args.rm_url`), each also as
`boxed_TYPE` (scored on the last `\\boxed{}` of the response). `ifbench` is not provided.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from slime.utils.http_utils import post
from slime.utils.misc import load_function
from slime.utils.types import Sample

from .deepscaler import get_deepscaler_rule_based_reward
from .f1 import f1_score
from .gpqa import compute_gpqa_reward
from .math_dapo_utils import compute_score as compute_score_dapo
from .math_utils import extract_answer as extract_boxed_answer
from .math_utils import grade_answer_verl


async def remote_rm(args: Any, sample: Sample, max_retries: int = 10) -> Any:
    """The reward a remote server (`args.rm_url`) gives for {prompt, response, label}."""
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    return await post(args.rm_url, payload, max_retries=max_retries)


RULES: dict[str, Callable[[str, Any, dict], Any]] = {
    "deepscaler": lambda response, label, metadata: get_deepscaler_rule_based_reward(response, label),
    "dapo": lambda response, label, metadata: compute_score_dapo(response, label),
    "math": lambda response, label, metadata: 1 if grade_answer_verl(response, label) else 0,
    "f1": lambda response, label, metadata: f1_score(response, label)[0],
    "gpqa": lambda response, label, metadata: compute_gpqa_reward(response, label, metadata=metadata),
    "random": lambda response, label, metadata: random.randint(0, 1),
}


async def async_rm(args: Any, sample: Sample, **kwargs: Any) -> Any:
    """One sample's reward: its custom rm, the run's, or the rule `rm_type` names."""
    custom = getattr(sample, "custom_rm_path", None) or args.custom_rm_path
    if custom is not None:
        return await load_function(custom)(args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or args.rm_type or "").strip()
    response = sample.response
    if rm_type.startswith("boxed_"):
        response = extract_boxed_answer(response) or ""
        rm_type = rm_type.removeprefix("boxed_")
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type in RULES:
        return RULES[rm_type](response, sample.label, metadata)
    if rm_type:
        raise NotImplementedError(
            f"rm_type {rm_type!r} is not provided by slimish's slime rm_hub (it has: {', '.join([*RULES, 'remote_rm'])})"
        )
    raise NotImplementedError(
        "no rm_type: set rollout.args.rm_type (math, deepscaler, dapo, f1, gpqa, random, remote_rm) or a reward function"
    )


async def batched_async_rm(args: Any, samples: list[Sample], **kwargs: Any) -> list[Any]:
    """The rewards of `samples`: the run's custom rm over all of them at once (slime's group rm),
    else `async_rm` on each."""
    if args.custom_rm_path is not None:
        return await load_function(args.custom_rm_path)(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))


__all__ = [
    "async_rm",
    "batched_async_rm",
    "compute_gpqa_reward",
    "compute_score_dapo",
    "extract_boxed_answer",
    "f1_score",
    "get_deepscaler_rule_based_reward",
    "grade_answer_verl",
    "remote_rm",
]
