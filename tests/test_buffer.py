"""The buffer: oldest first, a staleness bound that drops and counts, JSON state."""

from __future__ import annotations

import json

from slimish.buffer import Buffer, Staleness, group_version
from slimish.protocol import GenerateResponse, MetaInfo
from slimish.rollout.api import to_result
from slimish.types import Sample


def _group(gid: int, *versions: int) -> list[Sample]:
    samples = []
    for i, v in enumerate(versions):
        s = Sample(prompt="p", tokens=[1, 2], group_id=gid, index=i, reward=1.0)
        s.append_model([3], [-0.5], v)
        samples.append(s)
    return samples


def test_oldest_first_and_at_most_n() -> None:
    buf = Buffer()
    for gid in range(3):
        buf.add(_group(gid, 0))
    assert [g[0].group_id for g in buf.get_batch(2)] == [0, 1]
    assert [g[0].group_id for g in buf.get_batch(5)] == [2]
    assert buf.get_batch(1) == [] and len(buf) == 0


def test_stale_groups_are_dropped_and_counted_never_returned() -> None:
    buf = Buffer(Staleness(1))
    buf.add(_group(0, 3, 1))  # one sample from version 1: the group's age is 1
    buf.add(_group(1, 2, 3))
    buf.add(_group(2, 3))
    assert group_version(_group(0, 3, 1)) == 1 and group_version(_group(9, 0)) == 0
    batch = buf.get_batch(2, version=3)
    assert [g[0].group_id for g in batch] == [1, 2]
    assert (buf.dropped_stale, buf.dropped_stale_samples) == (1, 2)
    assert Staleness(1).lag(_group(3, 1), 3) == 2 and Staleness(2).too_stale(_group(3, 1), 3) is False
    assert Staleness(1).groups_ahead(pushes=0, batch_size=4) == 8  # the batch being trained, and one more


def test_state_round_trips_through_json() -> None:
    buf = Buffer(Staleness(0))
    for gid, version in enumerate([0, 1, 1]):
        buf.add(_group(gid, version, version))
    assert buf.get_batch(1, version=1)[0][0].group_id == 1  # group 0 dropped on the way
    state = json.loads(json.dumps(buf.state_dict()))
    restored = Buffer(Staleness(0))
    restored.load_state_dict(state)
    assert restored.dropped_stale == 1 and len(restored) == 1
    (group,) = restored.get_batch(1, version=1)
    assert [s.to_dict() for s in group] == [s.to_dict() for s in _group(2, 1, 1)]


def test_a_request_that_outlived_an_update_ages_its_group_by_its_oldest_tokens() -> None:
    """The engine reports which version made which output tokens; the sample keeps them all, so a
    group is as old as its first tokens, not its last (else retract / in_place would hide staleness)."""
    spans = [{"version": "2", "start": 0, "end": 3}, {"version": "3", "start": 3, "end": 5}]
    meta = {
        "id": "r",
        "prompt_tokens": 2,
        "completion_tokens": 5,
        "weight_version": "3",
        "output_token_logprobs": [[-0.1, t, None] for t in range(5)],
        "finish_reason": {"type": "length"},
    }
    result = to_result(
        GenerateResponse(text="", output_ids=list(range(5)), meta_info=MetaInfo(**meta, weight_versions=spans))
    )
    assert result.token_versions == [2, 2, 2, 3, 3] and result.weight_version == 3
    s = Sample(prompt="p", tokens=[1, 2])
    s.append_model(result.output_ids, result.logprobs, result.token_versions)
    s.append_env([9])
    s.append_model([7], [-0.2], 3)
    s.check()
    assert s.weight_versions == [2, 3] and s.token_versions == [2, 2, 2, 3, 3, -1, 3] and group_version([s]) == 2
    assert MetaInfo(**meta).output_versions(5) == [3] * 5  # an engine without spans (SGLang): the final version


def test_mask_stale_tokens_trains_the_fresh_part_of_a_long_sample() -> None:
    """Instead of dropping a group whose first tokens are too old, mask those tokens out; a group
    left with nothing to train on is dropped and counted."""
    long = Sample(prompt="p", tokens=[1], group_id=0, reward=1.0)
    long.append_model([3, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4], [1, 1, 3, 4])
    old = Sample(prompt="p", tokens=[1], group_id=1, reward=1.0)
    old.append_model([3], [-0.5], 1)
    buf = Buffer(Staleness(1, mask_tokens=True))
    buf.add([long])
    buf.add([old])
    batch = buf.get_batch(2, version=4)
    assert [g[0].group_id for g in batch] == [0]
    assert long.loss_mask == [0, 0, 1, 1] and long.rollout_logprobs == [0.0, 0.0, -0.3, -0.4]
    assert group_version(batch[0]) == 3 and long.trained_versions() == {3, 4}
    assert (buf.masked_stale_tokens, buf.dropped_stale) == (3, 1)


def test_samples_saved_with_the_older_version_fields_load_into_the_per_token_record() -> None:
    """One version field is stored, per token; `weight_versions` is read from it. A checkpoint's
    samples from before kept versions in order (strings before that, with no per-token record):
    they load with the oldest on every trained token, so their group's age is what it was."""
    base = {"prompt": "p", "tokens": [1, 2, 3, 4], "response_length": 3, "loss_mask": [1, 0, 1]}
    base |= {"rollout_logprobs": [-0.1, 0.0, -0.2], "reward": 1.0, "status": "completed"}
    oldest = Sample.from_dict({**base, "weight_versions": ["3", "4"]})
    assert oldest.token_versions == [3, -1, 3] and oldest.weight_versions == [3] and group_version([oldest]) == 3
    older = Sample.from_dict({**base, "weight_versions": [3, 4], "token_versions": [3, -1, 4]})
    assert older.token_versions == [3, -1, 4] and older.weight_versions == [3, 4] and older.trained_versions() == {3, 4}
    assert "weight_versions" not in older.to_dict() and Sample.from_dict(older.to_dict()) == older
    oldest.check()
    older.check()
