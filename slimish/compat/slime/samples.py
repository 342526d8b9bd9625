"""slime `Sample`s made from slimish's and back.

An adapter hands the slime function a slime `Sample` of the slimish one (`to_slime`: the prompt
rendered to text by the chat template, as slime's data loader does with `--apply-chat-template`;
label; metadata; `index`; `group_index` = slimish `group_id`). When a generate function returns,
its bookkeeping is copied back into the slimish sample (`copy_back`): tokens, loss mask (all ones
when it set none, as in slime), logprobs (its own, else the recorded replies'), per-token weight
versions from the replies, status, reward, metadata.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from slimish.compat.slime.calls import Reply
from slimish.compat.slime.namespace import slime_sample_class
from slimish.protocol import version_number
from slimish.types import Sample, SampleStatus, spread_versions, status_of

SLIME_KEY = "slime"  # metadata key of the slime-only fields (`_slime_only`)


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
    S = slime_sample_class()
    out = S(
        group_index=sample.group_id,
        index=sample.index,
        prompt=prompt_text(ctx, sample.prompt),
        label=sample.label,
        metadata=copy.deepcopy(sample.metadata) if fresh else sample.metadata,
    )
    out.session_id = ctx.routing_key
    kept = sample.metadata.get(SLIME_KEY) or {}
    out.rollout_id = kept.get("rollout_id")
    out.multimodal_train_input_id = kept.get("multimodal_train_input_id")
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


def reward_value(value: Any) -> Any:
    """Numbers (a 0-d tensor, numpy scalar, int, bool) as floats; dicts and the rest as given."""
    if isinstance(value, (dict, str)):
        return value
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, (bool, int, float)):
        return float(value)
    return value


# ---- copying a slime sample back --------------------------------------------------------------


def copy_back(ctx: Any, done: Any, target: Sample, replies: list[Reply], name: str) -> None:
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
    if not any(v >= 0 for v in versions):  # no trained token is a reply's: the replies' versions, or slime's
        ordered = [v for r in replies for v in r.versions[:1]]
        ordered = ordered or [version_number(v) for v in getattr(done, "weight_versions", None) or []]
        versions = spread_versions(mask, ordered)
    target.token_versions = versions
    target.reshaped = any(r.reshaped for r in replies)  # pi_old from the trainer (docs/training.md)
    target.status, target.error = _status(where, done, replies), None
    if target.status == SampleStatus.FAILED:
        target.error = str(done.metadata.get("error") or f"{where} set Sample.Status.FAILED")
    if done.reward is not None:
        target.reward = reward_value(done.reward)
    if getattr(done, "remove_sample", False):
        target.exclude_from_loss = True
    for key, value in (done.metadata or {}).items():
        target.metadata[key] = value if _is_json(value) else repr(value)
    if slime_only := _slime_only(done):
        target.metadata[SLIME_KEY] = slime_only
    target.check()


def _slime_only(done: Any) -> dict[str, Any]:
    """The slime fields slimish's sample has no place for, where the function set them:
    `rollout_id` (slime's grouping of one execution's training samples), the multimodal cache
    id, and the speculative and prefix-cache counts of its replies."""
    kept: dict[str, Any] = {}
    for name in ("rollout_id", "multimodal_train_input_id"):
        if getattr(done, name, None) is not None:
            kept[name] = getattr(done, name)
    for name in ("spec_info", "prefix_cache_info"):
        info = getattr(done, name, None)
        if info is not None and any(info.to_dict().values()):
            kept[name] = info.to_dict()
    return kept


def _chain(where: str, replies: list[Reply]) -> tuple[list[int], int, list[int], list[float] | None]:
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


def _match(response: list[int], mask: list[int], replies: list[Reply]) -> tuple[list[float | None], list[int]]:
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


def _status(where: str, done: Any, replies: list[Reply]) -> SampleStatus:
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
