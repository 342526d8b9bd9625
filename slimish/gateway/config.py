"""The agent gateway's schema (`gateway.*`): how long a session lives and how much all of them hold.

An agent is a program the run does not control (a harness, model-written code): these bounds keep
a misbehaving one, or one that never finishes, from growing the rollout process without limit.
"""

from __future__ import annotations

from dataclasses import dataclass

from slimish.schema import at_least, doc


@dataclass
class GatewayConfig:
    session_idle_s: float = doc(
        3600.0,
        "A session no request has used for this many seconds is forgotten, its trajectory and stored Responses "
        "freed (a rollout that collects it later gets no samples); longer than any tool call of an agent.",
    )
    max_sessions: int = doc(
        4096,
        "Live sessions at most; a request that would open one more is refused with 429 naming this key.",
    )
    max_tokens: int = doc(
        64 * 1024 * 1024,
        "Token ids all live sessions hold at most (each turn holds its prompt and completion ids); a turn whose "
        "prompt would pass it is refused with 429 naming this key. ~8 bytes each.",
    )

    def __post_init__(self) -> None:
        at_least(1, self, "gateway.", "max_sessions", "max_tokens")
        if self.session_idle_s <= 0:
            raise ValueError(f"gateway.session_idle_s must be > 0, got {self.session_idle_s}")
