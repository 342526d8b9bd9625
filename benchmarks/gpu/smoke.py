"""Device smoke test: the GPU path end to end on one GPU, one line per check, exit 1 if one fails.

    python benchmarks/gpu/smoke.py --out runs/gpu-smoke     # on a GPU (target: under 8 minutes)
    python benchmarks/gpu/smoke.py --dry-run                # the same steps on CPU (the test suite runs it)

Steps, each printing `PASS name: detail`, `FAIL name: detail` or `SKIP name: reason`:

1. A small random-weight llama (`slimish make-tiny-model`; no downloads) or `--model PATH`.
2. One SGLang engine (`python -m sglang.launch_server`, bf16, `--mem-fraction-static` low so the
   trainers fit beside it). Without an importable `sglang` that check is a SKIP and the engine
   steps run on the built-in engine on the same GPU instead, so the rest still runs.
3. The torch trainer, then the Megatron trainer on the local spec and on the TE spec: each pushes
   its weights into the engine over a gloo group (gloo broadcasts CUDA tensors; NCCL refuses two
   ranks of one group on one GPU), takes one RL step on the engine's rollouts (train/inference
   mismatch below 1e-2, metrics finite), pushes again, and reads the served tensors back.
4. The torch trainer's LoRA adapter pushed into a LoRA-enabled engine behind a router (SGLang
   0.5.23 takes an adapter only from a directory, reloaded under an abort pause; the built-in
   engine by broadcast), checked through the engine's logprobs with and without it.
5. `slimish train` on the quickstart task (configs/quickstart.yaml, shortened; engine_kind of step
   2): weight versions served per step, finite rewards, mismatch below 1e-2. Then the same run
   with `launch.colocate=true` (`coloc_*`): SGLang on the trainer's GPU with
   `--enable-memory-saver`, its memory released while the trainer trains, the weights pushed as
   CUDA IPC handles (`/update_weights_from_tensor`); the mismatch bound is the check that it
   serves the trainer's weights. A dry run skips it (the double loads no IPC handles; the CPU
   form is tested in tests/test_colocate.py).
6. A random-weight Qwen3-MoE on an engine started with `--enable-return-routed-experts`: every
   reply's `meta_info.routed_experts` has SGLang's rows (prompt + output - 1, layers, top-k); the
   torch trainer pushes its experts under checkpoint names (served back equal) and takes one R3
   step on those rollouts (every route replayed, mismatch below the bound).

`--dry-run` runs all of it on the CPU in fp32: SGLang is the test double in tests/sglang_double
(a strict `sglang.launch_server` serving the built-in engine), the TE spec is skipped. The whole
run is bounded (`--budget`): the script runs itself in a new process group and kills that group
when it ends, however it ends, so no engine or trainer outlives it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOUBLE = ROOT / "tests" / "sglang_double"
CHILD = "SLIMISH_SMOKE_CHILD"
MISMATCH_MAX = 1e-2  # mean |trainer - engine| logprob per token, bf16 (the bound)
HTTP_TIMEOUT = 300.0


# -- the supervisor and the command line ------------------------------------------------------------


def supervise(argv: list[str], budget: float) -> int:
    """Runs this script again as the leader of a new process group, bounded by `budget` seconds;
    whatever it started is killed with the group when it ends."""
    proc = subprocess.Popen([sys.executable, __file__, *argv], env={**os.environ, CHILD: "1"}, start_new_session=True)
    try:
        return proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        print(f"FAIL budget: still running after {budget:.0f} s (--budget); stopped", flush=True)
        return 1
    except KeyboardInterrupt:
        print("FAIL budget: interrupted", flush=True)
        return 1
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty: nothing was left behind
            pass
        proc.wait()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, the SGLang double, no TE spec")
    parser.add_argument("--out", default="runs/gpu-smoke", help="model, logs and the RL run go here")
    parser.add_argument("--model", default=None, help="an HF llama/qwen directory instead of the random-weight one")
    parser.add_argument(
        "--sglang-path", default=None, help=f"prepended to PYTHONPATH for `sglang` (--dry-run default: {DOUBLE})"
    )
    parser.add_argument("--steps", type=int, default=None, help="RL steps of the quickstart run (default 3; dry run 2)")
    parser.add_argument(
        "--mem-fraction", type=float, default=0.3, help="SGLang's --mem-fraction-static (the trainers share the GPU)"
    )
    parser.add_argument(
        "--start-timeout", type=float, default=None, help="seconds an engine gets to start (default 600; dry run 180)"
    )
    parser.add_argument(
        "--rl-timeout", type=float, default=None, help="seconds the RL run gets (default 420; dry run 300)"
    )
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds the whole test gets (default 570; dry run 420)"
    )
    args = parser.parse_args(argv)
    args.out = str(Path(args.out).absolute())  # the RL run works in the repository root
    dry = args.dry_run
    if dry and args.sglang_path is None:
        args.sglang_path = str(DOUBLE)
    defaults = {
        "steps": (3, 2),
        "start_timeout": (600.0, 180.0),
        "rl_timeout": (420.0, 300.0),
        "budget": (570.0, 420.0),
    }
    for key, (gpu, cpu) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, cpu if dry else gpu)
    if dry and args.sglang_path and not (Path(args.sglang_path) / "sglang" / "launch_server.py").exists():
        parser.error(
            f"--sglang-path {args.sglang_path}: no sglang/launch_server.py there (the dry run's SGLang double)"
        )
    return args


if __name__ == "__main__" and not os.environ.get(CHILD):  # the supervisor imports nothing heavy
    sys.exit(supervise(sys.argv[1:], parse(sys.argv[1:]).budget))

import httpx  # noqa: E402
import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from slimish.config import RunConfig, load_run_config  # noqa: E402
from slimish.launch.commands import lora_launch, routing_replay_launch  # noqa: E402
from slimish.launch.config import LaunchConfig  # noqa: E402
from slimish.launch.local import engines_only, local_servers  # noqa: E402
from slimish.metrics import read_metrics  # noqa: E402
from slimish.rollout.api import sample_from_reply  # noqa: E402
from slimish.tiny_model import make_tiny_model  # noqa: E402
from slimish.trainer import make_trainer  # noqa: E402
from slimish.trainer.config import WeightSyncConfig  # noqa: E402
from slimish.trainer.weight_sync import WeightSync  # noqa: E402
from slimish.types import Sample  # noqa: E402

# -- check lines -----------------------------------------------------------------------------------


@dataclass
class Report:
    """The check lines, printed as they are decided."""

    started: float = field(default_factory=time.perf_counter)
    failed: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)

    def line(self, status: str, name: str, detail: str) -> None:
        self.done.add(name)
        if status == "FAIL":
            self.failed.append(name)
        print(f"{status} {name}: {detail}", flush=True)

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.line("PASS" if ok else "FAIL", name, detail)
        return ok

    def skip(self, name: str, reason: str) -> None:
        self.line("SKIP", name, reason)

    def progress(self, text: str) -> None:
        print(f".. {time.perf_counter() - self.started:6.1f}s {text}", flush=True)

    @contextmanager
    def guard(self, *names: str) -> Iterator[None]:
        """The checks `names` that an exception leaves undecided FAIL with it (traceback on stderr)."""
        try:
            yield
        except Exception as exc:
            traceback.print_exc()
            message = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
            for name in names:
                if name not in self.done:
                    self.line("FAIL", name, message)


# -- where things run ------------------------------------------------------------------------------


@dataclass
class Setup:
    """The engine under test and the run's numbers, fixed by the machine and `--dry-run`."""

    args: argparse.Namespace
    model: Path | None = None
    sglang_missing: str | None = None  # why SGLang is not the engine (None: it is)

    @property
    def dry_run(self) -> bool:
        return self.args.dry_run

    @property
    def dtype(self) -> str:
        """The engines' dtype (what served tensors are compared in); trainers take their defaults,
        bf16 on a GPU, fp32 on the CPU."""
        return "float32" if self.dry_run else "bfloat16"

    @property
    def engine(self) -> str:
        return "builtin engine on cuda:0" if self.sglang_missing else ("SGLang double" if self.dry_run else "SGLang")

    def launch(self) -> LaunchConfig:
        """The LaunchConfig of every engine the checks start (and of the RL run's)."""
        if self.sglang_missing:
            return LaunchConfig(
                engine_kind="builtin",
                engine_flag=["device=cuda:0", f"dtype={self.dtype}"],
                start_timeout=self.args.start_timeout,
            )
        # --base-gpu-id 0: beside the trainer (the launcher would place engines after its GPUs)
        sglang_args = [
            "--mem-fraction-static",
            str(self.args.mem_fraction),
            "--dtype",
            self.dtype,
            "--base-gpu-id",
            "0",
        ]
        return LaunchConfig(engine_kind="sglang", sglang_args=sglang_args, start_timeout=self.args.start_timeout)

    def sync_config(self, group: str) -> WeightSyncConfig:
        """gloo over the distributed transport, in several buckets (CUDA tensors on a GPU)."""
        return WeightSyncConfig(
            backend="gloo",
            transport="distributed",
            bucket_mb=0.25 if self.dry_run else 16.0,
            group_name=f"smoke-{group}",
            timeout_s=self.args.start_timeout,
        )

    def lora_sync_config(self) -> WeightSyncConfig:
        """An adapter push as a run makes it: SGLang 0.5.23 takes an adapter only from a directory,
        reloaded under an abort pause (config.py's SGLANG_LORA); the built-in engine by broadcast."""
        if self.sglang_missing:
            return self.sync_config("lora")
        return WeightSyncConfig(
            transport="disk",
            pause_mode="abort",
            disk_dir=str(Path(self.args.out) / "lora-pushes"),
            timeout_s=self.args.start_timeout,
        )

    def trainer_config(self, *overrides: str) -> RunConfig:
        return load_run_config(None, [f"model={self.model}", "data.source=unused", "trainer.lr=1e-3", *overrides])

    @property
    def shape(self) -> tuple[int, int, int]:
        """Rollouts of one direct check: prompts, samples per prompt, new tokens."""
        return (4, 4, 16) if self.dry_run else (8, 8, 32)


def sglang_import() -> tuple[str | None, str]:
    """(why `import sglang` fails or None, what imported), in a child: the import is heavy."""
    code = "import sglang; print(getattr(sglang, '__version__', '?'), sglang.__file__)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return "import sglang took over 180 s", ""
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        return f"import sglang failed ({lines[-1] if lines else f'exit {done.returncode}'})", ""
    return None, done.stdout.strip()


def importable(module: str) -> str | None:
    """Why `module` does not import (None: it does); for TE a broken CUDA library counts too."""
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{module} does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    return None


# -- talking to an engine --------------------------------------------------------------------------


def rollouts(
    url: str,
    prompts: list[list[int]],
    n: int,
    seed: int,
    max_new_tokens: int,
    lora: str | None = None,
    route_shape: tuple[int, int] | None = None,
) -> list[list[Sample]]:
    """`n` samples per prompt from the engine with its logprobs and versions (and its routes, with
    `route_shape`); reward: the first response token is even (any reward with spread within groups
    gives GRPO a gradient)."""
    groups = []
    with httpx.Client(timeout=HTTP_TIMEOUT) as http:
        for g, prompt in enumerate(prompts):
            params = [
                {"temperature": 1.0, "max_new_tokens": max_new_tokens, "sampling_seed": seed + g * n + k}
                for k in range(n)
            ]
            body = {
                "input_ids": [prompt] * n,
                "return_logprob": True,
                "sampling_params": params,
            }  # a seed each: n different samples
            if lora:
                body["lora_path"] = [lora] * n
            if route_shape:
                body["return_routed_experts"] = True
            outs = http.post(url + "/generate", json=body).raise_for_status().json()
            group = []
            for k, out in enumerate(outs):
                s = sample_from_reply(prompt, out, route_shape, group_id=g, index=k)
                s.reward = float(out["output_ids"][0] % 2 == 0)
                group.append(s)
            groups.append(group)
    return groups


def random_prompts(seed: int, count: int) -> list[list[int]]:
    """Token ids below 1000: ordinary tokens of every tiny model's vocabulary (tiny: 1024)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 1000) for _ in range(16)] for _ in range(count)]


def served_version(url: str, lora: str | None = None) -> str:
    """The weight version an engine reports on a response (SGLang and the built-in engine alike)."""
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, **({"lora_path": lora} if lora else {})}
    return (
        httpx.post(url + "/generate", json=body, timeout=HTTP_TIMEOUT)
        .raise_for_status()
        .json()["meta_info"]["weight_version"]
    )


def served_differs(url: str, tensors: dict[str, torch.Tensor], rows: int | None, dtype: str) -> list[str]:
    """Names whose served values (`/get_weights_by_name`: all rows, or the first `rows`) differ
    from `tensors` cast to the engine's `dtype`."""
    bad = []
    with httpx.Client(timeout=HTTP_TIMEOUT) as http:
        for name, t in tensors.items():
            want = t.detach()[: rows or t.shape[0]].to("cpu", getattr(torch, dtype)).float()
            got = (
                http.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": want.shape[0]})
                .raise_for_status()
                .json()
            )
            if got is None or not torch.equal(torch.tensor(got, dtype=torch.float32).view_as(want), want):
                bad.append(name)
    return bad


def finite(metrics: dict) -> list[str]:
    return [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]


def step_detail(metrics: dict) -> tuple[bool, str]:
    """Whether one train step's metrics pass: finite, and a mismatch below the bound."""
    bad = finite(metrics)
    mismatch = metrics.get("train/mismatch", float("nan"))
    ok = not bad and mismatch < MISMATCH_MAX
    detail = (
        f"train/mismatch {mismatch:.2e} (< {MISMATCH_MAX:g}), grad norm {metrics.get('train/grad_norm', float('nan')):.3g}, "
        f"reward std {metrics.get('reward/std', float('nan')):.3f}"
    )
    return ok, detail + (f"; not finite: {', '.join(bad)}" if bad else "")


def release() -> None:
    """Frees what a dropped trainer held (the GPU is shared with the engine)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the checks -------------------------------------------------------------------------------------


def check_model(report: Report, setup: Setup) -> None:
    with report.guard("model"):
        if setup.args.model:
            setup.model = Path(setup.args.model).absolute()
            report.check("model", (setup.model / "config.json").exists(), f"{setup.model} (--model)")
            return
        size = "tiny" if setup.dry_run else "small"  # small: head_dim 64, which SGLang's attention kernels take
        started = time.perf_counter()
        setup.model = make_tiny_model(Path(setup.args.out) / f"model-llama-{size}", arch="llama", size=size, seed=0)
        params = sum(t.numel() for t in load_file(str(setup.model / "model.safetensors")).values())
        report.check(
            "model",
            True,
            f"random-weight llama `{size}`, {params / 1e6:.1f}M params, built in "
            f"{time.perf_counter() - started:.1f} s ({setup.model})",
        )


def check_sglang(report: Report, setup: Setup) -> None:
    """SGLang imports (the double on a dry run); on a GPU without it the engine steps fall back."""
    with report.guard("sglang"):
        why, what = sglang_import()
        if why is None:
            report.check("sglang", True, f"`import sglang`: version {what}")
        elif setup.dry_run:
            report.check("sglang", False, f"{why}; the dry run needs the double (--sglang-path, default {DOUBLE})")
        else:
            setup.sglang_missing = why
            report.skip(
                "sglang", f"{why}: the engine steps run on the built-in engine on cuda:0 ({setup.dtype}) instead"
            )


def trainer_checks(report: Report, setup: Setup, url: str, name: str, versions: Iterator[int], *overrides: str) -> None:
    """`{name}_step`: one RL step on rollouts of the engine serving the trainer's pushed weights
    (mismatch, finite metrics). `{name}_push`: the stepped weights pushed; the engine reports the
    version and serves exactly the trainer's values (cast to its dtype), some changed by the step."""
    step, push = f"{name}_step", f"{name}_push"
    prompts, n, tokens = setup.shape
    rows = None if setup.dry_run else 4  # SGLang lists whole tensors in JSON: the first rows do
    with report.guard(step, push):
        report.progress(f"{name}: building the trainer")
        cfg = setup.trainer_config(*overrides)
        trainer = make_trainer(cfg)
        fused = (
            sum(k.endswith("linear_qkv.layer_norm_weight") for k in trainer.model.state_dict())
            if cfg.trainer.backend == "megatron"
            else 0
        )
        with WeightSync(setup.sync_config(name), [url]) as sync:
            first = next(versions)
            sync.push(trainer.export(), first)
            before = {k: t[: rows or t.shape[0]].clone() for k, t in trainer.hf_tensors()}
            report.progress(f"{name}: pushed version {first}; rollouts and one train step")
            groups = rollouts(url, random_prompts(first, prompts), n, first * 1000, tokens)
            metrics = trainer.train_step(groups, 1)
            ok, detail = step_detail(metrics)
            if cfg.trainer.megatron_spec == "te" and cfg.trainer.backend == "megatron":
                ok = ok and fused > 0
                detail += f"; {fused} linear_qkv.layer_norm_weight (TE's fused pre-norms)"
            report.check(step, ok, f"{detail}; {sum(map(len, groups))} samples from the {setup.engine}")
            second = next(versions)
            pushed = sync.push(trainer.export(), second)
            after = dict(trainer.hf_tensors())
            bad = served_differs(url, after, rows, setup.dtype)
            version = served_version(url)
            dtype = getattr(torch, setup.dtype)
            changed = sum(not after[k][: rows or after[k].shape[0]].to(dtype).equal(before[k].to(dtype)) for k in after)
            device = next(iter(after.values())).device
            report.check(
                push,
                not bad and version == str(second) and changed > 0,
                f"{len(after) - len(bad)}/{len(after)} tensors served as the trainer's ({'all' if rows is None else f'first {rows}'} rows, "
                f"{setup.dtype}), {changed} changed by the step; version {version!r} (pushed {second}); {device} tensors over gloo, "
                f"{int(pushed['buckets'])} buckets, {pushed['seconds']:.2f} s"
                + (f"; differ: {', '.join(bad[:4])}" if bad else ""),
            )
        del trainer
        release()


def engine_checks(report: Report, setup: Setup) -> None:
    """Start one engine of the kind under test; the torch and Megatron trainers push into it."""
    names = [
        "torch_step",
        "torch_push",
        "megatron_local_step",
        "megatron_local_push",
        "megatron_te_step",
        "megatron_te_push",
    ]
    with report.guard("engine", *names):
        report.progress(f"starting the {setup.engine} (logs in {Path(setup.args.out) / 'logs-engine'})")
        started = time.perf_counter()
        with engines_only(setup.launch(), setup.model, Path(setup.args.out) / "logs-engine") as engines:
            url = engines[0].url
            launch = setup.launch()
            report.check(
                "engine",
                True,
                f"{setup.engine} healthy in {time.perf_counter() - started:.1f} s at {url} "
                f"({' '.join(launch.sglang_args or launch.engine_flag)})",
            )
            versions = iter(range(1, 100))
            trainer_checks(report, setup, url, "torch", versions, "trainer.backend=torch")
            megatron_missing = importable("megatron.core")
            for spec in ("local", "te"):
                name = f"megatron_{spec}"
                why = megatron_missing
                if why is None and spec == "te":
                    why = "dry run: TE's spec needs CUDA" if setup.dry_run else importable("transformer_engine.pytorch")
                if why:
                    report.skip(f"{name}_step", why)
                    report.skip(f"{name}_push", why)
                    continue
                trainer_checks(
                    report, setup, url, name, versions, "trainer.backend=megatron", f"trainer.megatron_spec={spec}"
                )


def lora_checks(report: Report, setup: Setup) -> None:
    """`lora_step`: one RL step of the torch trainer under an adapter, on rollouts of the engine
    serving that adapter. `lora_push`: the stepped adapter pushed; the engine reports its version
    under the adapter, and its logprobs with the adapter are the trainer's (mismatch below the
    bound) while the base model's are not (differ by more than the bound: an engine ignoring the
    adapter fails). lr 0.05: one step must move the adapter that far."""
    prompts, n, tokens = setup.shape
    with report.guard("lora_step", "lora_push"):
        cfg = setup.trainer_config("trainer.backend=torch", "trainer.lora.enabled=true", "trainer.lr=0.05")
        adapter = cfg.trainer.lora.adapter
        launch = lora_launch(setup.launch(), cfg.trainer.lora)
        report.progress(
            f"starting a LoRA-enabled {setup.engine} and a router (logs in {Path(setup.args.out) / 'logs-lora'})"
        )
        with local_servers(launch, setup.model, Path(setup.args.out) / "logs-lora") as servers:
            url = servers.engine_urls[0]
            trainer = make_trainer(cfg)
            sync_cfg = setup.lora_sync_config()
            with WeightSync(sync_cfg, [url], adapter=adapter, router_url=servers.router_url) as sync:
                sync.push(trainer.export(), 1)
                report.progress("lora: adapter version 1 pushed; rollouts and one train step")
                groups = rollouts(url, random_prompts(1, prompts), n, 1000, tokens, lora=adapter)
                ok, detail = step_detail(trainer.train_step(groups, 1))
                report.check("lora_step", ok, f"{detail}; {sum(map(len, groups))} samples under adapter {adapter!r}")
                pushed = sync.push(trainer.export(), 2)
                samples = [
                    s for g in rollouts(url, random_prompts(2, prompts), n, 2000, tokens, lora=adapter) for s in g
                ]
                served = [torch.tensor(s.rollout_logprobs) for s in samples]
                mine = [t.float().cpu() for t in trainer.logprobs(samples)]
                base = [t.float().cpu() for t in trainer.logprobs(samples, model=trainer.ref)]  # the adapter off
                tokens_n = sum(len(t) for t in served)
                mismatch = sum((a - b).abs().sum().item() for a, b in zip(mine, served)) / tokens_n
                gap = sum((a - b).abs().sum().item() for a, b in zip(mine, base)) / tokens_n
                version = served_version(url, lora=adapter)
                # An engine serving the base instead would show a mismatch of about `gap`: above the bound.
                report.check(
                    "lora_push",
                    version == "2" and mismatch < MISMATCH_MAX < gap,
                    f"version {version!r} under the adapter (pushed 2); engine vs trainer with the adapter {mismatch:.2e} "
                    f"(< {MISMATCH_MAX:g}), base vs adapter {gap:.2e} (> {MISMATCH_MAX:g}); pushed by {sync_cfg.transport} "
                    f"(pause {sync_cfg.pause_mode}) in {pushed['seconds']:.2f} s",
                )
            del trainer
            release()


def moe_checks(report: Report, setup: Setup) -> None:
    """`moe_routes`: an engine started returning routes answers each rollout with SGLang's rows
    (`[prompt + output - 1, layers, top_k]`, expert ids in range). `moe_r3_step`: one R3 step of
    the torch trainer on them (every route replayed, mismatch below the bound). `moe_push`: the
    stepped experts pushed under checkpoint names and served back equal."""
    names = ("moe_routes", "moe_r3_step", "moe_push")
    prompts, n, tokens = setup.shape
    with report.guard(*names):
        size = "tiny" if setup.dry_run else "small"  # small: head_dim 64, experts 192 wide (SGLang's kernels)
        model = make_tiny_model(Path(setup.args.out) / f"model-qwen3_moe-{size}", arch="qwen3_moe", size=size, seed=0)
        cfg = load_run_config(
            None, [f"model={model}", "data.source=unused", "trainer.lr=1e-3", "algorithm.routing_replay=r3"]
        )
        launch = routing_replay_launch(setup.launch(), cfg.algorithm)
        report.progress(
            f"moe: starting a {setup.engine} returning routes ({' '.join(launch.sglang_args or launch.engine_flag)})"
        )
        with engines_only(launch, model, Path(setup.args.out) / "logs-moe") as engines:
            url = engines[0].url
            trainer = make_trainer(cfg)
            layers, top_k = trainer.routes.layers, trainer.routes.top_k
            with WeightSync(setup.sync_config("moe"), [url]) as sync:
                sync.push(trainer.export(), 1)
                groups = rollouts(url, random_prompts(1, prompts), n, 1000, tokens, route_shape=(layers, top_k))
                samples = [s for g in groups for s in g]
                shapes = {s.routed_experts.shape == (len(s.tokens) - 1, layers, top_k) for s in samples}
                in_range = all(
                    0 <= int(s.routed_experts.min()) and int(s.routed_experts.max()) < trainer.routes.experts
                    for s in samples
                )
                report.check(
                    "moe_routes",
                    shapes == {True} and in_range,
                    f"{len(samples)} replies, routes [prompt + output - 1, {layers}, {top_k}] each: {shapes == {True}}, "
                    f"expert ids below {trainer.routes.experts}: {in_range}",
                )
                metrics = trainer.train_step(groups, 1)
                ok, detail = step_detail(metrics)
                replayed, agreement = metrics.get("train/route_replayed"), metrics.get("train/route_agreement")
                report.check(
                    "moe_r3_step",
                    ok and replayed == 1.0,
                    f"{detail}; train/route_replayed {replayed}, train/route_agreement {agreement}",
                )
                sync.push(trainer.export(), 2)
                after = dict(trainer.hf_tensors())
                experts = {k: v for k, v in after.items() if ".experts." in k}
                rows = None if setup.dry_run else 4
                bad = served_differs(url, experts, rows, setup.dtype)
                report.check(
                    "moe_push",
                    not bad and served_version(url) == "2",
                    f"{len(experts) - len(bad)}/{len(experts)} expert tensors (checkpoint names) served as the "
                    f"trainer's" + (f"; differ: {', '.join(bad[:4])}" if bad else ""),
                )
            del trainer
            release()


def rl_checks(report: Report, setup: Setup, colocate: bool = False) -> None:
    """`slimish train` on the quickstart task, shortened, with the engines of the kind under test.
    `colocate` (`coloc_*`): `launch.colocate=true`, on a GPU SGLang's form (the engine on the
    trainer's GPU releases its memory while the trainer trains and takes the weights as CUDA IPC
    handles); skipped on a dry run (the double loads no IPC handles).
    The served weights equal the trainer's when each step's mismatch is below the bound: the
    engine computed the rollout's logprobs with the weights pushed before it."""
    prefix = "coloc" if colocate else "rl"
    names = tuple(f"{prefix}_{check}" for check in ("run", "versions", "rewards", "mismatch"))
    out = Path(setup.args.out).absolute()
    if colocate and (setup.sglang_missing or setup.dry_run):
        why = (
            "dry run: the double loads no CUDA IPC handles"
            if setup.dry_run
            else f"needs SGLang ({setup.sglang_missing})"
        )
        for name in names:
            report.skip(name, f"the GPU form of launch.colocate: {why} (the CPU form: tests/test_colocate.py)")
        return
    with report.guard(*names):
        launch = setup.launch()
        steps = setup.args.steps
        prompts, n = (4, 4) if setup.dry_run else (8, 8)
        run_dir = out / f"{prefix}-{int(time.time())}"
        values = {
            "model": str(setup.model),
            "run_dir": str(run_dir),
            "steps": steps,
            "launch": {
                "engine_kind": launch.engine_kind,
                "sglang_args": launch.sglang_args,
                "engine_flag": launch.engine_flag,
                "start_timeout": launch.start_timeout,
                "colocate": colocate,
            },
            "rollout": {
                "rollout_batch_size": prompts,
                "n_samples_per_prompt": n,
                "filter_fn": None,
            },  # random weights: rewards rarely vary
            "sft": {"steps": 0},
            "eval": {"every": 0},
            "checkpoint": {"every": 0},
            "weight_sync": {"backend": "gloo", "transport": "distributed", "timeout_s": launch.start_timeout},
        }
        config = out / f"{prefix}.yaml"
        OmegaConf.save(OmegaConf.merge(OmegaConf.load(ROOT / "configs" / "quickstart.yaml"), values), config)
        argv = [sys.executable, "-m", "slimish.cli", "train", "--config", str(config)]
        report.progress(f"{prefix}: {' '.join(argv[1:])} ({launch.engine_kind} engine; logs in {run_dir / 'logs'})")
        started = time.perf_counter()
        with open(out / f"{prefix}.log", "w") as log:
            done = subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=setup.args.rl_timeout)
        wall = time.perf_counter() - started
        rows = [r for r in read_metrics(run_dir) if r["step"] >= 1] if (run_dir / "metrics.jsonl").exists() else []
        timing = ", ".join(
            f"step {r['step']} rollout {r.get('time/rollout', 0):.1f} s train {r.get('time/train', 0):.1f} s "
            f"push {r.get('time/weight_push', 0):.2f} s"
            for r in rows
        )
        tail = (
            ""
            if done.returncode == 0
            else "; log tail: " + " | ".join((out / f"{prefix}.log").read_text(errors="replace").splitlines()[-3:])
        )
        report.check(
            names[0],
            done.returncode == 0 and len(rows) == steps,
            f"exit {done.returncode}, {len(rows)}/{steps} steps in {wall:.1f} s ({timing}){tail}",
        )
        trained_file = run_dir / "trained_prompts.jsonl"
        trained = [json.loads(line) for line in trained_file.read_text().splitlines()] if trained_file.exists() else []
        wrong = [
            f"step {t['step']}: {t['versions']}" for t in trained if any(v != [t["step"] - 1] for v in t["versions"])
        ]
        report.check(
            names[1],
            len(trained) == steps and not wrong,
            f"{len(trained)} steps, each trained on samples of the version pushed before it (step k: k-1)"
            + (f"; wrong: {'; '.join(wrong[:3])}" if wrong else ""),
        )
        rewards = [(r.get("reward/mean", float("nan")), r.get("reward/std", float("nan"))) for r in rows]
        report.check(
            names[2],
            bool(rows) and all(math.isfinite(m) and math.isfinite(s) for m, s in rewards),
            "reward/mean, reward/std per step: " + ", ".join(f"{m:.3f}/{s:.3f}" for m, s in rewards),
        )
        mismatches = [r.get("train/mismatch", float("nan")) for r in rows]
        report.check(
            names[3],
            bool(rows) and all(m < MISMATCH_MAX for m in mismatches),
            f"train/mismatch per step (< {MISMATCH_MAX:g}): " + ", ".join(f"{m:.2e}" for m in mismatches),
        )


# -- entry point ------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    report = Report()
    setup = Setup(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a machine with a GPU
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [args.sglang_path, os.environ.get("PYTHONPATH")] if p)
    if not args.dry_run and not torch.cuda.is_available():
        report.check("device", False, "no CUDA device: on a CPU machine run it with --dry-run")
        return 1
    where = "CPU, fp32 (dry run)" if args.dry_run else f"cuda:0 {torch.cuda.get_device_name(0)}, bf16"
    report.check("device", True, f"{where}; torch {torch.__version__}")
    check_model(report, setup)
    if setup.model is None or "model" in report.failed:
        return 1
    check_sglang(report, setup)
    if "sglang" in report.failed:
        return 1
    engine_checks(report, setup)
    lora_checks(report, setup)
    rl_checks(report, setup)
    rl_checks(report, setup, colocate=True)
    moe_checks(report, setup)
    print(
        f"{'FAILED: ' + ', '.join(report.failed) if report.failed else 'all checks passed'} "
        f"({time.perf_counter() - report.started:.1f} s)",
        flush=True,
    )
    return 1 if report.failed else 0


if __name__ == "__main__":  # the supervisor's child: the guard above ran the supervisor
    sys.exit(run(parse(sys.argv[1:])))
