"""`slimish view`: what the trainer writes under RUN_DIR/view/, the page built from it, and the page
rendered by a real browser (Debian's `chromium`, headless) after a short real `slimish train`.

The browser test reads the DOM chromium dumps after the page's JS ran (`--dump-dom` with a
virtual time budget) and saves a screenshot (`tmp_path/view.png`; also `test-artifacts/` in the
repo root when SLIMISH_ARTIFACTS is set).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from slimish.types import Sample, SampleStatus
from slimish.view import ViewWriter, build, chosen_groups, read_run, serve

ROOT = Path(__file__).resolve().parent.parent


class _Pieces:
    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [f"<{i[0]}>" if i[0] % 5 else "\n" for i in ids]


def _sample(group: int, index: int, step: int) -> Sample:
    s = Sample(prompt="p", group_id=group, index=index, trajectory_id=f"{group}-{index}")
    s.set_prompt([1, 2, 3])
    s.append_model([10, 11], [-0.1, -3.0], step - 1)
    s.append_env([20, 21, 22])  # a tool turn: mask 0
    s.append_model([12], [-0.5], step)
    s.reward, s.status = float(index), SampleStatus.TRUNCATED if index else SampleStatus.COMPLETED
    s.metadata = {"note": "</script><b>not markup</b>"}
    return s


def _write_run(run_dir: Path, steps: int = 2, groups: int = 3) -> None:
    writer = ViewWriter(run_dir, 2, "unused")
    writer._tokenizer = _Pieces()
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(steps + 1):
            f.write(
                json.dumps({"step": step, "reward/mean": 0.5, "response/length": 6.0, "train/kl": float("nan")}) + "\n"
            )
    with writer.phase("push"):  # as train.py: the first push, before step 1
        pass
    writer.end_step(0, {"time/weight_push": 0.01})
    for step in range(1, steps + 1):
        with writer.phase("rollout"):
            pass
        with writer.phase("train"):
            pass
        with writer.phase("push"):
            pass
        writer.write_samples(step, [[_sample(step * 10 + g, i, step) for i in range(2)] for g in range(groups)])
        writer.end_step(step, {"time/weight_push": 0.01, "rollout/engine_idle_fraction": 0.25})
    writer.close()


def test_writer_records_and_page_embeds_them(tmp_path: Path) -> None:
    _write_run(tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "view" / "samples.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 2 * 2  # steps x view_groups x samples per group
    assert [r["group_id"] for r in lines[:4]] == [10, 10, 11, 11]  # groups 0 and 1 of 3, evenly spaced
    r = lines[0]
    assert r["prompt"] == {"ids": [1, 2, 3], "pieces": ["<1>", "<2>", "<3>"]}
    assert r["response"]["mask"] == [1, 1, 0, 0, 0, 1] and r["response"]["versions"] == [0, 0, -1, -1, -1, 1]
    assert r["response"]["logprobs"] == [-0.1, -3.0, 0.0, 0.0, 0.0, -0.5] and r["response"]["pieces"][5] == "<12>"
    assert r["weight_versions"] == [0, 1] and r["status"] == "completed" and r["trajectory_id"] == "10-0"
    timeline = [json.loads(x) for x in (tmp_path / "view" / "timeline.jsonl").read_text().splitlines()][1:]
    assert [[p["name"] for p in t["phases"]] for t in timeline] == [["rollout", "train", "push"]] * 2
    assert (
        timeline[1]["version"] == 2
        and timeline[1]["trained_versions"] == [1, 2]
        and timeline[1]["engine_idle_fraction"] == 0.25
    )
    assert all(p["start"] <= p["end"] for t in timeline for p in t["phases"])

    page = build(tmp_path).read_text()
    assert page.count("</script>") == 2  # the data's "</script>" is escaped: it cannot end the tag
    blob = page.split('<script type="application/json" id="data">')[1].split("</script>")[0]
    data = json.loads(blob)
    assert [m["step"] for m in data["metrics"]] == [0, 1, 2] and len(data["samples"]) == 8
    assert data["samples"][0]["metadata"]["note"] == "</script><b>not markup</b>"
    assert data["metrics"][0]["train/kl"] is None  # NaN is no JSON the browser parses
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page  # nothing fetched


def test_read_run_bounds_steps_and_keeps_a_resumed_steps_latest_lines(tmp_path: Path) -> None:
    _write_run(tmp_path, steps=5, groups=1)
    _write_run(tmp_path, steps=2, groups=1)  # a resume re-ran steps 1-2: same group ids, written again
    data = read_run(tmp_path)
    assert len(data["samples"]) == 5 * 2 and [t["step"] for t in data["timeline"]] == [0, 1, 2, 3, 4, 5]
    writer = ViewWriter(tmp_path, 1, "unused")  # a resume from step 5: its first push joins step 5's line
    with writer.phase("push"):
        pass
    writer.end_step(5, {"time/weight_push": 0.0})
    writer.close()
    assert [p["name"] for p in read_run(tmp_path)["timeline"][-1]["phases"]] == ["rollout", "train", "push", "push"]
    assert sorted({s["step"] for s in read_run(tmp_path, sample_steps=3)["samples"]}) == [1, 3, 5]
    assert chosen_groups([[1], [2], [3], [4]], 2) == [[1], [3]] and chosen_groups([[1]], 0) == []


def test_serve_and_cli(tmp_path: Path) -> None:
    _write_run(tmp_path)
    page = build(tmp_path, tmp_path / "out.html")
    server = serve(page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/", timeout=10).read()
        assert body == page.read_bytes()
    finally:
        server.shutdown()
        server.server_close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "slimish.cli", "view", str(tmp_path), "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == str(tmp_path / "view.html")
        url = proc.stdout.readline().split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert b"slimish view" in urllib.request.urlopen(url, timeout=10).read()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- a real run in a real browser ---------------------------------------------------------------

ROLLOUT = '''
async def rollout(ctx, sample):
    """Two model turns with a tool turn between (mask 0), as an agent's sample is built."""
    await ctx.generate_sample({"max_new_tokens": 3})
    ctx.append_env(ctx.tokenizer.encode(" tool: 7 ", add_special_tokens=False))
    await ctx.generate_sample({"max_new_tokens": sample.response_length + 3})
    sample.reward = float(sample.response_length % 2)
    sample.metadata["turns"] = 2
    return sample
'''


class _Dom(HTMLParser):
    """The classes of the token spans inside one sample's div, the step rows, the timeline's rects."""

    def __init__(self, step: int, group: int, index: int) -> None:
        super().__init__()
        self.target = {"data-step": str(step), "data-group": str(group), "data-index": str(index)}
        self.depth = 0  # > 0 inside the target sample's div
        self.tokens: list[str] = []
        self.step_rows: list[int] = []
        self.rects: list[str] = []
        self.versions: list[str] = []
        self._in_version = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        if tag == "div" and "sample" in cls and all(a.get(k) == v for k, v in self.target.items()):
            self.depth = 1
        elif tag == "div" and self.depth:
            self.depth += 1
        if tag == "span" and self.depth and "tok" in cls:
            self.tokens.append(next(c for c in cls if c in ("p", "m0", "m1")))
        if tag == "tr" and "step" in cls:
            self.step_rows.append(int(a["data-step"]))
        if tag == "rect" and "ph" in cls:
            self.rects.append(cls[1])
        self._in_version = tag == "text" and "version" in cls

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self.depth:
            self.depth -= 1
        self._in_version = False

    def handle_data(self, data: str) -> None:
        if self._in_version:
            self.versions.append(data)


def _chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium")
    assert exe
    return subprocess.run(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_train_then_view_in_chromium(tiny_model_dir: Path, tmp_path: Path) -> None:
    data, run_dir, fn = tmp_path / "prompts.jsonl", tmp_path / "run", tmp_path / "two_turns.py"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "label": str(i + 1)}) + "\n" for i in range(40)))
    fn.write_text(ROLLOUT)
    steps = 3
    argv = [
        sys.executable,
        "-m",
        "slimish.train",
        f"model={tiny_model_dir}",
        f"run_dir={run_dir}",
        f"data.source={data}",
        f"steps={steps}",
        "rollout.rollout_batch_size=3",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=9",
        "rollout.filter_fn=null",
        f"eval.source={data}",
        "eval.n_prompts=2",
        f"eval.every={steps}",
        "trainer.lr=1e-3",
        "metrics.view_groups=2",
        "--rollout-fn",
        f"{fn}:rollout",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trained = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr[-3000:]
    viewed = subprocess.run(
        [sys.executable, "-m", "slimish.cli", "view", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert viewed.returncode == 0, viewed.stderr
    page = run_dir / "view.html"
    assert viewed.stdout.strip() == str(page)

    samples = [json.loads(x) for x in (run_dir / "view" / "samples.jsonl").read_text().splitlines()]
    assert sorted({s["step"] for s in samples}) == [1, 2, 3] and len(samples) == steps * 2 * 2
    chosen = next(s for s in samples if s["step"] == 2)
    assert 0 in chosen["response"]["mask"] and 1 in chosen["response"]["mask"]  # the tool turn is in it

    if shutil.which("chromium") is None:
        pytest.skip(
            "no `chromium` on PATH (Debian: apt-get install chromium; .ci/run installs it as root): "
            "the run and the page were built and checked, the browser rendering was not"
        )
    url = f"{page.as_uri()}#step=2"
    common = [f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=10000"]
    dumped = _chromium(*common, "--enable-logging=stderr", "--dump-dom", url)
    assert dumped.returncode == 0 and "<body" in dumped.stdout, dumped.stderr[-2000:]
    assert "Uncaught" not in dumped.stderr, [
        line for line in dumped.stderr.splitlines() if "CONSOLE" in line
    ]  # the page's JS ran clean
    dom = _Dom(chosen["step"], chosen["group_id"], chosen["index"])
    dom.feed(dumped.stdout)
    assert dom.step_rows == list(range(steps + 1))  # every step, 0 (the first push and eval) included
    assert dom.tokens == ["p"] * len(chosen["prompt"]["ids"]) + [f"m{m}" for m in chosen["response"]["mask"]]
    assert dom.rects.count("ph-rollout") == dom.rects.count("ph-train") == steps
    assert dom.rects.count("ph-push") == steps + 1 and dom.rects.count("ph-eval") == 2  # step 0 and the last
    assert dom.rects.count("ph-checkpoint") == 1 and dom.versions == [f"v{v}" for v in range(steps + 1)]

    shot = tmp_path / "view.png"
    taken = _chromium(*common, "--window-size=1400,1000", f"--screenshot={shot}", url)
    assert taken.returncode == 0 and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    if os.environ.get("SLIMISH_ARTIFACTS"):
        (ROOT / "test-artifacts").mkdir(exist_ok=True)
        shutil.copy(shot, ROOT / "test-artifacts" / "view.png")
