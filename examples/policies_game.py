"""Two policies in one run (docs/policies.md): a proposer and a solver play the quickstart's task.

The proposer is shown a digit list (`task:max_digit`'s prompt) and adds a digit to it; the solver
is shown the list with that digit appended and answers its largest digit. Both turns are one
sample, each recorded as its policy's (`ctx.chat(..., policy=)`), and the reward is per policy:

- the proposer scores 1 when its digit is at least every listed one: a digit no smaller than the
  list's largest (a 9 always is);
- the solver scores 1 when it names the largest digit of the list it was shown.

The game is cooperative: the more the proposer proposes 9s, the more often the answer is the
digit it just read. configs/policies_game.yaml trains both from the quickstart's warm start.
"""

from slimish.rollout.rewards import extract_boxed

DIGITS = [str(d) for d in range(10)]


def digits_of(prompt: str) -> list[int]:
    """The listed digits of a `task:max_digit` prompt ("Largest digit: 3 1 4 ...")."""
    return [int(d) for d in prompt.rsplit(":", 1)[1].split()]


async def rollout(ctx, sample):
    messages = list(sample.prompt)  # [{"role": "user", "content": "Largest digit: 3 1 4 ..."}]
    listed = digits_of(messages[-1]["content"])
    sample.reward = {"proposer": 0.0, "solver": 0.0}
    proposal = await ctx.chat(messages, policy="proposer")
    digit = extract_boxed(proposal.content)
    if proposal.finish_reason != "stop" or digit not in DIGITS:
        return sample  # no digit proposed: neither scores
    shown = [*listed, int(digit)]
    messages += [proposal.message, {"role": "user", "content": "Largest digit: " + " ".join(map(str, shown))}]
    answer = await ctx.chat(messages, policy="solver")
    sample.reward = {
        "proposer": float(int(digit) >= max(listed)),
        "solver": float(extract_boxed(answer.content) == str(max(shown))),
    }
    return sample
