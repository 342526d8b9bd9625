"""On-policy distillation, rollout side: the teacher's log-probs of a finished sample's response.

The teacher is a plain SGLang-protocol server (engines of its own behind a router, or one given
by URL), or engines behind the policy's router by name (`model` in every request names them:
the router's named workers, which nothing else reaches). Scoring is one `/generate` per sample with the full token ids as `input_ids`,
`max_new_tokens=0` (nothing is generated) and input log-probs from the last prompt token on:
docs/protocol.md 1.3 gives the logprob of token j (predicted from position j-1) at entry
j - logprob_start_len, with `null` where a token has no predecessor. Starting one token before the
response keeps entry 0 off the response whatever the server does with the first entry (null at
position 0 in SGLang), and every response token still gets a real value. The reply's token ids
are checked against the sample's, so an off-by-one cannot pass silently.

The request's temperature is the rollout's: the engine reports log_softmax(logits / T) (T = 1 for
greedy), as it does for the policy's own logprobs, so teacher and policy log-probs are taken on
the same scale.
"""

from __future__ import annotations

from slimish.client import Client
from slimish.types import Sample


class TeacherChanged(RuntimeError):
    """The teacher's weight version moved during the run: something pushed weights into it."""


async def teacher_logprobs(
    client: Client, tokens: list[int], prompt_length: int, temperature: float, model: str | None = None
) -> tuple[list[float], str]:
    """The teacher's log-probs of `tokens[prompt_length:]`, one per token, and its weight version
    as the server reports it (a fresh engine's is "default": any push changes it). `model`: the
    name the teacher is served under on a shared router (None: the server serves only it)."""
    if prompt_length < 1:
        raise ValueError(f"teacher scoring needs at least one prompt token, got prompt_length {prompt_length}")
    start = prompt_length - 1
    reply = await client.generate(
        input_ids=list(tokens),
        return_logprob=True,
        logprob_start_len=start,
        model=model,
        sampling_params={"max_new_tokens": 0, "temperature": temperature},
    )
    assert not isinstance(reply, list)  # one prompt, n = 1
    entries = reply.meta_info.input_token_logprobs or []
    if len(entries) != len(tokens) - start:
        raise ValueError(
            f"teacher {client.base_url}: {len(entries)} input_token_logprobs for logprob_start_len {start} of "
            f"{len(tokens)} tokens; expected {len(tokens) - start}"
        )
    response = entries[1:]
    if [e[1] for e in response] != list(tokens[prompt_length:]):
        raise ValueError(
            f"teacher {client.base_url}: input_token_logprobs name other token ids than the sample's response"
        )
    if any(e[0] is None for e in response):
        raise ValueError(f"teacher {client.base_url}: a response token has no logprob (null)")
    return [float(e[0]) for e in response], reply.meta_info.weight_version


class Teacher:
    """The run's teacher client; its weight version is pinned at the first reply: a later change
    means weights were pushed into it, which must never happen (it is not the policy)."""

    def __init__(self, client: Client, temperature: float, model: str | None = None) -> None:
        self.client, self.temperature, self.model = client, temperature, model
        self.version: str | None = None

    async def score(self, sample: Sample) -> None:
        """Set `sample.teacher_logprobs` (aligned with `rollout_logprobs`)."""
        logprobs, version = await teacher_logprobs(
            self.client, sample.tokens, sample.prompt_length, self.temperature, self.model
        )
        if self.version is None:
            self.version = version
        elif version != self.version:
            raise TeacherChanged(
                f"teacher {self.client.base_url}: weight version {self.version} became {version}: weights were "
                "pushed into the teacher; launch.teacher must not be one of the policy's engines"
            )
        sample.teacher_logprobs = logprobs

    async def close(self) -> None:
        await self.client.close()
