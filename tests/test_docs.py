"""The documentation is tested: every code block of README.md and docs/*.md is run or checked.

The convention (docs/index.md, "Code blocks on these pages"):
- ```python blocks run, in order, in one namespace per page, in a fresh temporary directory that
  holds `model/` (a tiny HF llama, as the `tiny_model_dir` fixture builds it) and the
  repository's `configs/`;
- ```bash blocks are checked: each `slimish SUB ...` command (and `-m slimish.train ...`) is
  parsed by SUB's own argument parser, after `slimish SUB --help` ran, so every flag exists and
  takes its value, and each `key=value` of `train` / `rollout` names a real config key;
- `<!-- docs: skip REASON -->` on the line before a fence: parsed only (python: compile()) —
  for GPU, multi-node or long runs; `<!-- docs: run -->` before a bash block runs it in the page's
  directory (bounded); `<!-- docs: config -->` before a ```yaml block loads it into RunConfig.
The session's summary line says how many blocks ran and how many were checked (conftest.py).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import typing
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import DOCS_COUNTS
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SLOW_PAGES = {"tutorial.md": 900}  # pages whose blocks may take minutes (the convention): their time limit, s
RUN_TIMEOUT_S = 120  # a page's blocks together, elsewhere: "a block must finish in seconds"
MARKER = re.compile(r"<!--\s*docs:\s*(skip|run|config)\b\s*(.*?)\s*-->")


@pytest.fixture
def counts(record_property: Callable[[str, object], None]) -> Iterator[Counter[str]]:
    """What a test ran or checked, reported to the session's summary line (conftest.py), which
    adds up the reports of every pytest-xdist worker."""
    counted: Counter[str] = Counter()
    yield counted
    record_property(DOCS_COUNTS, dict(counted))


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the block's first code line on the page
    lang: str
    code: str
    marker: str | None  # skip | run | config | None
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the marker on the line before each, if any."""
    tokens = MarkdownIt("commonmark").parse(page.read_text())
    found = []
    for i, tok in enumerate(tokens):
        if tok.type != "fence":
            continue
        marker = reason = None
        prev = tokens[i - 1] if i else None
        if (
            prev is not None
            and prev.type == "html_block"
            and prev.map[1] == tok.map[0]
            and (m := MARKER.search(prev.content))
        ):
            marker, reason = m.group(1), m.group(2)
        found.append(
            Block(page, tok.map[0] + 2, tok.info.split()[0] if tok.info else "", tok.content, marker, reason or "")
        )
    return found


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ---- bash: commands checked against the real argument parsers --------------------------------


def commands(code: str) -> list[tuple[int, list[str]]]:
    """(line offset, argv) of each shell command in a block: continuations joined, comments
    dropped, split at `&&`, `;` and `|`."""
    out, pending, start = [], "", 0
    for n, line in enumerate(code.splitlines()):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(pending + line, comments=True)
        pending, argv = "", []
        for w in [*words, ";"]:
            if w in ("&&", ";", "|", "||"):
                if argv:
                    out.append((start, argv))
                argv = []
            else:
                argv.append(w)
    return out


def slimish_argv(argv: list[str]) -> tuple[str, list[str]] | None:
    """(subcommand, its arguments) when `argv` runs slimish: `slimish SUB ...` (any path to the
    script) or `... -m slimish.train ...` (torchrun, python)."""
    if argv and Path(argv[0]).name == "slimish":
        return (argv[1], argv[2:]) if len(argv) > 1 else ("", [])
    if "slimish.train" in argv and argv[argv.index("slimish.train") - 1] == "-m":
        return "train", argv[argv.index("slimish.train") + 1 :]
    return None


def parser_of(sub: str) -> argparse.ArgumentParser:
    """SUB's parser as `slimish SUB` builds it; `slimish SUB --help` must work (checked here)."""
    from slimish import cli

    assert sub in cli.COMMANDS, f"`slimish {sub}`: no such subcommand (there are {', '.join(cli.COMMANDS)})"
    out, code = io.StringIO(), None
    with contextlib.redirect_stdout(out):
        try:
            cli.main([sub, "--help"])
        except SystemExit as exc:
            code = exc.code
    assert code == 0 and f"slimish {sub}" in out.getvalue(), f"`slimish {sub} --help` failed"
    parser = argparse.ArgumentParser(prog=f"slimish {sub}", exit_on_error=False, allow_abbrev=False)
    cli.command(sub).add_arguments(parser)
    return parser


def config_key_error(key: str) -> str | None:
    """Why `key` (dotted) is not a RunConfig key, or None when it is one."""
    from slimish.config import RunConfig

    schema: typing.Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(schema)}
        if part not in fields:
            return f"{'.'.join(parts[: i + 1])} is not a config key (in this section: {', '.join(fields)})"
        hint = typing.get_type_hints(schema)[part]
        last = i == len(parts) - 1
        if typing.get_origin(hint) is dict or hint is dict:
            return None  # free-form (rollout.args, chat_template_kwargs): any key below
        if dataclasses.is_dataclass(hint):
            if last:
                return f"{key} is a section, not a value"
            schema = hint
        elif not last:
            return f"{'.'.join(parts[: i + 1])} is a value, not a section"
    return None


def check_command(sub: str, args: list[str], parsers: dict[str, argparse.ArgumentParser]) -> None:
    if sub not in parsers:
        parsers[sub] = parser_of(sub)
    parser = parsers[sub]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parsed = parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            why = (err.getvalue().strip().splitlines() or [str(exc)])[-1]  # argparse's error line, not its usage
            raise AssertionError(f"`slimish {sub}` refuses {shlex.join(args)!r}: {why}") from None
    for override in getattr(parsed, "overrides", None) or []:
        key, eq, _ = override.partition("=")
        assert eq, f"`slimish {sub}`: {override!r} is not key=value"
        assert (why := config_key_error(key)) is None, f"`slimish {sub}` override {override!r}: {why}"


def check_config(block: Block) -> None:
    """A `<!-- docs: config -->` YAML block loads into RunConfig (model and data.source, which
    have no default, are filled in when the block leaves them out)."""
    from slimish.config import load_run_config

    values = yaml.safe_load(block.code)
    assert isinstance(values, dict), "a config block is a YAML mapping of RunConfig keys"
    values.setdefault("model", "model")
    values.setdefault("data", {}).setdefault("source", "task:max_digit")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump(values))
        f.flush()
        try:
            load_run_config(f.name)
        except SystemExit as exc:
            raise AssertionError(str(exc)) from None


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=page_id)
def test_commands_and_configs(page: Path, counts: Counter[str]) -> None:
    """Every slimish command in a bash block parses with that subcommand's parser, every
    override names a config key; every config block validates."""
    parsers: dict[str, argparse.ArgumentParser] = {}
    failures = []
    for block in blocks(page):
        if block.marker == "skip" and not block.reason:
            failures.append(f"{block.where}: `<!-- docs: skip REASON -->` needs its reason")
        if (block.marker, block.lang) in (("run", "python"), ("run", "yaml")) or (
            block.marker == "config" and block.lang != "yaml"
        ):
            failures.append(f"{block.where}: `docs: {block.marker}` does not apply to a {block.lang or 'plain'} block")
        if block.lang == "bash":
            try:
                parsed = commands(block.code)
            except ValueError as exc:  # shlex: an unclosed quote
                failures.append(f"{block.where}: not shell syntax: {exc}")
                continue
            for offset, argv in parsed:
                if (found := slimish_argv(argv)) is None:
                    continue
                try:
                    check_command(*found, parsers)
                    counts["commands checked"] += 1
                except AssertionError as exc:
                    failures.append(f"{block.page.relative_to(ROOT)}:{block.line + offset}: {exc}")
        elif block.lang == "yaml" and block.marker == "config":
            try:
                check_config(block)
                counts["configs validated"] += 1
            except AssertionError as exc:
                failures.append(f"{block.where}: {exc}")
        elif block.lang == "python" and block.marker == "skip":
            try:
                compile(block.code, block.where, "exec")
                counts["python parsed"] += 1
            except SyntaxError as exc:
                failures.append(f"{block.where}: {exc}")
    assert not failures, "\n".join(failures)


# ---- python and `docs: run` bash blocks: run in a page's own directory ------------------------

DRIVER = r"""
import json, subprocess, sys, traceback
namespace = {"__name__": "__main__"}
for b in json.load(open(sys.argv[1])):
    print(f"--- {b['where']} ({b['lang']})", flush=True)
    if b["lang"] == "python":
        try:
            exec(compile("\n" * (b["line"] - 1) + b["code"], b["page"], "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            sys.exit(f"FAILED: the python block at {b['where']}")
    else:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", b["code"]], timeout=b["timeout"])
        if done.returncode:
            sys.exit(f"FAILED: the bash block at {b['where']} exited {done.returncode}")
"""


def runnable(page: Path) -> list[Block]:
    return [
        b
        for b in blocks(page)
        if (b.lang == "python" and b.marker != "skip") or (b.lang == "bash" and b.marker == "run")
    ]


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(p, marks=[pytest.mark.slow, pytest.mark.timeout(SLOW_PAGES[p.name] + 60)])
        if p.name in SLOW_PAGES
        else p
        for p in PAGES
        if runnable(p)
    ],
    ids=page_id,
)
def test_code_runs(page: Path, tiny_model_dir: Path, tmp_path: Path, counts: Counter[str]) -> None:
    """A page's python blocks run in order in one namespace (`<!-- docs: run -->` bash blocks in
    between), in a fresh directory holding `model/` and `configs/`; none may fail."""
    blocks_to_run = runnable(page)
    (tmp_path / "model").symlink_to(tiny_model_dir)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # so `--config configs/...` runs as from the repository
    timeout = SLOW_PAGES.get(page.name, RUN_TIMEOUT_S)
    (tmp_path / ".blocks.json").write_text(
        json.dumps(
            [
                {
                    "where": b.where,
                    "page": str(page),
                    "line": b.line,
                    "lang": b.lang,
                    "code": b.code,
                    "timeout": timeout,
                }
                for b in blocks_to_run
            ]
        )
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, ".blocks.json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout + 30,
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    for b in blocks_to_run:
        counts[f"{b.lang} run"] += 1


# ---- the site, the README, the generated page -------------------------------------------------


def test_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: every page in the nav exists, every link and anchor resolves."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, "\n".join(line for line in done.stderr.splitlines() if "INFO" not in line)[-4000:]


def test_configuration_page_is_the_schema() -> None:
    """docs/configuration.md is what `python -m slimish.docs_config` writes from the config schemas."""
    from slimish.docs_config import render

    assert (ROOT / "docs" / "configuration.md").read_text() == render(), (
        "docs/configuration.md is out of date: run `.venv/bin/python -m slimish.docs_config > docs/configuration.md`"
    )


def test_readme_is_a_short_guide() -> None:
    """At most 200 lines, and its first two commands are `make demo` and `make test`."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first = [argv for b in blocks(ROOT / "README.md") if b.lang == "bash" for _, argv in commands(b.code)][:2]
    assert first == [["make", "demo"], ["make", "test"]], first


# Built in pieces so that this file does not match itself.
OUTSIDE = re.compile(
    "|".join([re.escape("../" + "shared"), "notes" + "/", re.escape("/" + "work/"), "PROTOCOL" + r"\.md"])
)


def test_nothing_refers_outside_the_repository() -> None:
    """No file of the repository cites a path a clone does not have (the protocol is docs/protocol.md)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    hits = []
    for name in files:
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".safetensors", ".model", ".tiktoken"):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{n}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


# ---- the README's rollout function trains with the README's command ---------------------------


def readme_example() -> tuple[str, list[str]]:
    """The README's rollout function (the python block that defines `rollout`) and the bash
    command that trains it (the `slimish train` line with `--rollout-fn`)."""
    readme = blocks(ROOT / "README.md")
    code = next(b.code for b in readme if b.lang == "python" and "async def rollout(ctx, sample)" in b.code)
    argv = next(argv for b in readme if b.lang == "bash" for _, argv in commands(b.code) if "--rollout-fn" in argv)
    return code, argv


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the shared SFT warm start, when this test is the first to need it
def test_readme_rollout_function_trains(tmp_path: Path, quickstart_sft: Path) -> None:
    """The README's command, with the README's function saved where it says, shortened to 3
    steps from the quickstart's SFT warm start: the run trains on the function's samples (its
    metadata is on them), pushes each step's weights, and the rewards are the function's."""
    code, argv = readme_example()
    fn_arg = argv[argv.index("--rollout-fn") + 1]
    (tmp_path / fn_arg.partition(":")[0]).write_text(code)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "slimish.cli",
        *argv[1:],
        f"model={quickstart_sft}",
        "sft.steps=0",
        "steps=3",
        "eval.every=0",
        "checkpoint.every=0",
        f"run_dir={run_dir}",
    ]
    done = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    from slimish.metrics import read_metrics

    rows = {r["step"]: r for r in read_metrics(run_dir)}
    assert all(s in rows and rows[s]["time/weight_push"] > 0 for s in (1, 2, 3)), sorted(rows)
    samples = [json.loads(line) for line in (run_dir / "view" / "samples.jsonl").read_text().splitlines()]
    assert samples and all("answer" in s["metadata"] for s in samples)  # the README function made them
    scored = {
        round(s["reward"] - s["metadata"].get("overlong_penalty", 0.0), 6) for s in samples
    }  # the function's own reward
    assert scored == {0.0, 1.0}, scored  # trained groups are those with mixed rewards
    assert all(
        s["reward"] - s["metadata"].get("overlong_penalty", 0.0) == 0.0
        for s in samples
        if s["metadata"]["answer"] is None
    )
