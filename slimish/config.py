"""Configuration schemas: every default of slimish lives here, and only here.

Each schema is a dataclass that OmegaConf validates (types, missing values). The command line is
generated from the schema (`--max-running-requests 8` for `max_running_requests`), so a flag and
its default cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import re
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger(__name__)

T = TypeVar("T")


def at_least(low: float, section: object, prefix: str, *names: str) -> None:
    """The one range check of the schemas: each named field (None: unset) is >= `low`."""
    for name in names:
        value = getattr(section, name)
        if value is not None and value < low:
            raise ValueError(f"{prefix}{name} must be >= {low}, got {value}")


DECODE_ATTENTION_BACKENDS = ("sdpa", "matmul")  # slimish/engine/attention.py


def one_of(name: str, value: Any, allowed: typing.Iterable[Any]) -> None:
    """The one choice check of the schemas, naming the field and every allowed value."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


@dataclass
class EngineConfig:
    """The built-in engine (`slimish engine`)."""

    model: str = MISSING  # HF model directory (config, weights, tokenizer)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 30000  # SGLang's default; always pass one explicitly when several servers run
    max_running_requests: int = 32  # rows in the running batch
    max_prefill_tokens: int = 4096  # prompt tokens prefilled per scheduler step (decode is never starved)
    context_length: int | None = None  # default: the model's max_position_embeddings
    dtype: str = "float32"  # fp32 on CPU: bf16 is 12-18x slower there (docs/benchmarks.md, CPU facts)
    # SGLang's tensor-parallel size (`--tp-size`), accepted so that an SGLang launch line starts
    # this engine; it runs on one device, so only 1 is.
    tp_size: int = 1
    # cpu | cuda | cuda:K. The model and every tensor the engine makes live there, so a weight
    # push over an NCCL group (docs/protocol.md 4) lands straight in GPU parameters.
    device: str = "cpu"
    served_model_name: str | None = None  # default: the model path
    # SGLang's parser names for the OpenAI routes (slimish/formats); None: detected from the chat
    # template; "none": off.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    api_key: str | None = None  # Bearer key for every route except health and metrics
    admin_api_key: str | None = None  # Bearer key for weight and control routes (default: api_key)
    weight_sync_timeout_s: int = 600  # a trainer gone mid-broadcast frees the engine after this
    stream_interval: int = 1  # decode steps between streamed chunks
    seed: int = 0  # torch seed for requests without `sampling_seed`
    log_level: str = "warning"
    # Limits; each refusal names the field and the limit. Requests beyond the limits of what the
    # engine can hold are a 400; a full engine is a 503 with `Retry-After` (try again later or
    # elsewhere: the router does).
    max_prompt_tokens: int | None = None  # None: only the context length bounds a prompt
    max_new_tokens_cap: int | None = None  # larger explicit values are refused, larger defaults lowered
    max_body_bytes: int = 32 << 20  # a batch of long `input_ids` prompts is a few MiB
    # Sequences (n and batch items count one each) allowed to wait beyond the running batch.
    max_queued_requests: int = 2048
    retry_after_s: int = 1  # the `Retry-After` of a 503 when the queue is full
    # Prefix cache (SGLang's radix cache): KV of whole prompt pages is reused by later requests
    # that start with the same tokens, and identical prompts admitted together (n copies) are
    # prefilled once. Exact: prefill always runs page by page on one grid, so outputs and
    # log-probs are the same with the cache on or off. Emptied by /flush_cache and weight loads.
    disable_radix_cache: bool = False
    page_size: int = 64  # tokens per KV page: the cache's unit and each prefill forward's length
    radix_cache_max_tokens: int = 32768  # cached KV beyond this is evicted, least recently used first
    # How one-token (decode) forwards attend: "matmul" (batched matmuls over the live KV columns;
    # up to 3 percent faster per decode step on CPU in interleaved A/B runs, benchmarks/README.md) or
    # "sdpa" (HF's SDPA). Prefill always uses SDPA, so the two differ only by rounding.
    decode_attention_backend: str = "matmul"
    # Serve nothing (503, /health included) until a weight push has set every parameter: for an
    # engine that joins or rejoins a running training run, so it never serves stale weights.
    await_weights: bool = False
    # LoRA serving (SGLang's flags). Adapters are PEFT directories (adapter_config.json +
    # adapter_model.safetensors); a request names one by `lora_path` (/generate) or `model` (OpenAI).
    enable_lora: bool = False  # also on when lora_paths is given
    # Adapters loaded at start, each PATH, NAME=PATH or JSON {"lora_name", "lora_path", "pinned"}.
    lora_paths: list[str] = field(default_factory=list)
    max_loras_per_batch: int = 8  # distinct adapters in the running batch (base rows need none); rows beyond wait
    max_loaded_loras: int | None = None  # adapters held at once (None: no limit); at least max_loras_per_batch
    max_lora_rank: int | None = None  # smaller ranks are padded to it; None: the largest rank among lora_paths
    # Module names adapters may target (q_proj, v_proj, ..., or all); empty: the union of the
    # lora_paths adapters' targets, or all linear layers of the decoder when none is given.
    lora_target_modules: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        at_least(
            1,
            self,
            "",
            "max_running_requests",
            "max_prefill_tokens",
            "max_body_bytes",
            "retry_after_s",
            "max_prompt_tokens",
            "max_new_tokens_cap",
            "max_loras_per_batch",
            "max_lora_rank",
            "page_size",
        )
        at_least(self.page_size, self, "", "radix_cache_max_tokens")
        at_least(0, self, "", "max_queued_requests")
        one_of("engine.decode_attention_backend", self.decode_attention_backend, DECODE_ATTENTION_BACKENDS)
        if self.enable_lora and not self.lora_paths and self.max_lora_rank is None:
            raise ValueError(
                "max_lora_rank (--max-lora-rank) is required with enable_lora when no lora_paths adapter gives the rank to reserve"
            )
        if self.max_loaded_loras is not None and self.max_loaded_loras < self.max_loras_per_batch:
            raise ValueError(
                f"max_loaded_loras ({self.max_loaded_loras}) must be >= max_loras_per_batch ({self.max_loras_per_batch})"
            )
        if self.tp_size != 1:
            raise ValueError(
                f"engine.tp_size (--tp-size) must be 1: the built-in engine runs on one device; tensor "
                f"parallelism needs SGLang (launch.engine_kind=sglang), got {self.tp_size}"
            )
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"engine.device (--device) must be cpu, cuda or cuda:K, got {self.device!r}")
        check_parsers("engine.", self.tool_call_parser, self.reasoning_parser)


def check_parsers(prefix: str, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Parser names are SGLang's (slimish/formats), "none", or None (detected from the template)."""
    from slimish.formats.reasoning import REASONING_PARSERS
    from slimish.formats.tool_parsers import TOOL_CALL_PARSERS

    for name, value, known in (
        ("tool_call_parser", tool_call_parser, TOOL_CALL_PARSERS),
        ("reasoning_parser", reasoning_parser, REASONING_PARSERS),
    ):
        if value is not None and value != "none" and value not in known:
            raise ValueError(
                f"{prefix}{name} must be one of {sorted(known)}, 'none' or null (detect from the chat template), got {value!r}"
            )


POLICIES = ("least_inflight", "round_robin", "cache_aware", "session")


@dataclass
class RouterConfig:
    """The router (`slimish router`, and the router inside `slimish serve`)."""

    worker_urls: list[str] = field(default_factory=list)  # engines to route to (more via POST /workers)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 30000
    policy: str = "least_inflight"  # least_inflight | round_robin | cache_aware | session
    log_level: str = "warning"
    # Router processes sharing `port` (SO_REUSEPORT): 1 is one process, one event loop. More
    # scale throughput; with N > 1 `session` and `cache_aware` pick by rendezvous hashing so every
    # process agrees, and in-flight counts are per process (slimish/router/scaleout.py).
    workers: int = 1
    # Security. With no keys set nothing is checked (like SGLang). `admin_api_key` falls back to
    # `api_key`, so setting only `--api-key` does not leave worker management open.
    api_key: str | None = None
    admin_api_key: str | None = None
    max_body_bytes: int = 32 << 20  # a batch of long `input_ids` prompts is a few MiB
    max_new_tokens_cap: int | None = None  # None: the engines' own limits apply
    # `input_ids` prompts longer than this are refused (text prompts are counted by the engines:
    # the router does not tokenize). None: the engines' own limits apply.
    max_prompt_tokens: int | None = None
    # Serving requests in flight (streams until their end) before the next gets a 429 with
    # `Retry-After: retry_after_s`. Health, metrics and admin routes are never refused.
    max_concurrent_requests: int = 4096
    retry_after_s: int = 1
    # Upstream. A non-streamed request must finish within `request_timeout`; a stream may run
    # longer but no single wait for the next chunk may exceed it. 1800 s as sglang-router.
    request_timeout: float = 1800.0
    connect_timeout: float = 5.0
    max_retries: int = 2  # extra attempts, each on another worker where one is left
    # Below uvicorn's 5 s keep-alive, so the router rarely reuses a socket the engine closed.
    keepalive_timeout: float = 4.0
    # Health checks: `GET <worker>/health`. A worker is marked unhealthy after
    # `health_failure_threshold` failed checks in a row (at once when a connection is refused)
    # and healthy again on the first good check.
    health_check_interval: float = 5.0
    health_check_timeout: float = 5.0
    health_failure_threshold: int = 3
    # cache_aware (defaults as sglang-router's): route to the worker that holds the longest
    # cached prefix when at least `cache_threshold` of the prompt matches, unless the load is
    # unbalanced: max - min > balance_abs_threshold and max > balance_rel_threshold * min.
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    cache_block_size: int = 16  # tokens per hashed block; text blocks are 4x as many chars
    cache_max_blocks: int = 1 << 18  # LRU bound on remembered prefix blocks
    max_sessions: int = 1 << 16  # LRU bound on remembered session pins

    def __post_init__(self) -> None:
        one_of("policy", self.policy, POLICIES)
        for name in ("request_timeout", "connect_timeout", "health_check_interval", "health_check_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        at_least(0, self, "", "max_retries")
        at_least(
            1,
            self,
            "",
            "max_new_tokens_cap",
            "max_prompt_tokens",
            "max_body_bytes",
            "max_concurrent_requests",
            "retry_after_s",
            "health_failure_threshold",
            "workers",
        )


@dataclass
class ServeConfig:
    """`slimish serve`: built-in engines plus a router on this machine (router flags: RouterConfig)."""

    model: str = MISSING  # HF model directory the engines serve
    engines: int = 1
    engine_flag: list[str] = field(default_factory=list)  # NAME=VALUE, passed to every engine as --NAME VALUE
    log_dir: str | None = None  # engine logs; default: a new temporary directory
    start_timeout: float = 300.0  # seconds the engines get to load and answer /health

    def __post_init__(self) -> None:
        at_least(1, self, "", "engines")


def field_docs(schema: type) -> dict[str, str]:
    """Each field's comment in this file: its trailing one, else the comment block above it (a
    block documents the fields that follow it up to a blank line). The comments are the docs, so
    `--help` shows them instead of a second copy."""
    docs: dict[str, str] = {}
    block: list[str] = []
    after_comment = False
    for line in inspect.getsource(schema).splitlines()[1:]:
        text = line.strip()
        if text.startswith("#"):
            block = (block if after_comment else []) + [text.lstrip("# ")]
            after_comment = True
            continue
        after_comment = False
        match = re.match(r"(\w+): [^#]*?(?:#\s*(.*))?$", text)
        if match and not text.startswith(("def ", "return", "raise")):
            docs[match.group(1)] = match.group(2) or " ".join(block)
        elif not text:
            block = []
    return docs


def _default(f: dataclasses.Field) -> Any:
    """A field's default value (MISSING when it is required)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def describe_config(schema: type, prefix: str = "") -> list[str]:
    """`key (default): doc` for every field, nested sections flattened to dotted keys."""
    lines, docs = [], field_docs(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):  # a section: its own keys, dotted
            lines += describe_config(f.default_factory, f"{prefix}{f.name}.")
            continue
        default = _default(f)
        shown = "required" if default is MISSING else repr(default)
        lines.append(f"  {prefix}{f.name} ({shown})" + (f": {docs[f.name]}" if docs.get(f.name) else ""))
    return lines


def add_config_arguments(parser: argparse.ArgumentParser, schema: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per schema field, default and type taken from the schema, its comment as help;
    lists take N values; booleans are bare flags as SGLang's (`--enable-lora`), with a `--no-X`
    form to turn off one that defaults on. SGLang's other names for a field are accepted too
    (FLAG_ALIASES), so an SGLang launch line starts the built-in engine."""
    hints, docs = typing.get_type_hints(schema), field_docs(schema)
    for f in dataclasses.fields(schema):
        if f.name in skip:
            continue
        hint = hints[f.name]
        default = _default(f)
        default = None if default is MISSING else default
        names = ["--" + name.replace("_", "-") for name in (f.name, *FLAG_ALIASES.get(f.name, ()))]
        if hint is bool:  # BooleanOptionalAction adds "(default: ...)" to the help itself
            parser.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=default, help=docs.get(f.name) or None
            )
            continue
        is_list = typing.get_origin(hint) is list
        kind = typing.get_args(hint)[0] if is_list else _scalar(hint)
        parser.add_argument(
            *names,
            type=kind,
            default=default,
            required=f.default is MISSING,
            nargs="*" if is_list else None,
            help=f"{docs.get(f.name, '')} (default: {default})".lstrip(),
        )
    for old, new in RENAMED_FLAGS.items():
        if new in hints and new not in skip:
            parser.add_argument("--" + old.replace("_", "-"), dest=new, action=_RenamedFlag, help=argparse.SUPPRESS)


# A field -> SGLang's other flag names for it (sglang 0.5.23: python/sglang/srt/arg_groups/fields/model.py,
# parallel.py), accepted as well.
FLAG_ALIASES = {"model": ("model_path",), "tp_size": ("tensor_parallel_size",)}
# Old flag -> the field that took its place: read for a release, with a warning.
RENAMED_FLAGS = {"admin_key": "admin_api_key", "engine_start_timeout": "start_timeout"}


class _RenamedFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new = "--" + self.dest.replace("_", "-")
        log.warning("%s is now %s; the old name will stop working in the next release", option_string, new)
        setattr(namespace, self.dest, values)


def config_from_args(schema: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """Validate the parsed flags through OmegaConf; returns a schema instance."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(schema) if hasattr(args, f.name)}
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), values, overrides)
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, OmegaConfBaseException) as exc:
        raise SystemExit(f"bad {schema.__name__}: {exc}") from None


def _scalar(hint: Any) -> type:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = args[0] if args else hint
    return str if kind is bool else kind  # OmegaConf reads "true" / "false"; bool("false") is True


# --- A training or rollout run: `slimish train|rollout --config C.yaml [key=value ...]` -------------
# Each section has one owner module; a default lives here only.


@dataclass
class TeacherConfig:
    """On-policy distillation's teacher (`algorithm.opd`): engines of its own, never pushed to (weight
    sync targets the policy's engines only). Only started when `algorithm.opd.coef` > 0. It must
    share the policy's tokenizer: it scores the policy's token ids as they are."""

    # HF model directory: `engines` engines of `engine_kind` are started on rank 0's machine
    # (child processes, also under launch.mode=ray), with a router of their own in front (or the
    # policy's, with served_name).
    model: str | None = None
    # An existing router or engine that serves the teacher (nothing started). Not the policy's
    # router (weight pushes reach every unnamed engine behind it): for that, served_name.
    router_url: str | None = None
    # Serve the teacher behind the policy's router, by name: its engines are registered there as
    # named workers (`POST /workers {"url", "model_id": served_name}`, removed when the run ends),
    # and the teacher's requests carry `model: served_name`. Named workers take no request that
    # does not name them and no weight push. Without `model`: the teacher is already registered
    # under this name on launch.router_url.
    served_name: str | None = None

    engines: int = 1  # teacher engines started for `model`
    engine_kind: str = "builtin"  # builtin | sglang (`launch.sglang_args` do not apply: use teacher.sglang_args)
    engine_flag: list[str] = field(default_factory=list)  # NAME=VALUE passed to every teacher engine (builtin)
    sglang_args: list[str] = field(default_factory=list)  # passed to every teacher SGLang server

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

    router_url: str | None = None  # an existing router (or engine); None: start them on this machine
    engines: int = 1  # built-in engines started when router_url is None
    engine_flag: list[str] = field(default_factory=list)  # NAME=VALUE passed to every engine
    policy: str = "least_inflight"  # the embedded router's policy
    router_workers: int = 1  # processes of the embedded router on its port (`slimish router --workers`)
    api_key: str | None = None  # sent to the router / engines when they need one
    # Seconds an engine (or the router) gets to answer /health once started. None: 300 for
    # built-in engines, 1800 when SGLang engines start (the policy's or the teacher's): a cold
    # SGLang start loads the checkpoint, compiles kernels and captures CUDA graphs.
    start_timeout: float | None = None
    # Where the engines run: local (child processes of rank 0) | ray (Ray actors, one placement
    # group bundle each; the router stays on rank 0's machine).
    mode: str = "local"
    # builtin (slimish's engine) | sglang (`python -m sglang.launch_server`, GPU) | external
    # (`engine_urls`, started and supervised elsewhere; a router is started in front of them).
    engine_kind: str = "builtin"
    engine_urls: list[str] = field(default_factory=list)  # engine_kind=external only
    # Passed through to every SGLang server after --model-path/--host/--port, which the launcher
    # owns; `--sglang-tp-size 2` and `--tp-size 2` mean the same.
    sglang_args: list[str] = field(default_factory=list)
    # mode=ray: the cluster to join ("auto": the one this node belongs to; "ray://h:10001" for
    # Ray Client); None: a Ray instance of its own on 127.0.0.1 for this run.
    ray_address: str | None = None
    engine_cpus: float = 1.0  # mode=ray: CPUs of each engine's bundle
    engine_gpus: float = 0.0  # mode=ray: GPUs of each engine's bundle (SGLang: its tp size)
    placement_strategy: str = "PACK"  # mode=ray: PACK | SPREAD | STRICT_PACK | STRICT_SPREAD
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # on-policy distillation's teacher

    def __post_init__(self) -> None:
        one_of("launch.mode", self.mode, ("local", "ray"))
        one_of("launch.engine_kind", self.engine_kind, ("builtin", "sglang", "external"))
        if self.engine_kind == "external" and not (self.engine_urls or self.router_url):
            raise ValueError("launch.engine_urls: engine_kind=external needs the engines' URLs")
        if self.engine_urls and self.engine_kind != "external":
            raise ValueError(f"launch.engine_urls needs launch.engine_kind=external, got {self.engine_kind!r}")
        if self.mode == "ray" and (self.engine_kind == "external" or self.router_url):
            raise ValueError("launch.mode=ray places engines it starts: not with engine_kind=external or router_url")
        if self.router_workers < 1:
            raise ValueError(
                f"launch.router_workers must be >= 1 (router processes on one port), got {self.router_workers}"
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
class DataConfig:
    """Prompts: a JSONL / Parquet file, a local `datasets` directory, `task:NAME` (built-in), or a function."""

    # a .jsonl / .parquet file, a `datasets` directory, task:NAME, or module:function,
    # `fn(cfg: DataConfig, split: str) -> Iterable[dict]`: rows as in a JSONL file, called once
    # per split (train; test for eval.source); it must return the same rows every time (resume)
    source: str = MISSING
    prompt_key: str = "prompt"  # a string (text) or a list of messages (chat)
    label_key: str | None = "label"  # None: rows carry no label (e.g. a reward model scores them)
    apply_chat_template: bool = True  # text prompts become one user message
    system_prompt: str | None = None
    shuffle: bool = True  # reshuffled every epoch with seed + epoch
    seed: int | None = None  # shuffling and `task:NAME` prompts; None: the run's seed
    task_size: int = 2000  # prompts per split for `task:NAME` sources


ZERO_VARIANCE_FILTER = "slimish.rollout.filters:nonzero_std"  # drops groups whose rewards are all equal


@dataclass
class RolloutConfig:
    rollout_fn: str = "rollout_plugins.math:rollout"  # module:function or path/to/file.py:function
    reward_fn: str | None = None  # async (ctx, sample) -> float, or a group form; None: the plugin sets rewards
    filter_fn: str | None = ZERO_VARIANCE_FILTER  # over a finished group; None: keep all
    reward_key: str | None = None  # for dict rewards: the numeric key advantages use (others are kept as metadata)
    # Hooks, each module:function (slimish/rollout/loader.py has their shapes): on every sample the
    # rollout fn returned, before scoring; and over a scored group, replacing its rewards.
    sample_hook: str | None = None
    reward_post_fn: str | None = None
    # When a step runs out of prompts (max_prompts_factor) with groups dropped by the filter, train
    # on the newest of those to fill the batch instead of training short (rollout/groups_refilled).
    keep_when_insufficient: bool = False
    # A rollout, reward or filter function that fails the same way (same exception type, same
    # place) on this many groups in a row stops the run with that error; 0 = never.
    max_consecutive_failures: int = 8
    # The plugin's own settings (any YAML; `rollout.args.KEY=VALUE` on the command line): `ctx.args`.
    args: dict[str, Any] = field(default_factory=dict)
    n_samples_per_prompt: int = 8
    rollout_batch_size: int = 8  # groups that must survive filtering each step
    max_concurrency: int = 64  # samples in flight
    over_sampling: float = 1.0  # start up to this many times the groups still needed
    # Keep samples aborted at a step's end and resume them next step. Their first tokens come from
    # older weights: buffer.max_staleness must allow that (>= 1), else they restart from scratch.
    partial_rollout: bool = False
    # A step that has taken this many times rollout_batch_size prompts without filling its batch
    # (groups failing or filtered) trains on the groups that survived (metric rollout/groups_short),
    # or, when none did, stops with an error naming the failures and filter reasons.
    max_prompts_factor: float = 8.0
    abort_timeout: float = 60.0  # seconds leftovers get to return after the end-of-step abort; then cancelled
    # Default sampling params for ctx.generate / ctx.chat.
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    # Overlong handling (DAPO). overlong_buffer > 0: each trajectory's reward gets a penalty
    # falling linearly from 0 to -overlong_penalty over the last overlong_buffer tokens before
    # overlong_max_tokens (None: max_new_tokens), counting every token the model wrote in the
    # trajectory; overlong_filter: truncated samples stay in their group's baseline, out of the loss.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    overlong_max_tokens: int | None = None
    overlong_filter: bool = False
    # The model's chat format (slimish/formats). Template variables for every prompt the run
    # renders (e.g. {enable_thinking: false} for Qwen3, {thinking: true} for DeepSeek-V3.1):
    # rollouts, the capture endpoint, SFT and evaluation alike.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # SGLang's parser names (`--tool-call-parser`, `--reasoning-parser`); None: detected from the
    # chat template; "none": off.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # How the capture endpoint continues a conversation whose template re-renders history (Qwen3
    # and GLM drop reasoning of turns before the last user message):
    # exact: the ids the model saw, chained turn after turn: one sample, trained on what the
    #   model really saw, though a served model would see that history re-rendered;
    # template: each turn's prompt is the template's rendering of the conversation; a turn whose
    #   rendering does not extend the ids before it starts a new segment (a separate sample).
    history: str = "exact"
    # The gateway realigns a reply an agent sent back changed (reformatted, trimmed) when its
    # rendering differs from the model's ids in at most this many of them (those are then the
    # environment's, mask 0); a larger change starts a new segment.
    realign_tokens: int = 8

    def __post_init__(self) -> None:
        at_least(
            1,
            self,
            "rollout.",
            "n_samples_per_prompt",
            "rollout_batch_size",
            "max_concurrency",
            "max_new_tokens",
            "over_sampling",
            "max_prompts_factor",
        )
        at_least(0, self, "rollout.", "max_consecutive_failures", "overlong_buffer", "overlong_penalty")
        limit = self.overlong_max_tokens or self.max_new_tokens
        if self.overlong_buffer > limit:
            raise ValueError(
                f"rollout.overlong_buffer ({self.overlong_buffer}) must be at most the length it ends at "
                f"(rollout.overlong_max_tokens or max_new_tokens: {limit})"
            )
        one_of("rollout.history", self.history, ("exact", "template"))
        check_parsers("rollout.", self.tool_call_parser, self.reasoning_parser)


@dataclass
class BufferConfig:
    max_staleness: int = 0  # weight versions a trained sample may lag behind; 0 = on-policy
    # Mask out the tokens older than the bound instead of dropping the whole group (async: the
    # long tail outlives the bound, and dropping it biases training toward short samples).
    mask_stale_tokens: bool = False

    def __post_init__(self) -> None:
        at_least(0, self, "buffer.", "max_staleness")


ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo")  # from rewards alone
CRITIC_ADVANTAGES = ("gae",)  # per token, from a value model (the critic section)
LOSSES = ("ppo", "gspo")
LOSS_REDUCTIONS = ("token", "sample", "trajectory", "dr_grpo")
SEGMENT_CREDITS = ("broadcast", "split", "last")  # or module:function
KL_ESTIMATORS = ("k1", "k2", "k3")


@dataclass
class OPDConfig:
    """On-policy distillation: each trained token's advantage is the task advantage minus
    coef * (log pi_old - log pi_teacher), a per-token reverse-KL penalty toward the teacher
    (`launch.teacher`), whose log-probs of the sampled tokens the rollout side fetches."""

    coef: float = 0.0  # weight of the teacher's per-token signal; 0 = off (no teacher is started)
    # false: pure distillation: the task advantage is 0 and only the teacher trains the policy.
    # Rewards are still computed and logged where the rollout / reward fn gives them (a sample
    # without one scores 0.0 instead of failing); the zero-reward-variance filter is refused
    # (it would drop groups by a reward that is not trained on): set rollout.filter_fn=null.
    task_reward: bool = True

    def __post_init__(self) -> None:
        at_least(0, self, "algorithm.opd.", "coef")
        if not self.task_reward and self.coef == 0:
            raise ValueError(
                "algorithm.opd.task_reward=false (pure distillation) needs algorithm.opd.coef > 0: nothing would train the policy"
            )


@dataclass
class AlgorithmConfig:
    """Advantages and losses (slimish/trainer/algorithms.py has the formulas and the reasons)."""

    # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline | gspo (= grpo) | gae (PPO with a
    # critic: per-token GAE over a value model, the `critic` section; torch backend), or module:function,
    # `fn(rewards: Tensor[T], group: Tensor[T]) -> Tensor[T]`: one advantage per trajectory
    # (`rewards` per trajectory, `group` its group's index), in place of the built-in estimators
    advantage: str = "grpo"
    advantage_eps: float = 1e-6  # added to the std in grpo / reinforce_pp (TRL uses 1e-4)
    # ppo (token ratio) | gspo (sequence ratio), or module:function, `fn(logprobs, old_logprobs,
    # advantages, mask) -> Tensor[B, T]`: the per-token policy loss (all inputs [B, T]), in place
    # of the clipped surrogate; reduction, KL, entropy and TIS apply to it as to the built-ins
    loss: str = "ppo"

    eps_clip: float = 0.2
    # DAPO clip-higher (e.g. 0.28); None: eps_clip. Clipping (either side) binds only where the
    # policy has moved from the old log-probs: updates_per_step > 1, or async (stale samples);
    # with one update per step on fresh samples the ratio is 1 and it does nothing.
    eps_clip_high: float | None = None
    dual_clip_c: float | None = None  # dual clip for negative advantages (e.g. 3.0); must be > 1
    # token: sum / trained tokens of the batch | sample: mean of per-sample means |
    # trajectory: mean of per-trajectory means (its segments and fan-out siblings pooled) |
    # dr_grpo: sum / (samples x rollout.max_new_tokens)
    loss_reduction: str = "token"
    # How a trajectory's advantage reaches its samples (segments of a split conversation, fan-out
    # siblings): broadcast (each gets it), split (divided by their number), last (the last one
    # only), or module:function, `fn(samples: list[Sample]) -> list[float]`, each one's share.
    # Advantages are computed over trajectories: each counts once in its group's baseline.
    segment_credit: str = "broadcast"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"  # k1 | k2 | k3
    kl_in_reward: bool = False  # subtract kl_coef * KL from the reward instead of a loss term
    # KL loss term times pi/pi_old per token: DeepSeek-V3.2's unbiased KL gradient (TRL's default)
    kl_importance_weight: bool = False
    entropy_coef: float = 0.0
    # InstructGPT's PPO-ptx: each optimiser step also trains on `sft.batch_size` demonstrations
    # (`sft.source`, else `data.source`'s), their token-mean NLL times ptx_coef added to the loss.
    # Why: RL alone can drive an answer's probability to 0 on the prompts it is right for, and a
    # token never sampled is never rewarded; the demonstrations keep pulling every answer they
    # show. 0 = off.
    ptx_coef: float = 0.0
    tis_cap: float | None = None  # truncated importance sampling against rollout logprobs
    mis_cap: float | None = None  # masked importance sampling: tokens whose weight exceeds it are dropped
    recompute_old_logprobs: bool = False  # else the rollout's logprobs are the old policy
    opd: OPDConfig = field(default_factory=OPDConfig)  # on-policy distillation (teacher: launch.teacher)
    # GAE (advantage=gae): discount and trace decay over a response's trained tokens. 1 and 1 (as
    # verl): the advantage is then the return minus the critic's value, unbiased whatever the
    # critic (which starts untrained); lam < 1 trades that bias for variance.
    gamma: float = 1.0
    lam: float = 1.0

    def __post_init__(self) -> None:
        choices = {
            "advantage": ADVANTAGES + CRITIC_ADVANTAGES,
            "loss": LOSSES,
            "loss_reduction": LOSS_REDUCTIONS,
            "kl_estimator": KL_ESTIMATORS,
        }
        for name, allowed in choices.items():
            if name in ("advantage", "loss"):
                if ":" in getattr(self, name):
                    continue  # module:function, loaded and checked when the trainer starts
                allowed = (*allowed, "module:function")
            one_of(f"algorithm.{name}", getattr(self, name), allowed)
        if self.segment_credit not in SEGMENT_CREDITS and ":" not in self.segment_credit:
            raise ValueError(
                f"algorithm.segment_credit must be one of {', '.join(SEGMENT_CREDITS)} or module:function, "
                f"got {self.segment_credit!r}"
            )
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"algorithm.eps_clip must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"algorithm.eps_clip_high must be > 0, got {self.eps_clip_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"algorithm.dual_clip_c must be > 1, got {self.dual_clip_c}")
        for name in ("tis_cap", "mis_cap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"algorithm.{name} must be > 0, got {getattr(self, name)}")
        if self.tis_cap is not None and self.mis_cap is not None:
            raise ValueError(
                "algorithm.tis_cap and algorithm.mis_cap: set one importance-sampling correction, not both"
            )
        at_least(0, self, "algorithm.", "advantage_eps", "kl_coef", "ptx_coef")
        for name in ("gamma", "lam"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"algorithm.{name} must be in [0, 1], got {getattr(self, name)}")


LR_SCHEDULES = ("constant", "cosine", "linear")
TRANSPORTS = ("distributed", "disk")
PAUSE_MODES = ("abort", "retract", "in_place", "drain")
# trainer.lora's pushes into SGLang 0.5.23 engines (slimish/trainer/weight_sync.py): a reload from disk under an abort pause.
SGLANG_LORA = (
    "SGLang 0.5.23 loads an adapter only from a directory (/load_lora_adapter; its broadcast update has no adapter "
    "target), and its unload waits for the adapter's requests, which only an abort pause ends: set "
    "weight_sync.transport=disk and weight_sync.pause_mode=abort"
)


LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass
class LoraConfig:
    """LoRA (`peft`) on the torch backend: only the adapter trains and only the adapter is pushed;
    the engines serve it by name beside the base (and beside other runs' adapters)."""

    enabled: bool = False
    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    # Applied in the gradient passes only (SFT and RL updates): log-probs, old and reference, are
    # always taken without it, as the engines sample.
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    # The adapter's name on the engines (`lora_path` of every generate call of the run). Runs that
    # share engines (launch.router_url) need different names.
    name: str = "policy"
    export_merged: bool = False  # also write merged HF weights at the end (RUN_DIR/hf/merged), beside the adapter

    def __post_init__(self) -> None:
        at_least(1, self, "trainer.lora.", "rank")
        if self.alpha <= 0 or not 0 <= self.dropout < 1:
            raise ValueError(f"trainer.lora.alpha must be > 0 and dropout in [0, 1), got {self.alpha}, {self.dropout}")
        if not self.target_modules:
            raise ValueError("trainer.lora.target_modules must name at least one module (e.g. q_proj v_proj)")
        if not LORA_NAME.fullmatch(self.name):
            raise ValueError(
                f"trainer.lora.name must be letters, digits, '.', '_' or '-' (it is a URL and directory part), got {self.name!r}"
            )

    @property
    def adapter(self) -> str | None:
        """The adapter name generate calls carry; None without LoRA (the base model)."""
        return self.name if self.enabled else None


@dataclass
class TrainerConfig:
    """The policy's optimiser and batching (slimish/trainer/base.py and the backends beside it)."""

    backend: str = "torch"  # torch | megatron
    nproc: int = 1  # torchrun ranks `slimish train` launches
    # Megatron backend only: tensor- and pipeline-parallel sizes; the data-parallel size is the
    # world size / (tp * pp), and a batch is split over data-parallel ranks only.
    tp: int = 1
    pp: int = 1
    # Megatron backend only: the layer spec (megatron_bridge BridgeConfig.spec). local: Megatron-Core
    # modules, CPU or GPU; te: Transformer Engine's fused norm+linear modules, GPU only.
    megatron_spec: str = "local"
    lr: float = 1e-5
    lr_schedule: str = "constant"  # constant | cosine | linear (to 0 at the last optimiser step), after warmup
    warmup_steps: int = 0  # optimiser steps of linear warmup
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping (the norm is still reported)
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest sample) of one micro-batch
    # Torch backend: log-probs and entropies from the LM head this many scored (response) tokens at
    # a time, each chunk checkpointed, so full-vocabulary fp32 logits never exist for the whole
    # micro-batch (the long-context OOM); 0: the whole micro-batch's logits at once.
    logprob_chunk_tokens: int = 1024
    updates_per_step: int = 1  # optimiser steps per rollout batch: the batch split into this many mini-batches
    # The compute dtype, and the engines' weights pushed in it. None: float32 on CPU (bf16 is
    # 12-18x slower there), bfloat16 on GPU. torch backend: weights and AdamW stay fp32, the
    # forward runs under autocast to it; megatron: params_dtype, fp32 main params in its optimizer.
    dtype: str | None = None
    # CPU intra-op threads while training (train and SFT steps); 0: this machine's cores / local
    # ranks in sync mode, where the engines idle while the trainer trains (2 threads: 1.7x faster
    # fwd+bwd on 2 cores), and OMP_NUM_THREADS in async mode, where they do not.
    cpu_threads: int = 0
    ref_model: str | None = None  # None with kl_coef > 0: a frozen copy of the policy at its first RL step
    seed: int | None = None  # model initialisation (Megatron); None: the run's seed
    lora: LoraConfig = field(default_factory=LoraConfig)  # off by default: full fine-tuning

    def __post_init__(self) -> None:
        one_of("trainer.backend", self.backend, ("torch", "megatron"))
        if self.lora.enabled and self.backend != "torch":
            raise ValueError(
                f"trainer.lora needs trainer.backend=torch, got {self.backend!r}: the Megatron backend trains every weight"
            )
        if self.backend == "torch" and (self.tp, self.pp) != (1, 1):
            raise ValueError(f"trainer.tp and trainer.pp need trainer.backend=megatron, got tp={self.tp}, pp={self.pp}")
        one_of("trainer.megatron_spec", self.megatron_spec, ("local", "te"))
        one_of("trainer.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"trainer.betas must be two numbers in [0, 1), got {list(self.betas)}")
        at_least(1, self, "trainer.", "nproc", "tp", "pp", "micro_batch_tokens", "updates_per_step")
        at_least(
            0,
            self,
            "trainer.",
            "lr",
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "cpu_threads",
            "logprob_chunk_tokens",
        )
        one_of("trainer.dtype", self.dtype, (None, "float32", "bfloat16", "float16"))

    def compute_dtype(self, device_type: str) -> str:
        """`dtype`, or its default on a `device_type` ("cpu", "cuda") device."""
        return self.dtype or ("bfloat16" if device_type == "cuda" else "float32")


@dataclass
class CriticConfig:
    """The value model of PPO with a critic (algorithm.advantage=gae; slimish/trainer/torch_backend.py):
    an HF model with a scalar head on every token, its own AdamW."""

    model: str | None = None  # HF model directory its backbone starts from; None: the run's `model`
    lr: float | None = None  # constant learning rate; None: trainer.lr
    # RL steps at the start where only the critic trains (the policy's schedule still advances),
    # so that the first policy updates see values fitted to the rewards
    warmup_steps: int = 0
    # PPO value clipping: a value moves at most this far from its old value per batch before its
    # loss stops pulling it (the larger of clipped and unclipped squared errors); None: no clip
    value_clip: float | None = 0.5

    def __post_init__(self) -> None:
        at_least(0, self, "critic.", "warmup_steps")
        for name in ("lr", "value_clip"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"critic.{name} must be > 0 (or null), got {getattr(self, name)}")


@dataclass
class WeightSyncConfig:
    """Trainer rank 0 -> engines (slimish/trainer/weight_sync.py, docs/protocol.md 4)."""

    transport: str = "distributed"  # distributed (broadcast) | disk (update_weights_from_disk)
    bucket_mb: float = 128  # tensors per /update_weights_from_distributed call, by wire bytes
    flattened: bool = False  # one flattened uint8 broadcast per bucket (load_format flattened_bucket)
    backend: str | None = None  # gloo on CPU, nccl on GPU when None
    dtype: str | None = None  # wire dtype, e.g. bfloat16 to halve the bytes to bf16 engines; None: the trainer's
    # What in-flight generation does during a push: abort (return partial tokens), retract
    # (requeue, recompute with the new weights), in_place (keep the KV: no cache flush either, which
    # SGLang refuses while the parked batch runs), or drain (running requests finish on the old
    # weights first, SGLang's writer lock; new ones wait for the push).
    pause_mode: str = "retract"
    group_name: str = "weight_update_group"
    # Trainer rank 0's address as the engines reach it. None: 127.0.0.1, except under
    # launch.mode=ray on a cluster (launch.ray_address set), where engines on other nodes cannot
    # reach a loopback: this node's IP as Ray sees it (ray.util.get_node_ip_address, as slime).
    master_address: str | None = None
    timeout_s: float = 600.0  # a broadcast or HTTP call that takes longer fails the push
    disk_dir: str | None = None  # transport disk: where pushes are written (engines must see it); None: a temp dir

    def __post_init__(self) -> None:
        one_of("weight_sync.transport", self.transport, TRANSPORTS)
        one_of("weight_sync.pause_mode", self.pause_mode, PAUSE_MODES)
        if self.master_address is None:  # then load_run_config puts the node's IP here for a run on a Ray cluster
            self.master_address = "127.0.0.1"
        if self.bucket_mb <= 0 or self.timeout_s <= 0:
            raise ValueError(f"weight_sync.bucket_mb and timeout_s must be > 0, got {self.bucket_mb}, {self.timeout_s}")


@dataclass
class CheckpointConfig:
    """slimish/trainer/checkpoint.py: run_dir/checkpoints/step_NNNNNNNN, written atomically."""

    every: int = 0  # steps; 0 = only at the end
    keep: int = 2  # newest checkpoints kept; 0 = all
    resume: str | None = None  # auto (newest in run_dir, or a fresh start) | a checkpoint directory | None

    def __post_init__(self) -> None:
        at_least(0, self, "checkpoint.", "every", "keep")


@dataclass
class EvalDataset:
    """One held-out dataset of `eval.datasets`; a field left null takes the `eval` section's value
    (sampling: `eval.temperature`, the rest of `rollout`'s)."""

    name: str = MISSING  # metrics are eval/NAME/...
    source: str = MISSING  # as eval.source
    rollout_fn: str | None = None  # None: rollout.rollout_fn
    reward_fn: str | None = None  # None: rollout.reward_fn
    n_prompts: int | None = None
    n_samples_per_prompt: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts, all of it here: `source` is one dataset (metrics eval/...),
    `datasets` any number more (eval/NAME/...). Each reports reward, accuracy (reward >= 1),
    pass@k for k = 1, 2, 4, ... up to n_samples_per_prompt, and mean@n (mean accuracy)."""

    every: int = 5  # steps; 0 = never
    source: str | None = None  # held-out prompts; `task:NAME` uses the task's held-out split
    n_prompts: int = 64
    n_samples_per_prompt: int = 1
    temperature: float = 0.0
    datasets: list[EvalDataset] = field(default_factory=list)

    def __post_init__(self) -> None:
        at_least(1, self, "eval.", "n_samples_per_prompt", "n_prompts")
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.datasets: names must be unique, got {names}")
        for i, d in enumerate(self.datasets):
            at_least(1, d, f"eval.datasets[{i}].", "n_prompts", "n_samples_per_prompt", "max_new_tokens")


@dataclass
class SFTConfig:
    steps: int = 0  # supervised warm-start steps before RL; 0 = none
    source: str | None = None  # JSONL with prompt and response, or `task:NAME` (the task's demonstrations)
    batch_size: int = 32
    lr: float = 1e-4


WANDB_MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig:
    """Weights & Biases: one more sink beside metrics.jsonl and TensorBoard (slimish/metrics.py),
    the same keys at the same steps; `pip install 'slimish[wandb]'`, imported only when enabled."""

    enabled: bool = False  # log to W&B too (pip install -e '.[wandb]')
    project: str = "slimish"  # the W&B project
    name: str | None = None  # the run's display name; None: run_dir's last folder
    entity: str | None = None  # team or user; None: the logged-in user's default
    # online | offline | disabled (off, as enabled=false). None: $WANDB_MODE when set, else online
    # with WANDB_API_KEY set, offline without (`wandb sync DIR` uploads an offline run later).
    mode: str | None = None
    dir: str | None = None  # where wandb/ goes; None: $WANDB_DIR when set, else run_dir
    # Groups per step added to the `samples` table (prompt, response, reward, status, one row per
    # sample; an incremental table: each step uploads only its new rows); 0 = no table.
    sample_groups: int = 2

    def __post_init__(self) -> None:
        one_of("metrics.wandb.mode", self.mode, (None, *WANDB_MODES))
        at_least(0, self, "metrics.wandb.", "sample_groups")


@dataclass
class MetricsConfig:
    """Where per-step metrics go besides the console, metrics.jsonl and TensorBoard (always on)."""

    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Trained groups per step whose samples (every token) go to RUN_DIR/view/samples.jsonl for
    # `slimish view` (slimish/view.py); 0 = none (view/timeline.jsonl is always written).
    view_groups: int = 4

    def __post_init__(self) -> None:
        at_least(0, self, "metrics.", "view_groups")


@dataclass
class RunConfig:
    model: str = MISSING  # HF model directory (policy initial weights and tokenizer)
    run_dir: str = "runs/latest"
    steps: int = 10  # RL steps
    seed: int = 0  # the one seed: python, numpy and torch, and data.seed / trainer.seed unless set
    # sync: rollout, then train, then push. async: the rollout keeps going while the trainer
    # trains, on weights up to buffer.max_staleness versions old (0: the same as sync).
    mode: str = "sync"
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)  # used with algorithm.advantage=gae
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def __post_init__(self) -> None:
        one_of("mode", self.mode, ("sync", "async"))
        opd = self.algorithm.opd
        if opd.coef > 0 and not self.launch.teacher.configured:
            raise ValueError(
                "algorithm.opd.coef > 0 needs a teacher: set launch.teacher.model (an HF directory; the run starts "
                "its engines), launch.teacher.router_url (a running teacher server) or launch.teacher.served_name "
                "(a teacher registered by name on launch.router_url)"
            )
        if not opd.task_reward and self.rollout.filter_fn == ZERO_VARIANCE_FILTER:
            raise ValueError(
                f"algorithm.opd.task_reward=false (pure distillation) trains every group whatever its rewards: "
                f"set rollout.filter_fn=null (or a filter that does not judge by reward), not {ZERO_VARIANCE_FILTER}"
            )
        if self.algorithm.advantage == "gae" and self.trainer.backend != "torch":
            raise ValueError(
                f"algorithm.advantage=gae (PPO with a critic) needs trainer.backend=torch, got {self.trainer.backend!r}: "
                "the Megatron backend has no value model"
            )
        if self.algorithm.advantage == "gae" and self.trainer.lora.enabled:
            raise ValueError(
                "algorithm.advantage=gae with trainer.lora: the critic would be a second full model trained in full, "
                "which LoRA is meant to avoid; use a reward-only advantage (e.g. grpo) with LoRA"
            )
        sync = self.weight_sync
        if (
            self.trainer.lora.enabled
            and self.launch.engine_kind == "sglang"
            and (sync.transport, sync.pause_mode) != ("disk", "abort")
        ):
            raise ValueError(f"trainer.lora with launch.engine_kind=sglang: {SGLANG_LORA}")
        for section in (self.data, self.trainer):
            if section.seed is None:
                section.seed = self.seed


# Old key -> its new name: still read for a release, with a warning.
RENAMED_KEYS = {
    "data.eval_source": "eval.source",
    "rollout.eval_n_prompts": "eval.n_prompts",
    "rollout.eval_n_samples_per_prompt": "eval.n_samples_per_prompt",
    "rollout.eval_temperature": "eval.temperature",
}


def _rename(values: Any, where: str) -> Any:
    """Move renamed keys of a YAML mapping to their new place, warning once per key."""
    for old, new in RENAMED_KEYS.items():
        section, key = old.split(".")
        node = values.get(section) if isinstance(values, dict) else None
        if isinstance(node, dict) and key in node:
            log.warning("%s: %s is now %s; the old name will stop working in the next release", where, old, new)
            values.setdefault(new.split(".")[0], {})[new.split(".")[1]] = node.pop(key)
    return values


def load_run_config(path: str | None, overrides: list[str] = (), **named: Any) -> RunConfig:
    """YAML file, then `key=value` overrides (dotted keys), then named flags (e.g. rollout.rollout_fn)."""
    try:
        cfg = OmegaConf.structured(RunConfig)
        given = [_rename(OmegaConf.to_container(OmegaConf.load(path)), path)] if path else []
        given.append(_rename(OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides))), "key=value"))
        for values in given:
            cfg = OmegaConf.merge(cfg, values)
        for key, value in named.items():
            if value is not None:
                OmegaConf.update(cfg, key, value, merge=True)
        if (
            not any((v.get("weight_sync") or {}).get("master_address") for v in given)
            and cfg.launch.mode == "ray"
            and cfg.launch.ray_address
        ):
            import ray.util  # unset on a Ray cluster: engines on other nodes reach rank 0 at this node's IP

            cfg.weight_sync.master_address = ray.util.get_node_ip_address()
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except (ValueError, TypeError, OmegaConfBaseException, FileNotFoundError) as exc:
        raise SystemExit(f"bad config{f' {path}' if path else ''}: {exc}") from None


def document_run_config(parser: argparse.ArgumentParser) -> None:
    """`--help` ends with every `key=value` a run takes, its default and its comment."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "every key (default): what it does\n" + "\n".join(describe_config(RunConfig))
