"""Prompt data (JSONL, Parquet, `datasets` directories, built-in tasks), verifiers and filters."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slimish.rollout.config import DataConfig
from slimish.rollout.data import PromptData, load_rows
from slimish.rollout.filters import nonzero_std
from slimish.rollout.rewards import final_turn_text
from slimish.types import Sample

ROWS = [{"question": f"q{i}", "answer": str(i), "difficulty": i % 3} for i in range(10)]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _cfg(source: str, **kw) -> DataConfig:
    return DataConfig(source=source, prompt_key="question", label_key="answer", **{"seed": 0, **kw})


def test_jsonl_rows_become_chat_prompts_with_labels_and_metadata(tmp_path: Path) -> None:
    rows = load_rows(_jsonl(tmp_path / "d.jsonl", ROWS), _cfg("x", system_prompt="Be brief."))
    assert rows[3] == {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "q3"}],
        "label": "3",
        "metadata": {"difficulty": 0, "row_id": 3},
    }
    text = load_rows(str(tmp_path / "d.jsonl"), _cfg("x", apply_chat_template=False))
    assert text[0]["prompt"] == "q0"


def test_chat_prompts_keep_their_own_system_message(tmp_path: Path) -> None:
    chat = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    rows = load_rows(
        _jsonl(tmp_path / "c.jsonl", [{"question": chat, "answer": "x"}, {"question": chat[1:], "answer": "y"}]),
        _cfg("x", system_prompt="default"),
    )
    assert rows[0]["prompt"] == chat
    assert rows[1]["prompt"] == [{"role": "system", "content": "default"}, chat[1]]


def test_parquet_and_datasets_directories(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    assert [r["label"] for r in load_rows(str(tmp_path / "d.parquet"), _cfg("x"))] == [r["answer"] for r in ROWS]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
    ).save_to_disk(tmp_path / "saved")
    assert len(load_rows(str(tmp_path / "saved"), _cfg("x"))) == 10
    assert len(load_rows(str(tmp_path / "saved"), _cfg("x"), split="test")) == 2
    files = tmp_path / "files"
    files.mkdir()
    _jsonl(files / "train.jsonl", ROWS[:4])
    assert [r["prompt"][0]["content"] for r in load_rows(str(files), _cfg("x"))] == ["q0", "q1", "q2", "q3"]


def test_built_in_tasks_carry_their_verifier_name() -> None:
    cfg = DataConfig(source="task:add", task_size=20, seed=0)
    rows = load_rows(cfg.source, cfg)
    assert len(rows) == 20 and all(r["metadata"]["task"] == "add" for r in rows)
    held_out = load_rows(cfg.source, cfg, "test")
    assert len(held_out) == 20 and not {r["prompt"][0]["content"] for r in held_out} & {
        r["prompt"][0]["content"] for r in rows
    }


@pytest.mark.parametrize(
    ("rows", "cfg", "message"),
    [
        ([{"prompt": "p"}], DataConfig(source="x"), "row 0 has no 'label' (keys: prompt); set data.label_key"),
        (
            [{"text": "p", "label": 1}],
            DataConfig(source="x"),
            "row 0 has no 'prompt' (keys: text, label); set data.prompt_key",
        ),
        (
            [{"prompt": 3, "label": 1}],
            DataConfig(source="x"),
            "row 0 'prompt': expected text or a non-empty list of chat messages",
        ),
        ([], DataConfig(source="x"), "no rows"),
    ],
)
def test_bad_rows_name_the_row_and_key(tmp_path: Path, rows: list, cfg: DataConfig, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        load_rows(_jsonl(tmp_path / "bad.jsonl", rows), cfg)
    assert message in str(info.value)


def test_bad_sources_say_what_is_expected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file or directory"):
        load_rows(str(tmp_path / "nope.jsonl"), DataConfig(source="x"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type '.csv'"):
        load_rows(str(tmp_path / "d.csv"), DataConfig(source="x"))
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "label": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_rows(str(tmp_path / "d.jsonl"), DataConfig(source="x"))
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        load_rows("task:nope", DataConfig(source="x"))


def test_no_labels_when_label_key_is_null(tmp_path: Path) -> None:
    rows = load_rows(_jsonl(tmp_path / "d.jsonl", [{"prompt": "p"}]), DataConfig(source="x", label_key=None))
    assert rows[0]["label"] is None


def test_epochs_are_reshuffled_and_a_resumed_cursor_continues_exactly(tmp_path: Path) -> None:
    cfg = _cfg(_jsonl(tmp_path / "d.jsonl", ROWS), seed=7)
    data = PromptData(cfg)
    first = [next(data)["metadata"]["row_id"] for _ in range(25)]
    assert sorted(first[:10]) == sorted(first[10:20]) == list(range(10))  # each epoch is a permutation
    assert first[:10] != first[10:20] and first[:10] != list(range(10))
    assert [next(data)["metadata"]["epoch"] for _ in range(1)] == [2]

    data = PromptData(cfg)
    for _ in range(13):
        next(data)
    state = json.loads(json.dumps(data.state_dict()))
    rest = [next(data)["metadata"]["row_id"] for _ in range(12)]
    resumed = PromptData(cfg)
    resumed.load_state_dict(state)
    assert [next(resumed)["metadata"]["row_id"] for _ in range(12)] == rest == first[13:25]
    assert [next(PromptData(_cfg(cfg.source, shuffle=False)))["metadata"]["row_id"] for _ in range(1)] == [0]
    with pytest.raises(ValueError, match="saved for 10 rows but the source now has 3"):
        PromptData(cfg, rows=PromptData(cfg).rows[:3]).load_state_dict(state)


def test_final_turn_text_is_the_models_last_turn() -> None:
    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    s = Sample(prompt="p", tokens=[9])
    s.append_model([1, 2], [0.0, 0.0])
    s.append_env([3, 4])
    s.append_model([5, 6], [0.0, 0.0])
    assert final_turn_text(Tok(), s) == "5 6"
    s.append_env([7])
    assert final_turn_text(Tok(), s) == "5 6"


def test_nonzero_std_drops_groups_with_equal_rewards() -> None:
    def group(*rewards):
        return [Sample(prompt="p", reward=r) for r in rewards]

    def ctx(reward_key: str | None = None) -> Any:
        return SimpleNamespace(config=SimpleNamespace(rollout=SimpleNamespace(reward_key=reward_key)))

    assert nonzero_std(ctx(), group(1.0, 0.0, 1.0)) is None
    assert nonzero_std(ctx(), group(0.0, 0.0)) == "zero reward variance (all 2 rewards 0.0)"
    assert nonzero_std(ctx(), group({"a": 1.0}, {"a": 1.0})) == "zero reward variance (all 2 rewards {'a': 1.0})"
    assert nonzero_std(ctx(), group({"a": 1.0}, {"a": 0.0})) is None
    assert nonzero_std(ctx(), group(1.0)) is None  # a group of one has no variance to compare
    # With a reward key only that value counts: a parsed answer that differs is not variance.
    same_score = group({"score": 1.0, "pred": "4"}, {"score": 1.0, "pred": "5"})
    assert (
        nonzero_std(ctx(), same_score) is None
        and nonzero_std(ctx("score"), same_score) == "zero reward variance (all 2 rewards 1.0)"
    )
