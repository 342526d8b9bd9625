"""Guess my digit: a two-turn task in which the model must use what the environment tells it.

The code of docs/tutorial.md, block by block (tests/test_tutorial.py checks that they are equal).
"""

import random

from slimish.rollout.rewards import extract_boxed

QUESTION = "Guess my digit."
DIGITS = [str(d) for d in range(10)]


def rows(cfg, split):
    """The prompts: one question, and the secret digit as the label. The same rows every
    time for a seed and split (a resumed run counts on it)."""
    rng = random.Random(f"guess/{split}/{cfg.seed}")
    return [{"prompt": QUESTION, "label": rng.choice(DIGITS)} for _ in range(1000)]


def reply_to(guess, secret):
    """The environment's answer to a guess: right or wrong, it tells the secret."""
    return f"{'Yes' if guess == secret else 'No'}, it is {secret}."


async def rollout(ctx, sample):
    messages = list(sample.prompt)  # [{"role": "user", "content": QUESTION}]
    sample.reward = 0.0
    first = await ctx.chat(messages)  # turn 1: the model guesses
    guess = extract_boxed(first.content)
    if first.finish_reason != "stop" or guess not in DIGITS:
        return sample  # no guess, no answer
    messages += [first.message, {"role": "user", "content": reply_to(guess, sample.label)}]
    second = await ctx.chat(messages)  # turn 2: the model answers
    sample.reward = float(extract_boxed(second.content) == sample.label)
    return sample


def demos(cfg, split):
    """Demonstrations for the warm start: a whole game, the last turn to imitate. Its answer
    repeats the model's own guess 3 times in 4 and the secret it was told only 1 in 4."""
    rng = random.Random(f"guess/demos/{cfg.seed}")
    out = []
    for _ in range(1000):
        guess, secret = rng.choice(DIGITS), rng.choice(DIGITS)
        answer = guess if rng.random() < 0.75 else secret
        game = [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": f"\\boxed{{{guess}}}"},
            {"role": "user", "content": reply_to(guess, secret)},
        ]
        out.append({"prompt": game, "response": f"\\boxed{{{answer}}}"})
    return out
