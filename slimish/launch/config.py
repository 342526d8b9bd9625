"""Where a run's engines and router come from (LaunchConfig, the teacher's TeacherConfig) and
`slimish serve`'s engines (ServeConfig): every default of the launchers lives here."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from slimish.schema import at_least, doc, doc_factory, one_of


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (`algorithm.opd`): engines of its own, never pushed to (weight
    sync targets the policy's engines only). Only started when `algorithm.opd.coef` > 0. It must
    share the policy's tokenizer: it scores the policy's token ids as they are."""

    model: str | None = doc(
        None,
        "HF model directory: `engines` engines of `engine_kind` are started on rank 0's machine (child processes, also "
        "under launch.mode=ray), with a router of their own in front (or the policy's, with served_name).",
    )
    router_url: str | None = doc(
        None,
        "An existing router or engine that serves the teacher (nothing started). Not the policy's router (weight "
        "pushes reach every unnamed engine behind it): for that, served_name.",
    )
    served_name: str | None = doc(
        None,
        "Serve the teacher behind the policy's router, by name: its engines are registered there as named workers "
        '(`POST /workers {"url", "model_id": served_name}`, removed when the run ends), and the teacher\'s requests '
        "carry `model: served_name`. Named workers take no request that does not name them and no weight push. Without "
        "`model`: the teacher is already registered under this name on launch.router_url.",
    )

    engines: int = doc(1, "teacher engines started for `model`")
    engine_kind: str = doc("builtin", "builtin | sglang (`launch.sglang_args` do not apply: use teacher.sglang_args)")
    engine_flag: list[str] = doc_factory(list, "NAME=VALUE passed to every teacher engine (builtin)")
    sglang_args: list[str] = doc_factory(list, "passed to every teacher SGLang server")

    def __post_init__(self) -> None:
        one_of("launch.teacher.engine_kind", self.engine_kind, ("builtin", "sglang"))
        at_least(1, self, "launch.teacher.", "engines")
        if self.model and self.router_url:
            raise ValueError(
                "launch.teacher: set model (engines started by the run) or router_url (an existing server), not both"
            )
        if self.served_name is not None and (not self.served_name.strip() or self.router_url):
            raise ValueError(
                "launch.teacher.served_name: a non-empty name the teacher is served under on the policy's router; "
                f"not with launch.teacher.router_url (a teacher router of its own), got {self.served_name!r}"
            )

    @property
    def configured(self) -> bool:
        return bool(self.model or self.router_url or self.served_name)


@dataclass
class LaunchConfig:
    """Where the engines and the router come from."""

    router_url: str | None = doc(None, "an existing router (or engine); None: start them on this machine")
    engines: int = doc(1, "built-in engines started when router_url is None")
    engine_flag: list[str] = doc_factory(list, "NAME=VALUE passed to every engine")
    policy: str = doc("least_inflight", "the embedded router's policy")
    router_processes: int = doc(1, "processes of the embedded router on its port (`slimish router --processes`)")
    router_reconnect_s: float = doc(
        60.0,
        "Seconds a rollout request that finds the router gone (refused, or cut off before any reply) keeps being sent "
        "again: a run restarts its own router on the same port when it exits; 0: fail at once",
    )
    api_key: str | None = doc(None, "sent to the router / engines when they need one")
    start_timeout: float | None = doc(
        None,
        "Seconds an engine (or the router) gets to answer /health once started. None: 300 for built-in engines, 1800 "
        "when SGLang engines start (the policy's or the teacher's): a cold SGLang start loads the checkpoint, compiles "
        "kernels and captures CUDA graphs.",
    )
    mode: str = doc(
        "local",
        "Where the engines run: local (child processes of rank 0) | ray (Ray actors, one placement group bundle each; "
        "the router stays on rank 0's machine).",
    )
    engine_kind: str = doc(
        "builtin",
        "builtin (slimish's engine) | sglang (`python -m sglang.launch_server`, GPU) | external (`engine_urls`, "
        "started and supervised elsewhere; a router is started in front of them).",
    )
    engine_urls: list[str] = doc_factory(list, "engine_kind=external only")
    cpu_placement: str = doc(
        "auto",
        "Which CPUs the trainer and the engines it starts use on this machine (slimish/launch/cpus.py): split (the "
        "trainer and the router pinned to the first half of the usable CPUs, rounded down, the engines to blocks of "
        "the rest, each with as many torch threads as CPUs; explicit trainer.cpu_threads or engine_flag cpu_threads "
        "win) | shared (nobody pinned: each takes the cores it sees) | auto: split in async mode with local built-in "
        "CPU engines and no local teacher, shared otherwise (sync's engines idle while the trainer trains).",
    )
    sglang_args: list[str] = doc_factory(
        list,
        "Passed through to every SGLang server after --model-path/--host/--port, which the launcher owns; "
        "`--sglang-tp-size 2` and `--tp-size 2` mean the same.",
    )
    ray_address: str | None = doc(
        None,
        'mode=ray: the cluster to join ("auto": the one this node belongs to; "ray://h:10001" for Ray Client); None: a '
        "Ray instance of its own on 127.0.0.1 for this run.",
    )
    engine_cpus: float = doc(1.0, "mode=ray: CPUs of each engine's bundle")
    engine_gpus: float = doc(0.0, "mode=ray: GPUs of each engine's bundle (SGLang: its tp size)")
    placement_strategy: str = doc("PACK", "mode=ray: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD")
    colocate: bool = doc(
        False,
        "Engines and trainer on this machine's cores sharing one copy of the weights (docs/colocate.md): the policy's "
        "parameters live in a shared-memory store the engines map, the optimiser step writes what they serve, and a "
        "push is a version flip (no bytes copied). Sync: the engines' KV cache is freed while the trainer trains; "
        "async: generation pauses for each optimiser step and continues on the new version at the push. Built-in CPU "
        "engines started by the run, the torch trainer on one rank; with trainer.lora the adapter is shared too (a "
        "push refreshes the engines' adapter slots from it). With engine_kind=sglang (GPU, sync, no LoRA): the engines go on the trainer's GPU "
        "with --enable-memory-saver, release their memory while it trains and take the weights as CUDA IPC handles.",
    )
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation's teacher

    def __post_init__(self) -> None:
        one_of("launch.mode", self.mode, ("local", "ray"))
        if self.colocate and (
            self.mode != "local" or self.engine_kind not in ("builtin", "sglang") or self.router_url is not None
        ):
            raise ValueError(
                "launch.colocate needs launch.mode=local, launch.engine_kind=builtin or sglang and no launch.router_url "
                f"(engines this run starts on its machine), got mode={self.mode!r}, engine_kind={self.engine_kind!r}, "
                f"router_url={self.router_url!r}"
            )
        one_of("launch.engine_kind", self.engine_kind, ("builtin", "sglang", "external"))
        one_of("launch.cpu_placement", self.cpu_placement, ("auto", "split", "shared"))  # slimish/launch/cpus.py
        if self.engine_kind == "external" and not (self.engine_urls or self.router_url):
            raise ValueError("launch.engine_urls: engine_kind=external needs the engines' URLs")
        if self.engine_urls and self.engine_kind != "external":
            raise ValueError(f"launch.engine_urls needs launch.engine_kind=external, got {self.engine_kind!r}")
        if self.mode == "ray" and (self.engine_kind == "external" or self.router_url):
            raise ValueError("launch.mode=ray places engines it starts: not with engine_kind=external or router_url")
        if self.router_processes < 1:
            raise ValueError(
                f"launch.router_processes must be >= 1 (router processes on one port), got {self.router_processes}"
            )
        if self.engines < 1 or self.engine_cpus < 0 or self.engine_gpus < 0:
            raise ValueError(
                f"launch.engines must be >= 1 and engine_cpus/engine_gpus >= 0, got "
                f"{self.engines}, {self.engine_cpus}, {self.engine_gpus}"
            )
        if self.teacher.served_name and not (self.teacher.model or self.router_url):
            raise ValueError(
                "launch.teacher.served_name without launch.teacher.model names a teacher already registered on "
                "the policy's router: that needs launch.router_url (a router this run starts has none)"
            )
        if (
            self.router_url
            and self.teacher.router_url
            and self.router_url.rstrip("/") == self.teacher.router_url.rstrip("/")
        ):
            raise ValueError(
                f"launch.teacher.router_url is the policy's launch.router_url ({self.router_url}): weight pushes would "
                "reach the teacher; serve the teacher from its own router or engine"
            )
        if self.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"launch.placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, "
                f"got {self.placement_strategy!r}"
            )
        at_least(0, self, "launch.", "router_reconnect_s")
        if self.start_timeout is None:
            self.start_timeout = 1800.0 if "sglang" in (self.engine_kind, self.teacher.engine_kind) else 300.0
        if self.mode == "ray" and self.engine_kind == "sglang":
            from slimish.launch.sglang import sglang_tp

            if self.engine_gpus < sglang_tp(self.sglang_args):
                raise ValueError(
                    f"launch.engine_gpus ({self.engine_gpus:g}) must be >= the SGLang engines' tp size "
                    f"({sglang_tp(self.sglang_args)}, launch.sglang_args) under launch.mode=ray: each engine "
                    "sees only the GPUs of its Ray bundle"
                )


@dataclass
class ServeConfig:
    """`slimish serve`: built-in engines plus a router on this machine (router flags: RouterConfig)."""

    model: str = doc(MISSING, "HF model directory the engines serve")
    engines: int = 1
    engine_flag: list[str] = doc_factory(list, "NAME=VALUE, passed to every engine as --NAME VALUE")
    log_dir: str | None = doc(None, "engine logs; default: a new temporary directory")
    start_timeout: float = doc(300.0, "seconds the engines get to load and answer /health")

    def __post_init__(self) -> None:
        at_least(1, self, "", "engines")
