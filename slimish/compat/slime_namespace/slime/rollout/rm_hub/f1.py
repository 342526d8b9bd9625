"""slime.rollout.rm_hub.f1: token F1 for QA (slimish.rollout.graders)."""

from slimish.rollout.graders import f1_score
from slimish.rollout.graders import normalize_qa as normalize_answer

__all__ = ["f1_score", "normalize_answer"]
