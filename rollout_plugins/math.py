"""Single-turn math with a verifiable answer: the smallest useful rollout function.

    slimish train --config C --rollout-fn rollout_plugins.math:rollout

The prompt (text or chat messages) is rendered and sent to the router; the model's tokens are
appended with their logprobs; the reward is 1.0 when the last `\\boxed{...}` matches the label
(for `task:NAME` data, the task's own verifier). An aborted sample is resumed where it stopped
when `rollout.partial_rollout` is on: `generate_sample` continues a partial sample.
"""

from slimish.rollout.rewards import math_reward
from slimish.types import Sample


async def rollout(ctx, sample: Sample) -> Sample:
    await ctx.generate_sample()
    sample.reward = await reward(ctx, sample)
    return sample


async def reward(ctx, sample: Sample) -> float:
    """Usable on its own: `--reward-fn rollout_plugins.math:reward`."""
    return await math_reward(ctx, sample)
