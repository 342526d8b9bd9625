"""The training loop: `torchrun --nproc-per-node N -m slimish.train --config C --rollout-fn F [key=value ...]`.

Rank 0 is the driver: it owns the engines and router (started here unless `launch.router_url`
names running ones), the rollout manager (asyncio, on a background thread), the buffer, weight
sync, metrics and checkpoints. Every rank holds the policy and trains on its share of each batch.
One step, in sync mode:

    rollout (rank 0) -> broadcast the batch -> train_step (all ranks) -> push weights (rank 0)

In async mode (`mode: async`, `buffer.max_staleness` >= 1) the rollout never stops: the manager
produces groups on its thread while the trainer trains, and a step starts by taking a batch no
staler than the bound from the buffer (waiting only when there is none yet).

`slimish train ...` is the same loop; it launches torchrun itself when `trainer.nproc` > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import transformers

from slimish.buffer import Buffer, Staleness
from slimish.config import RunConfig, document_run_config, load_run_config
from slimish.launch import Servers, start_servers
from slimish.loop_thread import LoopThread
from slimish.metrics import RunLog
from slimish.rollout.api import RolloutRuntime
from slimish.rollout.data import PromptData, eval_rows
from slimish.rollout.manager import RolloutManager
from slimish.trainer import checkpoint, make_trainer
from slimish.trainer.base import Trainer
from slimish.trainer.sft import sft_batches
from slimish.trainer.weight_sync import WeightSync
from slimish.types import Sample

T = TypeVar("T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file of RunConfig values")
    parser.add_argument("--rollout-fn", default=None, help="module:function or path/to/file.py:function")
    parser.add_argument("--reward-fn", default=None)
    parser.add_argument("--filter-fn", default=None)
    parser.add_argument("--resume", default=None, help="auto (newest checkpoint in run_dir) or a checkpoint directory")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="RunConfig overrides, e.g. rollout.temperature=0.7")
    document_run_config(parser)


def config_of(args: argparse.Namespace) -> RunConfig:
    named = {"rollout.rollout_fn": args.rollout_fn, "rollout.reward_fn": args.reward_fn,
             "rollout.filter_fn": args.filter_fn, "checkpoint.resume": args.resume}  # fmt: skip
    return load_run_config(args.config, args.overrides, **named)


class Driver:
    """Rank 0's side of the loop: rollouts, weight pushes, evaluation, metrics, checkpoints."""

    def __init__(self, cfg: RunConfig, servers: Servers, stack: ExitStack, start_step: int) -> None:
        self.cfg = cfg
        self.loop = LoopThread("rollout")
        stack.callback(self.loop.close)
        self.runtime = self.loop.run(RolloutRuntime.create(cfg, servers.router_url))
        stack.callback(lambda: self.loop.run(self.runtime.close()))
        self.buffer = Buffer(Staleness.of(cfg.buffer))
        self.manager = RolloutManager.from_config(self.runtime, PromptData(cfg.data), self.buffer)
        self.eval_rows = eval_rows(cfg.eval, cfg.data)
        self.servers = servers
        self.sync = WeightSync(cfg.weight_sync, servers.engine_urls, cfg.launch.api_key)
        stack.callback(lambda: self.sync.close())  # the one in use then: a restart replaces it
        self.log = RunLog(cfg.run_dir, cfg.steps, start_step)
        stack.callback(self.log.close)
        self.trained = open(Path(cfg.run_dir) / "trained_prompts.jsonl", "a")
        stack.callback(self.trained.close)

    def start_producing(self, version: int, stack: ExitStack) -> None:
        """Async mode: the rollout runs from now on, beside training; stopped (its leftovers
        requeued) when the run ends."""
        self.loop.run(self.manager.start(version))
        stack.callback(lambda: self.loop.run(self.manager.stop()))

    def rollout(self, version: int) -> tuple[list[list[Sample]], dict[str, float]]:
        """The step's batch and its metrics (`time/rollout`: how long the trainer waited)."""
        return self.loop.run(self.manager.next_batch(version))

    def push(self, tensors: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Every engine serves `version` after this. An engine of ours that died (the router has
        routed around it since) is started again first and joins a new weight-update group:
        it serves nothing until this push has set all its weights."""
        restarted = self.servers.restart_dead(self.cfg.launch.start_timeout)
        if restarted:
            self.log.message(f"engines {', '.join(restarted)} had exited: restarted, they serve from version {version} on")
            self.sync.close()
            self.sync = WeightSync(self.cfg.weight_sync, self.servers.engine_urls, self.cfg.launch.api_key)
            self.sync.connect()
        metrics = {"time/weight_push": self.sync.push(tensors, str(version))["seconds"], "launch/engines_restarted": float(len(restarted))}
        self.loop.run(self.manager.weights_pushed(version))
        return metrics

    def evaluate(self) -> dict[str, float]:
        if not self.eval_rows:
            return {}
        results = self.loop.run(self.manager.evaluate(self.eval_rows))
        return {f"eval/{k.removesuffix('_mean')}": v for k, v in results.items()}

    def record_trained(self, step: int, groups: list[list[Sample]]) -> None:
        """Which prompts this step trained on, and the weight versions of the tokens it trained
        on: the resume and async tests audit this file."""
        ids = [g[0].group_id for g in groups]
        versions = [sorted(set().union(*(s.trained_versions() for s in g))) for g in groups]
        self.trained.write(json.dumps({"step": step, "group_ids": ids, "versions": versions}) + "\n")
        self.trained.flush()

    def state(self) -> dict[str, Any]:
        """Taken on the rollout thread: in async mode groups are still arriving."""

        async def state() -> dict[str, Any]:
            return {"manager": self.manager.state_dict(), "buffer": self.buffer.state_dict()}

        return self.loop.run(state())

    def load_state(self, state: dict[str, Any]) -> None:
        self.manager.load_state_dict(state["manager"])
        self.buffer.load_state_dict(state["buffer"])


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


def warm_start(cfg: RunConfig, trainer: Trainer, log: RunLog | None) -> None:
    """Supervised steps before RL (`sft.steps`); every rank gets the whole batch and trains on its share."""
    for i, batch in enumerate(sft_batches(cfg, trainer.tokenizer)):
        metrics = trainer.sft_step(batch)
        if log is not None and (i % 10 == 0 or i == cfg.sft.steps - 1):
            log.message(f"sft {i + 1}/{cfg.sft.steps}: loss {metrics['sft/loss']:.4f}")


def push_weights(trainer: Trainer, driver: Driver | None, version: int) -> dict[str, float]:
    """Every rank takes part in a push (Megatron gathers the weights over TP / PP); rank 0's
    driver sends them to the engines and returns its metrics."""
    if driver is None:
        trainer.join_export()
        return {}
    return driver.push(trainer.hf_tensors(), version)


def due(step: int, every: int, last: int) -> bool:
    """Every `every` steps and at the last one; never when `every` is 0."""
    return every > 0 and (step % every == 0 or step == last)


def train(cfg: RunConfig) -> None:
    transformers.utils.logging.disable_progress_bar()  # the run has its own progress display
    rank, world = init_distributed()
    seed_everything(cfg.seed)
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    resume_from = checkpoint.resolve(cfg.run_dir, cfg.checkpoint.resume)
    if resume_from is None and checkpoint.latest(cfg.run_dir) is not None:
        raise SystemExit(f"run_dir {cfg.run_dir} holds checkpoints of an earlier run: pass --resume auto to continue it, "
                         "or choose another run_dir")  # fmt: skip
    state = checkpoint.load(resume_from) if resume_from else None
    start_step = state["step"] if state else 0
    with ExitStack() as stack:
        trainer = make_trainer(cfg)
        driver = None
        if rank == 0:
            servers = stack.enter_context(start_servers(cfg.launch, cfg.model, Path(cfg.run_dir) / "logs"))
            driver = Driver(cfg, servers, stack, start_step)
        if state:
            trainer.load_state_dict(state["trainer"])
            checkpoint.set_rng_state(state["rng"])
            if driver:
                driver.load_state(state["rollout"])
                driver.log.message(f"resumed from {resume_from} at step {start_step}")
        elif cfg.sft.steps:
            warm_start(cfg, trainer, driver.log if driver else None)
        if driver:
            driver.sync.connect()
        first = push_weights(trainer, driver, start_step)  # engines serve the trainer's weights
        if driver:
            if cfg.eval.every:
                first.update(driver.evaluate())
            driver.log.log(start_step, first)
            if cfg.mode == "async" and cfg.buffer.max_staleness > 0:
                driver.start_producing(start_step, stack)
        for step in range(start_step + 1, cfg.steps + 1):
            started = time.perf_counter()
            groups, metrics = driver.rollout(step - 1) if driver else (None, {})
            groups = broadcast(groups, world)
            metrics.update(trainer.train_step(groups, step))
            metrics.update(push_weights(trainer, driver, step))
            save = step == cfg.steps or due(step, cfg.checkpoint.every, cfg.steps)  # the last step always
            if driver is None:
                if save:
                    trainer.state_dict()  # this rank's part of rank 0's (Megatron gathers the shards)
                    dist.barrier()  # rank 0 is writing the checkpoint
                continue
            driver.record_trained(step, groups)
            if due(step, cfg.eval.every, cfg.steps):
                metrics.update(driver.evaluate())
            if save:
                saved = time.perf_counter()
                checkpoint.save(cfg.run_dir, step, {"step": step, "trainer": trainer.state_dict(), "rng": checkpoint.rng_state(),
                                                    "rollout": driver.state()}, keep=cfg.checkpoint.keep)  # fmt: skip
                metrics["time/checkpoint"] = time.perf_counter() - saved
                if world > 1:
                    dist.barrier()
            metrics["time/step"] = time.perf_counter() - started
            metrics["time/trainer_idle_fraction"] = metrics["time/rollout"] / metrics["time/step"]
            driver.log.log(step, metrics)
        trainer.save_hf(Path(cfg.run_dir) / "hf")  # every rank takes part; rank 0 writes
        if driver:
            driver.log.message(f"done: {cfg.steps} steps; {driver.log.summary()}")
            driver.log.message(f"HF export in {Path(cfg.run_dir) / 'hf'}")
    if world > 1:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> int:
    """`slimish train`: this process is the trainer, or torchrun starts `trainer.nproc` ranks."""
    cfg = config_of(args)
    if cfg.trainer.nproc > 1 and "WORLD_SIZE" not in os.environ:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.trainer.nproc}",
                "-m", "slimish.train", *sys.argv[2:]]  # fmt: skip
        os.execv(sys.executable, argv)
    train(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slimish.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    train(config_of(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
