"""One slime function call as slimish runs it: `post` and `get` as slime.utils.http_utils has them,
and the record of the call's `/generate` replies.

While an adapter runs a slime function it sets the call (`running`); the function's `post` to the
router then goes through the run's client with the sample's routing key, and each `/generate`
reply is recorded for the sample (`Call.replies`), with the ids the engine conditioned on. Re-sent
text the engine tokenises differently from the ids the function held is counted
(`Call.mismatches`) and warned about once per process.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from slimish.protocol import ROUTING_KEY_HEADER, reshapes, version_number

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """One `/generate` reply as the engine served it."""

    input_ids: list[int] | None  # what the engine was conditioned on (for text: its tokenization)
    output_ids: list[int]
    logprobs: list[float] | None  # one per output id; None when the reply had none
    versions: list[int]  # per output id
    finish_reason: str
    reshaped: bool = False  # its request's sampling reshaped the distribution (`protocol.reshapes`)


@dataclass
class Call:
    """What `post` needs while a slime function runs for one slimish context."""

    ctx: Any
    sample: Any | None = None  # the slime Sample handed to the function (rollout calls)
    record: bool = False  # keep the /generate replies (rollout calls only)
    replies: list[Reply] = field(default_factory=list)
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
        params = body.get("sampling_params") or {}
        reshaped = any(reshapes(p) for p in (params if isinstance(params, list) else [params]) if isinstance(p, dict))
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
            self.replies.append(_parse_reply(item, engine_ids, reshaped))

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


def _parse_reply(item: dict[str, Any], input_ids: list[int] | None, reshaped: bool) -> Reply:
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
    return Reply(input_ids, output_ids, logprobs, versions, finish_type, reshaped)


_CALL: contextvars.ContextVar[Call | None] = contextvars.ContextVar("slimish_slime_call", default=None)
_warned = False


def current_context() -> Any | None:
    """The slimish RolloutContext the running slime function was called for (None outside one)."""
    call = _CALL.get()
    return call.ctx if call is not None else None


@contextlib.contextmanager
def running(call: Call) -> Iterator[Call]:
    """`post` and `get` serve `call` (its context, its record) while the slime function runs."""
    token = _CALL.set(call)
    try:
        yield call
    finally:
        _CALL.reset(token)


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
