"""The task of the black-box harness example: sum the numbers of a file into another file.

A prompt row is `{"prompt": TASK, "label": "<the sum>", "numbers": [...]}` (the data loader moves
`numbers` into the sample's metadata). The harness's working directory gets `task.md` (the
prompt) and `numbers.txt` (the numbers, one a line); the checker reads `answer.txt` back. Rows:

    python -m rollout_plugins.harness_task.task prompts.jsonl --n 512 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

TASK = "Write the sum of the numbers in numbers.txt into answer.txt (only the number)."
ANSWER = "answer.txt"
MAX_ANSWER_BYTES = 1024  # an answer is a number: a bigger file is wrong, and is not read whole


def make_row(rng: random.Random, count: int = 5) -> dict[str, Any]:
    numbers = [rng.randint(-50, 200) for _ in range(count)]
    return {"prompt": TASK, "label": str(sum(numbers)), "numbers": numbers}


def make_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [make_row(rng, rng.randint(3, 8)) for _ in range(n)]


def task_files(prompt: str | list[dict[str, Any]], metadata: dict[str, Any]) -> dict[str, str]:
    """The working directory of one rollout: the task as `task.md` (a chat prompt's last message)
    and its numbers."""
    text = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    return {"task.md": text + "\n", "numbers.txt": "".join(f"{x}\n" for x in metadata["numbers"])}


def score(workdir: Path, label: Any) -> float:
    """1.0 when `answer.txt` holds the label (surrounding whitespace aside), else 0.0: a missing,
    unreadable or oversized answer is simply wrong."""
    path = workdir / ANSWER
    try:
        if not path.is_file() or path.stat().st_size > MAX_ANSWER_BYTES:
            return 0.0
        answer = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return 0.0
    return float(answer.strip() == str(label).strip())


def main() -> None:
    parser = argparse.ArgumentParser(description="Write prompt rows of the sum task as JSONL.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--n", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.out.write_text("".join(json.dumps(row) + "\n" for row in make_rows(args.n, args.seed)))


if __name__ == "__main__":
    main()
