"""The training loop: `torchrun --nproc-per-node N -m slimish.train --config C --rollout-fn F [key=value ...]`.

Every rank runs the same loop. Rank 0's side of it is the `Driver`: it owns the engines and router
(started here unless `launch.router_url` names running ones), the rollout manager (asyncio, on a
background thread), weight sync, metrics and checkpoints; the other ranks' side is a `Follower`
(slimish/trainer/follower.py), which only joins the collectives. Every rank holds the policy and
trains on its share of each batch. One step, in sync mode:

    rollout (rank 0) -> broadcast the batch -> train_step (all ranks) -> push weights (rank 0)

In async mode (`async_training: true`, `buffer.max_staleness` >= 1) the rollout never stops: the manager
produces groups on its thread while the trainer trains, and a step starts by taking a batch no
staler than the bound from the buffer (waiting only when there is none yet).

`slimish train ...` is the same loop; it launches torchrun itself when `trainer.nproc` > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import transformers

from slimish.buffer import Buffer, Staleness
from slimish.compat import load_function
from slimish.config import RunConfig, document_run_config, load_run_config
from slimish.launch import Servers, check_push_targets, start_servers, teacher_servers
from slimish.launch.commands import run_launch
from slimish.launch.cpus import place_this_rank, usable_cpus
from slimish.launch.elastic import Fleet
from slimish.launch.plan import ASSUMED, check_placement, first_free_gpu, next_gpu, teacher_launch
from slimish.launch.workers import key_client
from slimish.loop_thread import LoopThread
from slimish.metrics import RunLog
from slimish.plugins import LoadError
from slimish.rollout.api import RolloutRuntime
from slimish.rollout.data import PromptData
from slimish.rollout.evaluation import eval_sets
from slimish.rollout.functions import RolloutFunctions
from slimish.rollout.manager import RolloutManager
from slimish.rollout.stats import RolloutFailing, RolloutStalled
from slimish.trainer import checkpoint, make_trainer
from slimish.trainer.base import Trainer
from slimish.trainer.colocated import ColocatedSync
from slimish.trainer.colocated_sglang import SGLangColocatedSync
from slimish.trainer.follower import Follower
from slimish.trainer.sft import ptx_batches, sft_batches
from slimish.trainer.weight_sync import PolicySyncs, WeightSync
from slimish.types import Sample
from slimish.view import ViewWriter

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file of RunConfig values")
    parser.add_argument("--rollout-fn", default=None, help="module:function or path/to/file.py:function")
    parser.add_argument("--reward-fn", default=None)
    parser.add_argument("--filter-fn", default=None)
    parser.add_argument("--resume", default=None, help="auto (newest checkpoint in run_dir) or a checkpoint directory")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="RunConfig overrides, e.g. rollout.temperature=0.7"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="start nothing, load no weights: print where the trainer ranks and engines would go, the parallel sizes, "
        "memory per GPU and the engines' command lines; fail on sizes that do not fit",
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help=f"--dry-run: GPUs per node (default: this machine's, else {ASSUMED.gpus_per_node})",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help=f"--dry-run: memory of one GPU (default: this machine's, else {ASSUMED.gpu_memory_gib:g})",
    )
    document_run_config(parser)


def config_of(args: argparse.Namespace) -> RunConfig:
    named = {
        "rollout.rollout_fn": args.rollout_fn,
        "rollout.reward_fn": args.reward_fn,
        "rollout.filter_fn": args.filter_fn,
        "checkpoint.resume": args.resume,
    }
    return load_run_config(args.config, args.overrides, **named)


class Driver:
    """Rank 0's side of the loop: rollouts, weight pushes, evaluation, metrics, checkpoints."""

    def __init__(
        self, cfg: RunConfig, fns: RolloutFunctions, servers: Servers, stack: ExitStack, start_step: int, world: int
    ) -> None:
        self.cfg, self.world = cfg, world
        self.teacher: Servers | None = None  # on-policy distillation's teacher: never pushed to
        if cfg.algorithm.opd.coef > 0:  # its local GPU engines go after the policy's
            first = first_free_gpu(cfg, torch.cuda.is_available())
            self.teacher = stack.enter_context(
                teacher_servers(
                    cfg.launch, Path(cfg.run_dir) / "logs" / "teacher", servers.router_url, next_gpu(cfg.launch, first)
                )
            )
        self.loop = LoopThread("rollout")
        stack.callback(self.loop.close)
        teacher_url = self.teacher.router_url if self.teacher else None
        self.runtime = self.loop.run(RolloutRuntime.create(cfg, servers.router_url, teacher_url))
        stack.callback(lambda: self.loop.run(self.runtime.close()))
        self.manager = RolloutManager(self.runtime, PromptData(cfg.data), Buffer(Staleness.of(cfg.buffer)), fns)
        self.eval_sets = eval_sets(cfg, fns.rollout_fn, fns.reward_fn, load_function)
        self.servers = servers
        self.http = stack.enter_context(key_client(cfg.launch.api_key))  # the fleet's reads, every push
        self.router_restarts = 0
        self.sync = self._weight_sync(servers.engine_urls)
        stack.callback(lambda: self.sync.close())  # the one in use then: a restart replaces it
        self.run_log = RunLog(cfg.run_dir, cfg.steps, start_step, wandb=cfg.metrics.wandb, config=cfg)
        stack.callback(self.run_log.close)
        self.trained = open(Path(cfg.run_dir) / "trained_prompts.jsonl", "a")
        stack.callback(self.trained.close)
        self.view = ViewWriter(cfg.run_dir, cfg.metrics.view_groups, cfg.model)  # RUN_DIR/view/: `slimish view`
        stack.callback(self.view.close)

    def _weight_sync(self, engine_urls: list[str]) -> WeightSync | PolicySyncs | ColocatedSync | SGLangColocatedSync:
        """The push into the policy's engines, and only theirs (never the teacher's); with
        `policies`, one per policy (each its adapter); with `launch.colocate`, a version flip."""
        check_push_targets(engine_urls, self.teacher.engine_urls if self.teacher else [])
        scratch = Path(self.cfg.run_dir) / "weights"  # pushes written to disk, when weight_sync.disk_dir is unset
        if self.cfg.policies:
            names = [p.name for p in self.cfg.policies]
            return PolicySyncs(
                self.cfg.weight_sync, engine_urls, self.cfg.launch.api_key, names, self.servers.router_url, scratch
            )
        sync = WeightSync(
            self.cfg.weight_sync,
            engine_urls,
            self.cfg.launch.api_key,
            self.cfg.trainer.lora.adapter,
            self.servers.router_url,
            scratch,
        )
        if self.cfg.launch.colocate and self.cfg.launch.engine_kind == "sglang":
            return SGLangColocatedSync(sync)
        return sync if self.servers.store is None else ColocatedSync(self.servers.store, sync)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Times a phase of the step for view/timeline.jsonl (rollout, train, push, eval, checkpoint)."""
        return self.view.phase(name)

    def start_producing(self, version: int, stack: ExitStack, trainer: Trainer) -> None:
        """Async mode: the rollout runs from now on, beside training; stopped (its leftovers
        requeued) when the run ends. Colocated, the engines pause for each step's optimiser
        writes into the weights they read, until the push (ColocatedSync.hold)."""
        if isinstance(self.sync, ColocatedSync):
            trainer.before_weight_write = lambda: self.sync.hold()  # the sync in use then
        self.loop.run(self.manager.start(version))
        stack.callback(lambda: self.loop.run(self.manager.stop()))

    def rollout(self, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The step's batch and its metrics (`time/rollout`: how long the trainer waited).
        Colocated and sync, the engines then free their KV cache until the push (the trainer's
        turn); in async mode they keep generating with it."""
        with self.phase("rollout"):
            batch = self.loop.run(self.manager.next_batch(version))
        if isinstance(self.sync, (ColocatedSync, SGLangColocatedSync)) and not self.cfg.async_training:
            self.sync.release()
        return batch

    def connect(self) -> None:
        self.sync.connect()

    def push(self, trainer: Trainer, version: int) -> dict[str, float]:
        """Every engine of the fleet serves `version` after this. Engines of ours that died are
        started again first; if the fleet is no longer the weight-update group's (`Fleet`), a new
        group is formed over it; newcomers serve nothing until this push."""
        launch = self.cfg.launch
        await_weights = not self.cfg.trainer.lora.enabled
        fleet = Fleet.before_push(self.servers, self.sync.urls, launch, await_weights, self.http)
        for line in fleet.news(version):
            self.run_log.message(line)
        if fleet.changed:
            self.sync.close()
            self.sync = self._weight_sync(fleet.urls)
            self.sync.connect()
        with self.phase("push"):
            pushed = self.sync.push(trainer.export(), version)  # every rank takes part (Megatron gathers)
        self.loop.run(self.manager.weights_pushed(version))
        if held := fleet.admitted(self.http, self.servers.router_url, launch.start_timeout):
            self.run_log.message(f"engines {', '.join(held)} got version {version}; the router still holds them")
        routers = self.servers.router_restarts() - self.router_restarts  # by its watch, at once (launch/local.py)
        if routers:
            self.run_log.message(f"router {self.servers.router_url} had exited: restarted on its port")
        self.router_restarts += routers
        return {
            "time/weight_push": pushed["seconds"],
            **({"time/generation_paused": pushed["paused"]} if "paused" in pushed else {}),
            "launch/engines_restarted": float(len(fleet.restarted)),
            "launch/engines": float(len(self.sync.urls)),
            "launch/router_restarted": float(routers),
        }

    def evaluate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        with self.phase("eval"):
            for eval_set in self.eval_sets:
                metrics.update(self.loop.run(self.manager.evaluate(eval_set)))
        return metrics

    def record_trained(self, step: int, groups: list[list[Sample]]) -> None:
        """Which prompts this step trained on, and the weight versions of the tokens it trained
        on: the resume and async tests audit this file."""
        ids = [g[0].group_id for g in groups]
        versions = [sorted(set().union(*(s.trained_versions() for s in g))) for g in groups]
        self.trained.write(json.dumps({"step": step, "group_ids": ids, "versions": versions}) + "\n")
        self.trained.flush()
        self.view.write_samples(step, groups)
        self.run_log.log_samples(step, groups, self.cfg.rollout.reward_key)  # W&B's table of sample rows

    def save(self, step: int, trainer: Trainer) -> dict[str, float]:
        """A checkpoint of every component: the trainer (every rank takes part), the RNG, and the
        rollout side, taken on its thread (in async mode groups are still arriving)."""
        saved = time.perf_counter()

        async def rollout_state() -> dict[str, Any]:
            return self.manager.state_dict()

        with self.phase("checkpoint"):
            state = {
                "step": step,
                "trainer": trainer.state_dict(),
                "rng": checkpoint.rng_state(),
                "rollout": self.loop.run(rollout_state()),
            }
            checkpoint.save(self.cfg.run_dir, step, state, keep=self.cfg.checkpoint.keep)
            if self.world > 1:
                dist.barrier()  # the followers wait for the write
        return {"time/checkpoint": time.perf_counter() - saved}

    def load_state(self, state: dict[str, Any], source: str) -> None:
        self.manager.load_state_dict(state)
        self.run_log.message(f"resumed from {source}")

    def message(self, text: str) -> None:
        self.run_log.message(text)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run_log.log(step, metrics)
        self.view.end_step(step, metrics)

    def end_step(self, step: int, metrics: dict[str, float], started: float) -> None:
        metrics["time/step"] = time.perf_counter() - started
        metrics["time/trainer_idle_fraction"] = metrics["time/rollout"] / metrics["time/step"]
        self.log(step, metrics)

    def done(self) -> None:
        self.run_log.message(f"done: {self.cfg.steps} steps; {self.run_log.summary()}")
        lora = self.cfg.trainer.lora
        what = (
            "PEFT adapter" + (" (merged HF model in hf/merged)" if lora.export_merged else "")
            if lora.enabled
            else "HF export"
        )
        if self.cfg.policies:
            what = "one PEFT adapter per policy (hf/NAME)"
        self.run_log.message(f"{what} in {Path(self.cfg.run_dir) / 'hf'}")


def init_distributed() -> tuple[int, int]:
    """(rank, world size); a plain `python -m slimish.train` is a world of one."""
    if "WORLD_SIZE" not in os.environ:
        return 0, 1
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def broadcast(obj: T, world: int) -> T:
    """Rank 0's object on every rank (the torchrun world: trusted, local)."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def warm_start(cfg: RunConfig, trainer: Trainer, message: Callable[[str], None]) -> None:
    """Supervised steps before RL (`sft.steps`); every rank gets the whole batch and trains on its share."""
    for i, batch in enumerate(sft_batches(cfg, trainer.tokenizer)):
        metrics = trainer.sft_step(batch)
        if i % 10 == 0 or i == cfg.sft.steps - 1:
            message(f"sft {i + 1}/{cfg.sft.steps}: loss {metrics['sft/loss']:.4f}")


def due(step: int, every: int, last: int) -> bool:
    """Every `every` steps and at the last one; never when `every` is 0."""
    return every > 0 and (step % every == 0 or step == last)


def train(cfg: RunConfig, fns: RolloutFunctions) -> None:
    """The run; `fns`, the rollout's functions, loaded at start-up (`checked_train`): rank 0 runs them."""
    transformers.utils.logging.disable_progress_bar()  # the run has its own progress display
    rank, world = init_distributed()
    seed_everything(cfg.seed)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    resume_from = checkpoint.resolve(cfg.run_dir, cfg.checkpoint.resume)
    if resume_from is None and checkpoint.latest(cfg.run_dir) is not None:
        raise SystemExit(
            f"run_dir {cfg.run_dir} holds checkpoints of an earlier run: pass --resume auto to continue it, "
            "or choose another run_dir"
        )
    state = checkpoint.load(resume_from) if resume_from else None
    start_step = state["step"] if state else 0
    cpus = place_this_rank(cfg)  # launch.cpu_placement: this rank's CPUs now, rank 0's engines' below
    with ExitStack() as stack:
        if rank == 0:  # the engines start while the trainer loads: `ready` below waits for them
            launch = run_launch(cfg)
            first_gpu = first_free_gpu(cfg, torch.cuda.is_available())
            if torch.cuda.is_available():
                try:
                    check_placement(
                        launch, cfg.trainer.nproc, first_gpu, torch.cuda.device_count(), teacher_launch(cfg)
                    )
                except ValueError as exc:
                    raise SystemExit(f"slimish train: {exc}") from None
            logs = Path(cfg.run_dir) / "logs"
            servers = stack.enter_context(start_servers(launch, cfg.model, logs, first_gpu, False, cpus.engines))
        trainer = make_trainer(cfg, servers.store if rank == 0 else None)  # launch.colocate's store: nproc 1
        if trainer.adapter_store is not None:  # colocated LoRA: the adapter's store goes with the run
            stack.callback(shutil.rmtree, trainer.adapter_store.path, True)
        ptx = (
            ptx_batches(cfg, trainer.tokenizer) if cfg.algorithm.ptx_coef > 0 else None
        )  # bad demonstrations fail here
        if rank == 0:
            servers.ready(launch.start_timeout)
            side: Driver | Follower = Driver(cfg, fns, servers, stack, start_step, world)
            side.message("\n".join(cpus.lines()))
        else:
            side = Follower()
        if state:
            trainer.load_state_dict(state["trainer"])
            checkpoint.set_rng_state(state["rng"])
            side.load_state(state["rollout"], f"{resume_from} at step {start_step}")
        elif cfg.sft.steps:
            warm_start(cfg, trainer, side.message)
        side.connect()
        first = side.push(trainer, start_step)  # engines serve the trainer's weights
        if cfg.eval.every:
            first.update(side.evaluate())
        side.log(start_step, first)
        if cfg.async_training:
            side.start_producing(start_step, stack, trainer)
        for step in range(start_step + 1, cfg.steps + 1):
            started = time.perf_counter()
            groups, metrics = side.rollout(step - 1)
            groups = broadcast(groups, world)
            with side.phase("train"):
                metrics.update(trainer.train_step(groups, step, ptx(step) if ptx else None))
            metrics.update(side.push(trainer, step))
            side.record_trained(step, groups)
            if due(step, cfg.eval.every, cfg.steps):
                metrics.update(side.evaluate())
            if step == cfg.steps or due(step, cfg.checkpoint.every, cfg.steps):  # the last step always
                metrics.update(side.save(step, trainer))
            side.end_step(step, metrics, started)
        trainer.save_hf(Path(cfg.run_dir) / "hf")  # every rank takes part; rank 0 writes
        side.done()
    if world > 1:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """`slimish train`: this process is the trainer, or torchrun starts `trainer.nproc` ranks."""
    cfg = config_of(args)
    if args.dry_run:
        return dry_run(cfg, args)
    if cfg.trainer.nproc > 1 and "WORLD_SIZE" not in os.environ:
        os.execv(sys.executable, [sys.executable, *trainer_argv(cfg.trainer.nproc, sys.argv[2:])])
    return checked_train(cfg)


def trainer_argv(nproc: int, args: list[str]) -> list[str]:
    """How `slimish train ARGS` runs the trainer, after `python`: torchrun's `trainer.nproc` ranks
    on this node, or this process."""
    if nproc == 1:
        return ["-m", "slimish.train", *args]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "slimish.train", *args]


def dry_run(cfg: RunConfig, args: argparse.Namespace) -> int:
    """`slimish train --dry-run`: the plan (slimish/launch/plan.py) for this machine's GPUs, or
    for the nodes `--gpus-per-node` / `--gpu-memory-gib` describe; nothing started, no weights read."""
    from slimish.launch.plan import Machine, describe, load_model, model_source

    cuda = torch.cuda.is_available()
    here = (
        Machine(torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / (1 << 30))
        if cuda
        else ASSUMED
    )
    machine = Machine(
        args.gpus_per_node or here.gpus_per_node,
        args.gpu_memory_gib or here.gpu_memory_gib,
        here.assumed and not (args.gpus_per_node and args.gpu_memory_gib),
    )
    try:
        source = model_source(cfg.model, args.config)
        lines = describe(cfg, load_model(source), source, machine, usable_cpus())
    except ValueError as exc:
        raise SystemExit(f"slimish train --dry-run: {exc}") from None
    named = {
        "--rollout-fn": args.rollout_fn,
        "--reward-fn": args.reward_fn,
        "--filter-fn": args.filter_fn,
        "--resume": args.resume,
    }
    rest = [
        *(["--config", args.config] if args.config else []),
        *(a for k, v in named.items() if v for a in (k, v)),
        *args.overrides,
    ]
    print(
        f"slimish train --dry-run{f' --config {args.config}' if args.config else ''}: nothing started, no weights loaded"
    )
    print("\n".join(lines))
    print(f"  trainer: python {shlex.join(trainer_argv(cfg.trainer.nproc, rest))}")
    return 0


def checked_train(cfg: RunConfig) -> int:
    """`train`, with the user's functions loaded (so checked) before any server starts, the run
    using those same objects, and a run stopped by them (stalled, or failing the same way again
    and again), or by a full disk under its checkpoints, ending on its reason, not a traceback."""
    try:
        train(cfg, RolloutFunctions.load(cfg.rollout, load_function))
    except (LoadError, RolloutStalled, checkpoint.CheckpointError) as exc:
        raise SystemExit(f"slimish train: {exc}") from None
    except RolloutFailing as exc:  # its checkpoints are kept: the run goes on from the last one
        raise SystemExit(f"slimish train: {exc}, then resume with --resume auto") from None
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimish.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return dry_run(config_of(args), args) if args.dry_run else checked_train(config_of(args))


if __name__ == "__main__":
    sys.exit(main())
