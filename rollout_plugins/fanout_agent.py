"""Multi-agent fan-out with the public API only: a planner writes a short plan, then `solvers`
agents (`rollout.args.solvers`, default 2) each answer from it; the trajectory is rewarded by its
best answer.

    slimish train --config C --rollout-fn rollout_plugins.fanout_agent:rollout algorithm.loss_reduction=trajectory

`ctx.new_sample(prompt)` gives each solver a sibling sample with its own context (here
`ctx.chat`), in the planner's trajectory: the group's baseline counts the trajectory once however
many agents it has, and `loss_reduction=trajectory` weighs it once in the loss.
"""

import asyncio

from slimish.rollout.rewards import math_reward
from slimish.types import Sample


async def rollout(ctx, sample: Sample) -> list[Sample]:
    question = sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}]
    plan = await ctx.chat([*question[:-1], {"role": "user", "content": "Plan, briefly: " + question[-1]["content"]}])
    solving = [*question[:-1], {"role": "user", "content": f"{question[-1]['content']}\nPlan: {plan.content}"}]
    solvers = [ctx.new_sample(prompt=solving) for _ in range(int(ctx.args.get("solvers", 2)))]
    await asyncio.gather(*(solver.chat(solving) for solver in solvers))
    answers = [solver.sample for solver in solvers]
    reward = max([await math_reward(ctx, s) for s in answers])
    for s in (sample, *answers):
        s.reward = reward
    return [sample, *answers]
