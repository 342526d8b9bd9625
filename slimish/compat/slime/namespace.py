"""What slime code finds around it: the `slime` package it imports, its `args` and its sampling params.

The names slime code imports (`slime.utils.types.Sample`, `slime.utils.http_utils.post`,
`slime.rollout.sglang_rollout.GenerateState` / `generate`, `slime.rollout.filter_hub...`) come
from `slimish/compat/slime_namespace/`, put on `sys.path` when the first `slime:` spec is loaded
and no real `slime` is importable. With a real slime installed its modules are used, its `post`
and `get` replaced by slimish's (`slimish.compat.slime.calls`: recording and headers need them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slimish.compat.slime.calls import get, post

log = logging.getLogger(__name__)

NAMESPACE_DIR = Path(__file__).resolve().parents[1] / "slime_namespace"


def use_slime_namespace() -> str:
    """Make `import slime...` work: slimish's stand-in (`slime_namespace/`) goes on sys.path when
    no real slime is importable; a real one gets slimish's `post` and `get`. Returns which."""
    if str(NAMESPACE_DIR) in sys.path:
        return "slimish"
    loaded = sys.modules.get("slime")
    if loaded is None and importlib.util.find_spec("slime") is None:
        sys.path.append(str(NAMESPACE_DIR))
        importlib.invalidate_caches()
        return "slimish"
    try:  # a real slime: its HTTP helpers need its own client set up by its trainer; ours replace them
        http_utils = importlib.import_module("slime.utils.http_utils")
        http_utils.post, http_utils.get = post, get  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 (a slime that cannot be imported fails at the user's import, with its own error)
        log.warning("slime is installed but slime.utils.http_utils could not be patched: %s", exc)
    return "installed"


def slime_sample_class() -> type:
    use_slime_namespace()
    from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]

    return SlimeSample


# ---- slime's arguments ------------------------------------------------------------------------


# slime's own defaults (slime/utils/arguments.py) for arguments its examples and rollout code read
# that have no slimish counterpart: a slime function reads them as slime would hand them over.
SLIME_DEFAULTS: dict[str, Any] = dict(
    rollout_max_context_len=None,
    rollout_max_prompt_len=None,
    eval_max_context_len=None,
    eval_max_prompt_len=None,
    eval_max_response_len=None,
    eval_temperature=None,
    eval_top_p=None,
    eval_top_k=None,
    eval_reward_key=None,
    context_parallel_size=1,
    max_tokens_per_gpu=None,
    over_sampling_batch_size=None,
    rollout_global_dataset=True,
    rollout_sample_filter_path=None,
    rollout_all_samples_process_path=None,
    rollout_interaction_env_path=None,
    multimodal_keys=None,
    sglang_model_routers=None,
    loss_mask_type="qwen",
    save_path=None,
)

_warned_args: set[str] = set()


class SlimeArgs(argparse.Namespace):
    """slime's `args`: the values slimish maps, slime's defaults for the rest it knows
    (`SLIME_DEFAULTS`), then every `rollout.args` entry. Reading an argument that is none of
    these warns once per name, saying how to set it, and gives None (most slime defaults are)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in _warned_args:
            _warned_args.add(name)
            log.warning(
                "slime argument args.%s is not mapped by slimish and has no known slime default: it reads as None; "
                "set it as rollout.args.%s=VALUE (every rollout.args entry becomes an attribute of args)",
                name,
                name,
            )
        return None


# `slime:` spec -> slime's dotted path of the function it loaded (`remember_slime_path`).
_SLIME_PATHS: dict[str, str | None] = {}


def slime_dotted(fn: Any, name: str) -> str | None:
    """`fn` as slime names a function (`module.function`, what slime's `load_function` imports);
    None for slime's own functions, which are its defaults there: `async_rm` or `generate_and_rm`
    named by `custom_rm_path` or `custom_generate_function_path` would call themselves."""
    module = getattr(fn, "__module__", None) or ""
    if not module or module == "slime" or module.startswith("slime."):
        return None
    return f"{module}.{name}"


def remember_slime_path(spec: str, fn: Any, name: str) -> None:
    """Record `spec`'s function as slime names it (`slime_dotted`), for `custom_rm_path` and the like."""
    _SLIME_PATHS[spec] = slime_dotted(fn, name)


def slime_path(spec: str | None) -> str | None:
    """What slime's `args.custom_rm_path` (and the like) holds for a run's function spec: the
    dotted path of a user's `slime:` function, else None (a slimish function takes other
    arguments; slime's own are its defaults)."""
    return _SLIME_PATHS.get(spec) if spec else None


def slime_args(ctx: Any, group_rm: bool = False) -> SlimeArgs:
    """The `args` a slime function reads, from the run config (`ctx.config`) and `ctx.args`."""
    cfg = ctx.config
    r = cfg.rollout
    base = urlsplit(ctx.client.base_url)
    values: dict[str, Any] = dict(SLIME_DEFAULTS)
    values.update(
        sglang_router_ip=base.hostname,
        sglang_router_port=base.port or {"http": 80, "https": 443}.get(base.scheme),
        hf_checkpoint=cfg.model,
        rollout_max_response_len=r.max_new_tokens,
        rollout_temperature=r.temperature,
        rollout_top_p=r.top_p,
        rollout_top_k=r.top_k,
        rollout_stop=list(r.stop) or None,
        rollout_stop_token_ids=None,
        rollout_skip_special_tokens=False,
        rollout_seed=getattr(cfg, "seed", 0),
        n_samples_per_prompt=r.n_samples_per_prompt,
        rollout_batch_size=r.rollout_batch_size,
        apply_chat_template=cfg.data.apply_chat_template,
        apply_chat_template_kwargs=dict(r.chat_template_kwargs),
        reward_key=r.reward_key,
        group_rm=group_rm,
        partial_rollout=False,  # slimish restarts a cut-off slime sample from its prompt
        mask_offpolicy_in_partial_rollout=False,
        ci_test=False,
        use_rollout_routing_replay=False,
        sglang_speculative_algorithm=None,
        sglang_enable_deterministic_inference=False,
        sglang_dp_size=None,
        sglang_server_concurrency=r.max_concurrency,
        router_policy=None,
        custom_generate_function_path=slime_path(r.rollout_fn),
        custom_rm_path=slime_path(r.reward_fn),
        dynamic_sampling_filter_path=slime_path(r.filter_fn),
        rm_type=None,
        rm_url=None,
    )
    values.update(ctx.args)
    return SlimeArgs(**values)


def slime_sampling_params(ctx: Any) -> dict[str, Any]:
    """slime's per-call sampling params (`GenerateState.sampling_params`) from the context's."""
    params = dict(ctx.sampling_params)
    params.setdefault("stop", None)
    params.setdefault("stop_token_ids", None)
    params.setdefault("skip_special_tokens", False)
    params.setdefault("spaces_between_special_tokens", False)
    params["no_stop_trim"] = True
    return params
