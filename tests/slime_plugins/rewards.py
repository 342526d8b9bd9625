"""A reward, a group reward and a dynamic-sampling filter in slime's signatures."""

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


async def rm(args, sample: Sample, **kwargs):
    """A dict reward with non-numeric fields (slime's rm may return a dict; `--reward-key score`)."""
    score = 1.0 if sample.index % 2 == 0 else 0.0
    return {"score": score, "acc": score == 1.0, "pred": "42"}


async def group_rm(args, samples: list[Sample]) -> list[float]:
    """One reward per sample of the whole group (slime's --group-rm): the first sample of an
    even group wins; an odd group scores flat 0.5 (the filter below drops it)."""
    if samples[0].group_index % 2:
        return [0.5 for _ in samples]
    return [float(i == 0) for i, _ in enumerate(samples)]


def nonzero_std(args, samples: list[Sample], **kwargs) -> DynamicFilterOutput:
    rewards = [s.get_reward_value(args) for s in samples]
    keep = max(rewards) - min(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{rewards[0]:.1f}")


def legacy_filter(args, samples):
    """Older slime filters return a bool."""
    return len(samples) > 100
