"""slime's custom functions, unchanged, as slimish rollout, reward and filter functions.

A spec `slime:module:function` (or `slime:path/to/file.py:function`) names a function written in
slime's signatures (github THUDM/slime, `--custom-generate-function-path`, `--custom-rm-path`,
`--dynamic-sampling-filter-path`); `load_slime_function` imports it and returns a function in
slimish's shape:

- rollout: `async def generate(args, sample, sampling_params[, evaluation])` becomes
  `async def fn(ctx, sample)`. The slime function gets a slime `Sample` made from slimish's
  (prompt rendered to text by the chat template, as slime's data loader does with
  `--apply-chat-template`; label; metadata; `index`; `group_index` = slimish `group_id`), an
  `argparse.Namespace` of the slime arguments such code reads (`slime_args`) and slime-style
  sampling params. It posts to the router itself with `slime.utils.http_utils.post`; this
  module's `post` records every `/generate` reply of the call (a contextvar the wrapper sets),
  and when the function returns its bookkeeping is copied back into the slimish sample
  (`_copy_back`): tokens, loss mask (all ones when it set none, as in slime), logprobs (its
  own, else the recorded replies'), per-token weight versions from the replies, status, reward,
  metadata.
- reward: `async def rm(args, sample)` becomes `async def fn(ctx, sample)`; a group rm
  (slime's `--group-rm`), recognised by its second parameter being named `samples` (or annotated
  as a list), becomes `@group_reward async def fn(ctx, samples)`. The load happens before any
  config is read, so the parameter name decides; `rollout.args.group_rm: true` with a per-sample
  rm fails its samples with a message saying to rename the parameter.
- filter: `def f(args, samples, **kwargs) -> DynamicFilterOutput | bool` becomes
  `def fn(ctx, group) -> str | None` (the reason, or f"slime filter {name}" when it gave none).

The names slime code imports (`slime.utils.types.Sample`, `slime.utils.http_utils.post`,
`slime.rollout.sglang_rollout.GenerateState` / `generate`, `slime.rollout.filter_hub...`) come
from `slime_namespace/`, put on `sys.path` when the first `slime:` spec is loaded and no real
`slime` is importable. With a real slime installed its modules are used, its `post` and `get`
replaced by this module's (recording and headers need them).

Re-sent text: a slime function that posts `text` (as slime's search-r1 example does) lets the
engine re-tokenise the model's earlier output; where that differs from the ids it held, the
sample's `metadata["retokenized_mismatch"]` counts the call (a warning is logged once per process).
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import copy
import importlib
import importlib.util
import inspect
import json
import logging
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slimish.protocol import ROUTING_KEY_HEADER, version_number
from slimish.rollout.loader import Kind, LoadError, check_shape, find_function
from slimish.rollout.rewards import group_reward
from slimish.types import Sample, SampleStatus, status_of

log = logging.getLogger(__name__)

NAMESPACE_DIR = Path(__file__).resolve().with_name("slime_namespace")
PREFIX = "slime:"

# The shapes slime documents for each kind slimish can adapt.
SLIME_KINDS: dict[str, Kind] = {
    "rollout": Kind("--rollout-fn", (("args", "sample", "sampling_params"),), True),
    "reward": Kind("--reward-fn", (("args", "sample"),), True),
    "group_reward": Kind("--reward-fn", (("args", "samples"),), True),
    "filter": Kind("--filter-fn", (("args", "samples"),)),
}


# ---- loading ----------------------------------------------------------------------------------


def load_slime_function(spec: str, kind: str, flag: str) -> Callable[..., Any]:
    """The slime function `spec` (without the `slime:` prefix) names, adapted to slimish's `kind`."""
    shown = PREFIX + spec
    if kind not in ("rollout", "reward", "filter"):
        raise LoadError(
            f"{flag} {shown!r}: a `slime:` spec names a slime custom generate, reward (rm) or dynamic-sampling "
            f"filter function; {flag} takes a slimish function: drop the `slime:` prefix"
        )
    use_slime_namespace()
    fn, name = find_function(spec, flag, shown)
    if kind == "reward" and is_group_rm(fn):
        kind = "group_reward"
    check_shape(flag, shown, name, fn, SLIME_KINDS[kind])
    if kind == "rollout":
        return _rollout_fn(fn, name)
    if kind == "reward":
        return _reward_fn(fn, name)
    if kind == "group_reward":
        return _group_reward_fn(fn, name)
    return _filter_fn(fn, name)


def is_group_rm(fn: Callable[..., Any]) -> bool:
    """A slime rm over a whole group (`--group-rm`): its second parameter is named `samples`, or
    is annotated as a list."""
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    if len(params) < 2:
        return False
    second = params[1]
    annotation = second.annotation if isinstance(second.annotation, str) else repr(second.annotation)
    return second.name == "samples" or annotation.replace("typing.", "").lower().startswith("list")


def use_slime_namespace() -> str:
    """Make `import slime...` work: slimish's stand-in (`slime_namespace/`) goes on sys.path when
    no real slime is importable; a real one gets this module's `post` and `get`. Returns which."""
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


def _slime_sample_class() -> type:
    use_slime_namespace()
    from slime.utils.types import Sample as SlimeSample  # type: ignore[import-not-found]

    return SlimeSample


# ---- one call's record ------------------------------------------------------------------------


@dataclass
class _Reply:
    """One `/generate` reply as the engine served it."""

    input_ids: list[int] | None  # what the engine was conditioned on (for text: its tokenization)
    output_ids: list[int]
    logprobs: list[float] | None  # one per output id; None when the reply had none
    versions: list[int]  # per output id
    finish_reason: str


@dataclass
class _Call:
    """What `post` needs while a slime function runs for one slimish context."""

    ctx: Any
    sample: Any | None = None  # the slime Sample handed to the function (rollout calls)
    record: bool = False  # keep the /generate replies (rollout calls only)
    replies: list[_Reply] = field(default_factory=list)
    mismatches: int = 0  # /generate calls whose re-sent text the engine tokenized differently

    def observe(self, body: dict[str, Any], reply: Any) -> None:
        items = reply if isinstance(reply, list) else [reply]
        inputs: list[Any]
        if body.get("input_ids") is not None:
            ids = body["input_ids"]
            inputs = ids if ids and isinstance(ids[0], list) else [ids]
        elif body.get("text") is not None:
            inputs = body["text"] if isinstance(body["text"], list) else [body["text"]]
        else:
            inputs = []
        for i, item in enumerate(items):
            if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
                continue
            given = inputs[i] if i < len(inputs) and len(inputs) == len(items) else None
            meta = item["meta_info"]
            engine_ids = (
                self._engine_ids(given, meta)
                if isinstance(given, str)
                else (list(given) if given is not None else None)
            )
            self.replies.append(_parse_reply(item, engine_ids))

    def _engine_ids(self, text: str, meta: dict[str, Any]) -> list[int]:
        """The ids the engine made of re-sent text (its tokenizer, as the engine calls it), and
        whether they differ from the ids the function held: its sample's tokens, or the last
        reply's prompt and output."""
        tok = self.ctx.tokenizer
        ids = tok.encode(text)
        if meta.get("prompt_tokens") not in (None, len(ids)):
            plain = tok.encode(text, add_special_tokens=False)
            ids = plain if len(plain) == meta["prompt_tokens"] else ids
        last = self.replies[-1] if self.replies else None
        chain = last.input_ids + last.output_ids if last is not None and last.input_ids is not None else []
        own = [int(t) for t in (getattr(self.sample, "tokens", None) or [])]
        held = own if len(own) > len(chain) and own[: len(chain)] == chain else (chain or own)
        n = min(len(held), len(ids))
        if held and ids[:n] != held[:n]:
            self.mismatches += 1
            _warn_retokenized(n, held, ids)
        return ids


def _parse_reply(item: dict[str, Any], input_ids: list[int] | None) -> _Reply:
    meta = item["meta_info"]
    pairs = meta.get("output_token_logprobs") or []
    output_ids = (
        [int(t) for t in item["output_ids"]] if item.get("output_ids") is not None else [int(p[1]) for p in pairs]
    )
    logprobs = [float(p[0]) for p in pairs] if len(pairs) == len(output_ids) else None
    versions = [version_number(meta.get("weight_version", "default"))] * len(output_ids)
    spans = meta.get("weight_versions") or []
    per_token = [version_number(s["version"]) for s in spans for _ in range(s["end"] - s["start"])]
    if len(per_token) == len(output_ids):
        versions = per_token
    finish = meta.get("finish_reason")
    finish_type = finish.get("type", "abort") if isinstance(finish, dict) else "abort"
    return _Reply(input_ids, output_ids, logprobs, versions, finish_type)


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("slimish_slime_call", default=None)
_warned = False


def current_context() -> Any | None:
    """The slimish RolloutContext the running slime function was called for (None outside one)."""
    call = _CALL.get()
    return call.ctx if call is not None else None


def _warn_retokenized(n: int, held: list[int], ids: list[int]) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    at = next((i for i in range(n) if held[i] != ids[i]), n)
    message = (
        f"a slime function re-sent text to /generate whose tokenization differs from the ids it held (first at "
        f"token {at}): the engine conditions on other ids than the sample trains on. Counted per sample in "
        "metadata['retokenized_mismatch'] (metric rollout/retokenized_mismatch); send `input_ids` to avoid it. "
        "Warned once per process."
    )
    log.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


# ---- HTTP, as slime.utils.http_utils ----------------------------------------------------------


async def post(
    url: str, payload: Any = None, max_retries: int = 60, headers: dict[str, str] | None = None, **_: Any
) -> Any:
    """slime's `post`: POST `payload` as JSON, the reply's JSON (its text when not JSON). Inside a
    slime function run by slimish, a request to the router goes through the run's client with
    the sample's routing key (`X-SMG-Routing-Key`) and the router's API key, `/generate` always
    asks for logprobs and its reply is recorded for the sample; once the step is ending
    (abort), `/generate` returns an aborted reply without calling the engine."""
    call = _CALL.get()
    path = _router_path(call.ctx, url) if call is not None else None
    if call is None or path is None:
        return await _plain("POST", url, payload, headers, max_retries)
    body = dict(payload or {})
    is_generate = path.split("?")[0].rstrip("/") == "/generate"
    if is_generate:
        body["return_logprob"] = True
        if call.ctx.aborting:
            return _aborted_reply(body)
    reply = await _routed(call.ctx, "POST", path, body, headers, max_retries)
    if is_generate and call.record:
        call.observe(body, reply)
    return reply


async def get(url: str, headers: dict[str, str] | None = None, **_: Any) -> Any:
    """slime's `get`: the reply's JSON (the router's with its API key)."""
    call = _CALL.get()
    path = _router_path(call.ctx, url) if call is not None else None
    if call is None or path is None:
        return await _plain("GET", url, None, headers, 1)
    return await _routed(call.ctx, "GET", path, None, headers, 1)


def _router_path(ctx: Any, url: str) -> str | None:
    """`url`'s path (and query) when it points at the run's router, else None."""
    base, target = urlsplit(ctx.client.base_url), urlsplit(url)

    def origin(u: Any) -> tuple[str, str | None, int | None]:
        return (u.scheme, u.hostname, u.port or {"http": 80, "https": 443}.get(u.scheme))

    prefix = base.path.rstrip("/")
    if origin(base) != origin(target) or not target.path.startswith(prefix):
        return None
    return target.path[len(prefix) :] + (f"?{target.query}" if target.query else "")


async def _routed(ctx: Any, method: str, path: str, body: Any, headers: dict[str, str] | None, max_retries: int) -> Any:
    """A router request on the run's client; unreachable or 5xx replies are retried (1 s apart,
    `max_retries` tries in all), as slime's post does."""
    from slimish.client import ServerError

    sent = {ROUTING_KEY_HEADER: ctx.routing_key, **(headers or {})}  # the run's client sends the API key
    for attempt in range(1, max(1, max_retries) + 1):
        try:
            return await ctx.client.request(method, path, body, headers=sent)
        except ServerError as exc:
            if (exc.status and exc.status < 500) or attempt >= max_retries:
                raise
            log.info("slime post %s: %s; retrying (%d/%d)", path, exc, attempt, max_retries)
            await asyncio.sleep(1.0)


async def _plain(method: str, url: str, body: Any, headers: dict[str, str] | None, max_retries: int) -> Any:
    """Any other server: one aiohttp session per call, retried as slime does."""
    import aiohttp

    for attempt in range(1, max(1, max_retries) + 1):
        try:
            async with aiohttp.ClientSession() as session:
                async with session.request(method, url, json=body if method != "GET" else None, headers=headers) as r:
                    r.raise_for_status()
                    raw = await r.read()
            try:
                return json.loads(raw)
            except ValueError:
                return raw.decode(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            if attempt >= max_retries:
                raise
            log.info("slime post %s: %s; retrying (%d/%d)", url, exc, attempt, max_retries)
            await asyncio.sleep(1.0)


def _aborted_reply(body: dict[str, Any]) -> dict[str, Any]:
    prompt = body.get("input_ids") or body.get("text") or ""
    meta = {
        "id": "",
        "finish_reason": {"type": "abort", "message": "the rollout step is ending"},
        "prompt_tokens": len(prompt),
        "completion_tokens": 0,
        "output_token_logprobs": [],
    }
    return {"text": "", "output_ids": [], "meta_info": meta}


# ---- slime's arguments and samples ------------------------------------------------------------


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


def prompt_text(ctx: Any, prompt: Any) -> Any:
    """A slimish prompt as slime's data loader hands it on: chat messages rendered to text by the
    tokenizer's chat template (with the generation prompt and `rollout.chat_template_kwargs`)."""
    if isinstance(prompt, list):
        kwargs = dict(ctx.config.rollout.chat_template_kwargs)
        return ctx.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
    return prompt


def to_slime(ctx: Any, sample: Sample, fresh: bool = False) -> Any:
    """A slime Sample of a slimish one: only its prompt side when `fresh` (a rollout's input),
    else with its response, reward and status (what an rm or a filter reads). Its metadata is
    the slimish sample's own dict for rm and filters (what they write into it stays)."""
    S = _slime_sample_class()
    out = S(
        group_index=sample.group_id,
        index=sample.index,
        prompt=prompt_text(ctx, sample.prompt),
        label=sample.label,
        metadata=copy.deepcopy(sample.metadata) if fresh else sample.metadata,
    )
    out.session_id = ctx.routing_key
    if fresh:
        return out
    out.tokens = list(sample.tokens)
    out.response = sample.response
    out.response_length = sample.response_length
    out.loss_mask = list(sample.loss_mask)
    out.rollout_log_probs = list(sample.rollout_logprobs)
    out.reward = copy.deepcopy(sample.reward)
    out.weight_versions = [str(v) for v in sample.weight_versions]
    value = "failed" if sample.status == SampleStatus.INFRA_FAILED else sample.status.value
    out.status = S.Status(value)
    return out


# ---- the adapters -----------------------------------------------------------------------------


def _named(wrapper: Callable[..., Any], fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """Name the adapter after the slime function (no `__wrapped__`: its signature is slimish's)."""
    wrapper.__name__ = wrapper.__qualname__ = getattr(fn, "__name__", name)
    wrapper.__module__ = getattr(fn, "__module__", wrapper.__module__)
    wrapper.__doc__ = getattr(fn, "__doc__", None)
    wrapper.__slime_function__ = fn  # type: ignore[attr-defined]
    return wrapper


def _rollout_fn(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    try:
        takes_evaluation = "evaluation" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_evaluation = False

    async def rollout(ctx: Any, sample: Sample) -> Sample | list[Sample]:
        ctx.resumable = False  # a cut-off slime sample restarts from its prompt
        given = to_slime(ctx, sample, fresh=True)
        call = _Call(ctx, given, record=True)
        args, params = slime_args(ctx), slime_sampling_params(ctx)
        token = _CALL.set(call)
        try:
            if takes_evaluation:
                out = await fn(args, given, params, evaluation=bool(sample.metadata.get("eval")))
            else:
                out = await fn(args, given, params)
        finally:
            _CALL.reset(token)
        outs = out if isinstance(out, list) else [out]
        S = _slime_sample_class()
        if not outs or not all(isinstance(o, S) for o in outs):
            raise TypeError(
                f"the slime function {name} returned {type(out).__name__}; expected a slime Sample or a "
                "non-empty list of them (slime.utils.types.Sample)"
            )
        results = []
        for o in outs:
            target = (
                sample
                if o is given
                else Sample(
                    prompt=copy.deepcopy(sample.prompt),
                    label=sample.label,
                    group_id=sample.group_id,
                    index=sample.index,
                    trajectory_id=sample.trajectory_id,
                    metadata=copy.deepcopy(sample.metadata),
                )
            )
            _copy_back(ctx, o, target, call.replies, name)
            results.append(target)
        counted = next((s for s in results if s is sample), results[0])
        counted.metadata["retokenized_mismatch"] = call.mismatches
        return results if isinstance(out, list) else results[0]

    return _named(rollout, fn, name)


def _reward_fn(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    async def reward(ctx: Any, sample: Sample) -> Any:
        if ctx.args.get("group_rm"):
            raise ValueError(
                f"rollout.args.group_rm is set but the slime rm {name} takes one sample; name its second "
                "parameter `samples` to have it called with the whole group"
            )
        token = _CALL.set(_Call(ctx))
        try:
            return _reward_value(await fn(slime_args(ctx), to_slime(ctx, sample)))
        finally:
            _CALL.reset(token)

    return _named(reward, fn, name)


def _group_reward_fn(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    async def reward(ctx: Any, samples: list[Sample]) -> list[Any]:
        token = _CALL.set(_Call(ctx))
        try:
            rewards = await fn(slime_args(ctx, group_rm=True), [to_slime(ctx, s) for s in samples])
        finally:
            _CALL.reset(token)
        if hasattr(rewards, "tolist"):
            rewards = rewards.tolist()
        if not isinstance(rewards, (list, tuple)):
            raise TypeError(
                f"the slime group rm {name} returned {type(rewards).__name__}; expected a list with one reward per sample"
            )
        return [_reward_value(r) for r in rewards]

    return group_reward(_named(reward, fn, name))


def _filter_fn(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(fn):

        async def async_filter(ctx: Any, group: list[Sample]) -> str | None:
            return _drop_reason(await fn(slime_args(ctx), [to_slime(ctx, s) for s in group]), name)

        return _named(async_filter, fn, name)

    def keep_or_drop(ctx: Any, group: list[Sample]) -> str | None:
        return _drop_reason(fn(slime_args(ctx), [to_slime(ctx, s) for s in group]), name)

    return _named(keep_or_drop, fn, name)


def _drop_reason(out: Any, name: str) -> str | None:
    """A slime filter's answer as slimish's: None keeps, a string is why the group is dropped.
    `DynamicFilterOutput` (slimish's or slime's own) or, as older slime filters return, a bool."""
    keep = getattr(out, "keep", out)
    if bool(keep):
        return None
    reason = getattr(out, "reason", None)
    return str(reason) if reason else f"slime filter {name}"


def _reward_value(value: Any) -> Any:
    """Numbers (a 0-d tensor, numpy scalar, int, bool) as floats; dicts and the rest as given."""
    if isinstance(value, dict) or isinstance(value, str):
        return value
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return float(value)
    return value


# ---- copying a slime sample back --------------------------------------------------------------


def _copy_back(ctx: Any, done: Any, target: Sample, replies: list[_Reply], name: str) -> None:
    """The slime function's sample into `target`: its tokens and masks where it kept them (else
    the recorded replies, chained), logprobs (its own, else the replies'), per-token versions
    from the replies, status, reward, metadata."""
    where = f"the slime function {name} (sample {target.group_id}/{target.index})"
    tokens = [int(t) for t in (done.tokens or [])]
    length = int(done.response_length or 0)
    mask = None if done.loss_mask is None else [int(m) for m in done.loss_mask]
    logprobs = None if done.rollout_log_probs is None else [float(x) for x in done.rollout_log_probs]
    if length == 0 and any(r.output_ids for r in replies):  # it kept no bookkeeping: the engine's replies
        tokens, length, mask, logprobs = _chain(where, replies)
    if not tokens:
        tokens = (
            ctx.tokenizer.encode(done.prompt, add_special_tokens=False)
            if isinstance(done.prompt, str)
            else ctx.prompt_ids(done.prompt)
        )
    if not 0 <= length <= len(tokens):
        raise ValueError(f"{where}: response_length {length} outside 0..{len(tokens)} (len(sample.tokens))")
    if mask is None:
        mask = [1] * length  # slime's default: every response token is trained on
    if len(mask) != length or any(m not in (0, 1) for m in mask):
        raise ValueError(
            f"{where}: loss_mask must hold one 0/1 per response token ({length}), it has {len(mask)} entries"
        )
    response = tokens[len(tokens) - length :]
    matched_lp, versions = _match(response, mask, replies)
    if logprobs is None:
        missing = sum(1 for m, lp in zip(mask, matched_lp) if m and lp is None)
        if missing:
            raise ValueError(
                f"{where}: {missing} response tokens with loss_mask 1 are not output of any /generate reply and it "
                "set no rollout_log_probs; keep the engine's output ids, or set sample.rollout_log_probs"
            )
        logprobs = [lp if m and lp is not None else 0.0 for m, lp in zip(mask, matched_lp)]
    if len(logprobs) != length:
        raise ValueError(f"{where}: rollout_log_probs has {len(logprobs)} entries, response_length is {length}")
    target.tokens, target.response_length, target.loss_mask = tokens, length, mask
    target.rollout_logprobs = [lp if m else 0.0 for m, lp in zip(mask, logprobs)]
    versions = [v if m else -1 for m, v in zip(mask, versions)]
    target.token_versions = versions if any(v >= 0 for v in versions) else []
    ordered = [v for v in versions if v >= 0] or [v for r in replies for v in r.versions[:1]]
    if not ordered:
        ordered = [version_number(v) for v in getattr(done, "weight_versions", None) or []]
    target.weight_versions = [v for i, v in enumerate(ordered) if i == 0 or ordered[i - 1] != v]
    target.status, target.error = _status(where, done, replies), None
    if target.status == SampleStatus.FAILED:
        target.error = str(done.metadata.get("error") or f"{where} set Sample.Status.FAILED")
    if done.reward is not None:
        target.reward = _reward_value(done.reward)
    if getattr(done, "remove_sample", False):
        target.exclude_from_loss = True
    for key, value in (done.metadata or {}).items():
        target.metadata[key] = value if _is_json(value) else repr(value)
    target.check()


def _chain(where: str, replies: list[_Reply]) -> tuple[list[int], int, list[int], list[float] | None]:
    """A sample from the replies alone: the first prompt, then each reply's output (mask 1) after
    what its prompt added since the last (mask 0)."""
    first = next(r for r in replies if r.output_ids or r.input_ids)
    if first.input_ids is None:
        raise ValueError(
            f"{where}: kept no tokens and its /generate calls cannot be chained (batch requests); "
            "set sample.tokens, response_length and loss_mask"
        )
    tokens, mask, logprobs = list(first.input_ids), [], []
    prompt_length = len(tokens)
    for r in replies[replies.index(first) :]:
        if r.input_ids is None or r.input_ids[: len(tokens)] != tokens:
            raise ValueError(
                f"{where}: kept no tokens and its /generate calls do not extend one another; "
                "set sample.tokens, response_length and loss_mask"
            )
        env = r.input_ids[len(tokens) :]
        tokens += env + r.output_ids
        mask += [0] * len(env) + [1] * len(r.output_ids)
        logprobs += [0.0] * len(env) + (r.logprobs if r.logprobs is not None else [0.0] * len(r.output_ids))
    return tokens, len(tokens) - prompt_length, mask, logprobs


def _match(response: list[int], mask: list[int], replies: list[_Reply]) -> tuple[list[float | None], list[int]]:
    """Each reply's output ids found in order among the trained (mask 1) response tokens: their
    logprobs and versions there (None and -1 elsewhere)."""
    logprobs: list[float | None] = [None] * len(response)
    versions = [-1] * len(response)
    at = 0
    for r in replies:
        n = len(r.output_ids)
        if not n:
            continue
        j = _find(response, mask, r.output_ids, at)
        if j < 0:
            continue
        for k in range(n):
            logprobs[j + k] = r.logprobs[k] if r.logprobs is not None else None
            versions[j + k] = r.versions[k]
        at = j + n
    return logprobs, versions


def _find(response: list[int], mask: list[int], ids: list[int], start: int) -> int:
    """Where `ids` first occurs in `response` from `start` on, all of it trained (mask 1); -1 if nowhere."""
    n, first = len(ids), ids[0]
    j = start
    while True:
        try:
            j = response.index(first, j, len(response) - n + 1)
        except ValueError:
            return -1
        if response[j : j + n] == ids and all(mask[j : j + n]):
            return j
        j += 1


def _status(where: str, done: Any, replies: list[_Reply]) -> SampleStatus:
    """slime's status values are slimish's (its `PENDING`: the last reply's finish reason)."""
    value = str(getattr(done.status, "value", done.status)).lower()
    if value not in {s.value for s in SampleStatus}:
        raise ValueError(f"{where}: unknown status {done.status!r}")
    if value != SampleStatus.PENDING.value:
        return SampleStatus(value)
    if not replies:
        raise ValueError(f"{where}: returned a PENDING sample and made no /generate call; set sample.status")
    return (
        status_of(replies[-1].finish_reason)
        if replies[-1].finish_reason in ("stop", "length", "abort")
        else SampleStatus.ABORTED
    )


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
