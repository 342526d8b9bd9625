"""Built-in verifiable tasks (`data.source: task:NAME`): prompts with a known answer, made on the fly.

Why: the quickstart, the tests and the benchmarks need a task whose reward a program checks
exactly, on a machine with no datasets. Every task here is a pure function of a seed:

- `make(split, n, seed)`: `n` distinct problems of the "train" or "test" split. A problem belongs
  to one split by a hash of its prompt, so the splits never overlap, whatever the seeds.
- `score(text, label)`: 1.0 when the last `\\boxed{...}` of the response holds the label, else 0.0
  (a right answer in the wrong format scores 0: the format is part of the task).
- `demonstration(row, rng)`: an SFT response in the right format whose answer is a *random guess*
  among the plausible ones (a digit of the list, a shuffle of the list, a number in range), blind
  to the goal. A warm start on demonstrations teaches the format (and for list tasks, that the
  answer is made of the listed items); the goal is left for RL to find, so a reward curve that
  rises shows RL at work, not SFT. (Guesses of any digit 0-9 teach the format too, but then a tiny
  model spends hundreds of RL steps discovering that the answer is in the prompt.)

Prompts are plain text (the rollout layer wraps them into a user message); digits and list items
are separated by spaces because the tiny tokenizer gives each digit its own token.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

BOXED = "\\boxed{"


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces balanced), or None when there is none.

    The last one, because a model that reasons before answering may box intermediate values.
    """
    start = text.rfind(BOXED)
    while start != -1:
        depth, i = 1, start + len(BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(BOXED) : i - 1]
        start = text.rfind(BOXED, 0, start)  # unclosed: an earlier, closed one may still count
    return None


SPLITS = ("train", "test")
TEST_FRACTION = 0.2  # of the problem space, by prompt hash
LETTERS = "abcde"
MAX_DIGITS = 6


@dataclass(frozen=True)
class Task:
    name: str
    problem: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, label)
    guess: Callable[[random.Random, str], str]  # (rng, prompt) -> an answer in the label's format

    def make(self, split: str, n: int, seed: int) -> list[dict]:
        """`n` distinct problems of `split`, the same for the same seed on every machine."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}/{split}/{seed}")  # str seeds hash the same in every process
        rows: dict[str, str] = {}
        misses = 0  # draws in a row that gave nothing new: the split is (nearly) exhausted
        while len(rows) < n:
            prompt, label = self.problem(rng)
            if split_of(prompt) == split and prompt not in rows:
                rows[prompt], misses = label, 0
            elif (misses := misses + 1) > 1000 + 10 * n:
                raise ValueError(
                    f"task {self.name!r}: could not draw {n} distinct {split!r} problems (got {len(rows)})"
                )
        return [{"prompt": p, "label": label, "task": self.name} for p, label in rows.items()]

    def score(self, response_text: str, label: str) -> float:
        answer = extract_boxed(response_text)
        return float(answer is not None and " ".join(answer.split()) == label)

    def demonstration(self, row: dict, rng: random.Random) -> str:
        return f"\\boxed{{{self.guess(rng, row['prompt'])}}}"


def split_of(prompt: str) -> str:
    """The split a prompt belongs to: a fixed function of its text, so splits cannot overlap."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return "test" if h < TEST_FRACTION * 2**64 else "train"


def _digits(rng: random.Random, k: int, top: int = 9) -> list[int]:
    return [rng.randint(0, top) for _ in range(k)]


def _spaced(items: list) -> str:
    return " ".join(str(x) for x in items)


def _max_digit(rng: random.Random) -> tuple[str, str]:
    # The maximum is drawn first, uniformly, and occurs once: no constant answer is right more
    # than 1 time in 9, and copying a random listed digit is right 1 time in MAX_DIGITS.
    top = rng.randint(1, 9)
    digits = _digits(rng, MAX_DIGITS - 1, top - 1)
    digits.insert(rng.randint(0, len(digits)), top)
    return f"Largest digit: {_spaced(digits)}", str(top)


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", str(a + b)


def _count(rng: random.Random) -> tuple[str, str]:
    letter = rng.choice(LETTERS)
    items = rng.choices(LETTERS, k=rng.randint(4, 8))
    return f"How many times does {letter} appear in: {_spaced(items)}", str(items.count(letter))


def _sort(rng: random.Random) -> tuple[str, str]:
    digits = _digits(rng, rng.randint(3, 6))
    return f"Sort ascending: {_spaced(digits)}", _spaced(sorted(digits))


def _list_items(prompt: str) -> list[str]:
    return prompt.rsplit(":", 1)[1].split()


TASKS: dict[str, Task] = {
    task.name: task
    for task in [
        Task("max_digit", _max_digit, lambda rng, prompt: rng.choice(_list_items(prompt))),
        Task("add", _add, lambda rng, prompt: str(rng.randint(0, 198))),
        Task("count", _count, lambda rng, prompt: str(rng.randint(0, len(_list_items(prompt))))),
        Task("sort", _sort, lambda rng, prompt: _spaced(rng.sample(_list_items(prompt), k=len(_list_items(prompt))))),
    ]
}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]
