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
    except Exception as exc:  # noqa: BLE001: a slime that cannot be imported fails at the user's import, with its own error
        log.warning("slime is installed but slime.utils.http_utils could not be patched: %s", exc)
    return "installed"


def slime_sample_class() -> type:
    use_slime_namespace()
    from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]

    return SlimeSample


# ---- slime's arguments ------------------------------------------------------------------------


class SlimeArgs(argparse.Namespace):
    """slime's `args`: the values slimish maps, then every `rollout.args` entry; reading one that
    is neither says how to provide it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"slime argument args.{name} is not mapped by slimish; set it as rollout.args.{name}=VALUE "
            "(every rollout.args entry becomes an attribute of args)"
        )


def slime_args(ctx: Any, group_rm: bool = False) -> SlimeArgs:
    """The `args` a slime function reads, from the run config (`ctx.config`) and `ctx.args`."""
    cfg = ctx.config
    r = cfg.rollout
    base = urlsplit(ctx.client.base_url)
    values: dict[str, Any] = dict(
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
        custom_generate_function_path=r.rollout_fn,
        custom_rm_path=r.reward_fn,
        dynamic_sampling_filter_path=r.filter_fn,
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
