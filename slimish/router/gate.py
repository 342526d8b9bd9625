"""What the router checks and reads in a request before forwarding it.

Keys, the body size limit, the prompt length and the `max_new_tokens` cap, each failing with a
4xx that names the limit; and the prompt, for cache_aware. The body itself is forwarded as received, except when
the cap has to be filled in.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request

from slimish.formats.openai import CompletionRequest
from slimish.protocol import SamplingParams
from slimish.router import wire
from slimish.router.proxy import RouterError

GENERATE_DEFAULT_MAX_NEW_TOKENS: int = SamplingParams.model_fields["max_new_tokens"].default
COMPLETIONS_DEFAULT_MAX_TOKENS: int = CompletionRequest.model_fields["max_tokens"].default


def check_key(request: Request | wire.ClientRequest, key: str | None, flag: str) -> None:
    if key is None:
        return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
        what = "missing" if not got else "wrong"
        raise RouterError(401, f"{what} key: this route needs 'Authorization: Bearer <key>' with the router's {flag}")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RouterError(
            413, f"request body is {declared} bytes; the router accepts at most {limit} (--max-body-bytes)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds {limit} bytes, the router's limit (--max-body-bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise RouterError(400, f"request body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise RouterError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    return payload


def apply_cap(route: str, payload: dict[str, Any], cap: int) -> bool:
    """Reject a request asking for more than `cap` new tokens; fill in `cap` where it asks for
    no bound or its default is larger. True when `payload` was changed (re-serialise it)."""
    if route == "/generate":
        params = payload.get("sampling_params")
        if params is None:
            if GENERATE_DEFAULT_MAX_NEW_TOKENS <= cap:
                return False
            params = payload["sampling_params"] = {}
        items = params if isinstance(params, list) else [params]
        changed = False
        for i, item in enumerate(items):
            where = (
                f"sampling_params[{i}].max_new_tokens" if isinstance(params, list) else "sampling_params.max_new_tokens"
            )
            if isinstance(item, dict):
                changed |= _cap_field(item, "max_new_tokens", GENERATE_DEFAULT_MAX_NEW_TOKENS, cap, where)
        return changed
    if route == "/v1/completions":
        return _cap_field(payload, "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, cap, "max_tokens")
    if route == "/v1/chat/completions":
        explicit = [k for k in ("max_completion_tokens", "max_tokens") if payload.get(k) is not None]
        for k in explicit:
            _cap_field(payload, k, None, cap, k)
        if not explicit:
            payload["max_tokens"] = cap
        return not explicit
    return False


def _cap_field(obj: dict[str, Any], key: str, default: int | None, cap: int, where: str) -> bool:
    value = obj.get(key)
    if value is None:
        if default is None or default > cap:
            obj[key] = cap
            return True
        return False
    if isinstance(value, int) and not isinstance(value, bool) and value > cap:
        raise RouterError(400, f"{where} is {value}; this router allows at most {cap} (--max-new-tokens-cap)")
    return False


def check_prompt_length(route: str, payload: dict[str, Any], cap: int) -> None:
    """Refuse token-id prompts longer than `cap` (text is left to the engines, which tokenize)."""
    prompt = payload.get("prompt") if route == "/v1/completions" else payload.get("input_ids")
    if route == "/v1/chat/completions" or not isinstance(prompt, list):
        return
    field = "prompt" if route == "/v1/completions" else "input_ids"
    is_batch = bool(prompt) and isinstance(prompt[0], list)
    for i, ids in enumerate(prompt if is_batch else [prompt]):
        if isinstance(ids, list) and len(ids) > cap:
            where = f"{field}[{i}]" if is_batch else field
            raise RouterError(
                400, f"{where} has {len(ids)} tokens; this router accepts at most {cap} (--max-prompt-tokens)"
            )


def prompt_of(route: str, payload: dict[str, Any]) -> str | list[int] | None:
    """The (first) prompt as text or token ids; None when there is none to key a cache on."""
    if route == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(
            f"{m.get('role')}\x00{m['content'] if isinstance(m.get('content'), str) else json.dumps(m.get('content'))}\x01"
            for m in messages
            if isinstance(m, dict)
        )
    if route == "/v1/completions":
        prompt = payload.get("prompt")
    else:
        prompt = payload.get("text") if payload.get("text") is not None else payload.get("input_ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch: key on its first prompt
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return prompt
    return None
