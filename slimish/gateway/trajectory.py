"""A captured session as a tree of turns: where each request attaches, and the samples it yields.

Agent harnesses rewrite their own history (context compaction, subagents, dropped reasoning,
edited replies), so a session's requests do not form one chain. Each request is placed in the
session's tree by the first rule that holds, against the turns already there (newest first):

- **continue**: its messages are a turn's conversation, the reply we gave, then new messages.
  The prompt is that turn's ids plus the environment's ids (`rollout.history=exact`), or the
  template's rendering of the conversation where it extends them (`template`).
- **realign**: the same, but the agent sent our latest reply back changed, and the template's
  rendering leaves that reply at most `realign_tokens` ids short: the model's ids up to where
  the two differ are kept (and trained), the rest of the reply is overwritten by the rendering
  (mask 0, not the model's).
- **fork**: anything else (a summary replaced the history, another system prompt, a new
  conversation): a new root, rendered by the template. Each fork is logged with its reason.
  (The session's first request is its first root: `start`.)

Several requests may continue one turn (parallel tool branches, a subagent that starts from the
main conversation): the turn gets several children. Every leaf becomes one sample, the path from
its root; a turn shared by several leaves is trained once (mask 1 in the first sample that holds
it, mask 0 in the others), so no token counts twice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from slimish.formats.tokens import ChatTokens, same_message
from slimish.types import Sample, status_of

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Turn:
    """One model turn: a node of the tree. Compared by identity: two turns of equal content are two
    turns (by value, comparing one would recurse through its parents and children)."""

    parent: "Turn | None"
    keep: int  # how many of the parent's completion ids this turn's context keeps (all, unless realigned)
    env_ids: list[int]  # ids after the parent's kept ids (a root: its whole prompt)
    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the request's conversation, normalised
    reply: dict[str, Any]  # the assistant message we returned
    render_key: str  # tools + template kwargs: a change means the template renders differently
    how: str  # start | fork | continue | realign
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per completion id
    finish_reason: str = "abort"
    children: list["Turn"] = field(default_factory=list)
    # The engine's routes (algorithm.routing_replay=r3): rows of `ids` from token `routes_start`.
    routes: np.ndarray | None = field(default=None, repr=False)
    routes_start: int = 0
    reshaped: bool = False  # sampled with reshaping parameters (`protocol.reshapes`): not the policy's logprobs

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class Placement:
    """Where a request goes: its parent turn (None: a new root), the ids it adds, how."""

    parent: Turn | None
    keep: int
    env_ids: list[int]
    prompt_ids: list[int]
    how: str
    reason: str = ""  # why a fork did not attach anywhere


class TrajectoryTree:
    """One session's turns. `place` decides where a request attaches; `add` records its result."""

    def __init__(self, history: str = "exact", realign_tokens: int = 8) -> None:
        self.history, self.realign_tokens = history, realign_tokens
        self.turns: list[Turn] = []  # creation order
        self.realignments = 0
        self.held = 0  # token ids the turns hold (each its prompt and completion): the gateway's bound

    @property
    def roots(self) -> list[Turn]:
        return [t for t in self.turns if t.parent is None]

    def place(self, messages: list[dict[str, Any]], render_key: str, chat: ChatTokens) -> Placement:
        """The first rule that holds against the turns so far, newest first (module docstring)."""
        rendered: list[int] | None = None
        reasons = []
        for i in range(len(self.turns) - 1, -1, -1):
            turn = self.turns[i]
            k = len(turn.messages)
            if turn.render_key != render_key:
                reasons.append("tools or template kwargs changed")
                continue
            if len(messages) < k + 2 or not all(same_message(a, b) for a, b in zip(messages, turn.messages)):
                continue  # not this turn's conversation: nothing to report, the agent may run several
            if same_message(messages[k], turn.reply):
                if self.history == "exact":
                    last = turn.completion_ids[-1] if turn.completion_ids else None
                    env = chat.env_ids(messages[k + 1 :], last)
                    return Placement(turn, len(turn.completion_ids), env, turn.ids + env, "continue")
                rendered = rendered if rendered is not None else chat.prompt_ids(messages)
                if rendered[: len(turn.ids)] == turn.ids:
                    return Placement(turn, len(turn.completion_ids), rendered[len(turn.ids) :], rendered, "continue")
                reasons.append(f"the template re-renders the history before turn {i}")
            else:
                rendered = rendered if rendered is not None else chat.prompt_ids(messages)
                same = _common_prefix(rendered, turn.ids)
                dropped = len(turn.ids) - same
                if same >= len(turn.prompt_ids) and dropped <= self.realign_tokens:
                    self.realignments += 1
                    keep = same - len(turn.prompt_ids)
                    return Placement(turn, keep, rendered[same:], rendered, "realign")
                reasons.append(
                    f"reply {i} came back changed ({dropped} of its ids differ, at most {self.realign_tokens} realign)"
                )
        rendered = rendered if rendered is not None else chat.prompt_ids(messages)
        if not self.turns:
            return Placement(None, 0, rendered, rendered, "start")
        reason = reasons[0] if reasons else "a new conversation"
        log.debug("gateway: fork (new segment %d): %s", len(self.roots), reason)
        return Placement(None, 0, rendered, rendered, "fork", reason)

    def add(
        self,
        at: Placement,
        messages: list[dict[str, Any]],
        reply: dict[str, Any],
        render_key: str,
        completion_ids: list[int],
        logprobs: list[float],
        versions: list[int],
        finish_reason: str,
        routes: np.ndarray | None = None,
        routes_start: int = 0,
        reshaped: bool = False,
    ) -> Turn:
        turn = Turn(
            at.parent,
            at.keep,
            at.env_ids,
            at.prompt_ids,
            messages,
            reply,
            render_key,
            at.how,
            completion_ids,
            logprobs,
            versions,
            finish_reason,
            routes=routes,
            routes_start=routes_start,
            reshaped=reshaped,
        )
        if at.parent is not None:
            at.parent.children.append(turn)
        self.turns.append(turn)
        self.held += len(turn.ids)
        return turn

    @staticmethod
    def routes_held(at: Placement) -> int:
        """How many rows of routes the samples through `at` hold before its prompt's new ids: where
        its request asks the engine's routes to start (each token routed once, and a token keeps
        the route it was generated with). A root, or a parent without routes: from the first."""
        parent = at.parent
        if parent is None or parent.routes is None:
            return 0
        return min(parent.routes_start + len(parent.routes), len(parent.prompt_ids) + at.keep - 1)

    def samples(self, template: Sample, meta: dict[str, Any], policy: str | None = None) -> list[Sample]:
        """One sample per leaf, in the order the leaves were made; a turn's ids are trained in
        the first sample that holds them only. `policy`: the run's policy that made every turn."""
        trained: dict[int, int] = {}  # id(turn) -> how many of its completion ids a sample trained already
        samples = []
        leaves, roots = [t for t in self.turns if not t.children], self.roots
        for b, leaf in enumerate(leaves):
            path = [leaf]
            while path[-1].parent is not None:
                path.append(path[-1].parent)  # type: ignore[arg-type]
            path.reverse()
            root = path[0]
            s = Sample(
                prompt=template.prompt,
                label=template.label,
                group_id=template.group_id,
                index=template.index,
                metadata={
                    **template.metadata,
                    "capture": {
                        **meta,
                        "segment": roots.index(root),
                        "branch": b,
                        "turns": len(path),
                        "how": [t.how for t in path],
                    },
                },
            )
            s.set_prompt(root.prompt_ids)
            for turn, child in zip(path, [*path[1:], None]):
                keep = child.keep if child is not None else len(turn.completion_ids)
                i = id(turn)
                done = min(trained.get(i, 0), keep)
                s.append_env(turn.completion_ids[:done])
                s.append_model(
                    turn.completion_ids[done:keep],
                    turn.logprobs[done:keep],
                    turn.versions[done:keep] or None,
                    policy=policy,
                    reshaped=turn.reshaped,
                )
                trained[i] = max(trained.get(i, 0), keep)
                if turn.routes is not None:  # up to the last kept id fed forward: a realigned reply's rest is not ours
                    s.add_routes(turn.routes[: len(s.tokens) - 1 - turn.routes_start], turn.routes_start)
                if child is not None:
                    s.append_env(child.env_ids)
            s.status = status_of(leaf.finish_reason)
            s.check()
            samples.append(s)
        return samples


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
