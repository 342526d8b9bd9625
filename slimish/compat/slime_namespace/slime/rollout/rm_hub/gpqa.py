"""slime.rollout.rm_hub.gpqa: multiple-choice scoring (the chosen option letter)."""

from __future__ import annotations

import re
import string
from typing import Any

LETTER_PATTERNS = (
    r"(?:final\s+)?(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b",
    r"\(?([A-Z])\)?\s+is\s+(?:the\s+)?correct",
)


def _letters(metadata: dict) -> list[str]:
    if metadata.get("valid_letters"):
        return [str(x).upper() for x in metadata["valid_letters"]]
    choices = metadata.get("choices")
    return list(string.ascii_uppercase[: len(choices) if choices else 10])


def _chosen(response: str, letters: list[str]) -> str | None:
    text = response.rsplit("</think>", 1)[-1]
    for pattern in LETTER_PATTERNS:
        for match in re.finditer(pattern, text, flags=re.IGNORECASE):
            if match.group(1).upper() in letters:
                return match.group(1).upper()
    standalone = [x for x in re.findall(r"\b([A-Z])\b", text) if x in letters]
    return standalone[-1] if standalone else None


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    """1.0 when the option the response chooses is the right one: the label as a letter, an
    index, or an option's text (with `metadata["choices"]`), or `metadata["correct_letter"]`."""
    if response is None:
        return 0.0
    metadata = metadata or {}
    letters = _letters(metadata)
    right = str(metadata.get("correct_letter") or "").strip().upper() or None
    if right is None and isinstance(label, (int, float)) and 0 <= int(label) < len(letters):
        right = letters[int(label)]
    elif right is None and isinstance(label, str) and label.strip().upper() in letters:
        right = label.strip().upper()
    choices = list(metadata.get("choices") or [])
    if right is None and isinstance(label, str):
        norm = label.strip().lower()
        right = next((letters[i] for i, c in enumerate(choices) if str(c).strip().lower() == norm), None)
    return float(right is not None and _chosen(response, letters) == right)


__all__ = ["compute_gpqa_reward"]
