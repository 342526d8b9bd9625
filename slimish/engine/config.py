"""The built-in engine's schema (`slimish engine`): every default of the engine lives here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omegaconf import MISSING

from slimish.net import FD_DOC
from slimish.schema import at_least, doc, doc_factory, one_of

DECODE_ATTENTION_BACKENDS = ("sdpa", "matmul")  # slimish/engine/attention.py
PARSER_DOC = (
    "SGLang's parser names for the OpenAI routes (slimish/formats); None: detected from the chat template; "
    '"none": off.'
)


@dataclass
class EngineConfig:
    """The built-in engine (`slimish engine`)."""

    model: str = doc(MISSING, "HF model directory (config, weights, tokenizer)")
    host: str = doc("127.0.0.1", "loopback unless told otherwise")
    port: int = doc(30000, "SGLang's default; always pass one explicitly when several servers run")
    fd: int | None = doc(None, FD_DOC)
    max_running_requests: int = doc(32, "rows in the running batch")
    max_prefill_tokens: int = doc(4096, "prompt tokens prefilled per scheduler step (decode is never starved)")
    context_length: int | None = doc(None, "default: the model's max_position_embeddings")
    dtype: str = doc("float32", "fp32 on CPU: bf16 is 12-18x slower there (docs/benchmarks.md, CPU facts)")
    tp_size: int = doc(
        1,
        "SGLang's tensor-parallel size (`--tp-size`), accepted so that an SGLang launch line starts this engine; it "
        "runs on one device, so only 1 is.",
    )
    device: str = doc(
        "cpu",
        "cpu | cuda | cuda:K. The model and every tensor the engine makes live there, so a weight push over an NCCL "
        "group (docs/protocol.md 4) lands straight in GPU parameters.",
    )
    served_model_name: str | None = doc(None, "default: the model path")
    tool_call_parser: str | None = doc(None, PARSER_DOC)
    reasoning_parser: str | None = doc(None, PARSER_DOC)
    api_key: str | None = doc(None, "Bearer key for every route except health and metrics")
    admin_api_key: str | None = doc(None, "Bearer key for weight and control routes (default: api_key)")
    weight_sync_timeout_s: int = doc(600, "a trainer gone mid-broadcast frees the engine after this")
    stream_interval: int = doc(1, "decode steps between streamed chunks")
    seed: int = doc(0, "torch seed for requests without `sampling_seed`")
    cpu_threads: int = doc(
        0,
        "Torch intra-op CPU threads (torch.set_num_threads); 0: torch's default, from OMP_NUM_THREADS (a run's "
        "launcher sets 1 unless the environment sets it, or as many as the engine's CPUs under "
        "launch.cpu_placement=split). enable_deterministic_inference runs one.",
    )
    log_level: str = "warning"
    # Limits; each refusal names the field and the limit. Requests beyond the limits of what the
    # engine can hold are a 400; a full engine is a 503 with `Retry-After` (try again later or
    # elsewhere: the router does).
    max_prompt_tokens: int | None = doc(None, "None: only the context length bounds a prompt")
    max_new_tokens_cap: int | None = doc(None, "larger explicit values are refused, larger defaults lowered")
    max_body_bytes: int = doc(32 << 20, "a batch of long `input_ids` prompts is a few MiB")
    max_queued_requests: int = doc(
        2048,
        "Sequences (n and batch items count one each) allowed to wait beyond the running batch.",
    )
    retry_after_s: int = doc(1, "the `Retry-After` of a 503 when the queue is full")
    disable_radix_cache: bool = doc(
        False,
        "Prefix cache (SGLang's radix cache): KV of whole prompt pages is reused by later requests that start with the "
        "same tokens, and identical prompts admitted together (n copies) are prefilled once. Exact: prefill always "
        "runs page by page on one grid, so outputs and log-probs are the same with the cache on or off. Emptied by "
        "/flush_cache and weight loads.",
    )
    page_size: int = doc(64, "tokens per KV page: the cache's unit and each prefill forward's length")
    radix_cache_max_tokens: int = doc(32768, "cached KV beyond this is evicted, least recently used first")
    decode_attention_backend: str = doc(
        "matmul",
        'How one-token (decode) forwards attend: "matmul" (batched matmuls over the live KV columns; up to 3 percent '
        'faster per decode step on CPU in interleaved A/B runs, benchmarks/README.md) or "sdpa" (HF\'s SDPA). Prefill '
        "always uses SDPA, so the two differ only by rounding.",
    )
    cpu_packed_linear: bool = doc(
        True,
        "An fp32 model on the CPU runs its linear layers on a copy of each weight packed once for oneDNN "
        "(slimish/engine/packed.py): ~1.5x faster projections at 32 decode rows, for twice the linear weights' memory; "
        "llama-family decode steps also pack each layer's q, k, v and gate, up weights together (one GEMM each, "
        "another ~0.6x of them on the 30M benchmark model). Off under enable_deterministic_inference (its own kernels).",
    )
    enable_deterministic_inference: bool = doc(
        False,
        "SGLang's flag: a sequence's logits, and so its log-probs and (with a `sampling_seed`) its tokens, are bit "
        "for bit independent of its batch mates, the batch size, prefill pages and prefix-cache hits: batch-invariant "
        "kernels (slimish/batch_invariant.py) on one intra-op thread, the ones the trainer uses with "
        "algorithm.true_on_policy. Dense models without LoRA; costs throughput (benchmarks/true_on_policy.py).",
    )
    await_weights: bool = doc(
        False,
        "Serve nothing (503, /health included) until a weight push has set every parameter: for an engine that joins "
        "or rejoins a running training run, so it never serves stale weights.",
    )
    shared_weights: str | None = doc(
        None,
        "slimish only, not an SGLang flag: the directory of a colocated run's shared weight store (launch.colocate, "
        "slimish/colocate.py). At load every parameter becomes a view of it and the loaded copy is dropped: the engine "
        "serves the trainer's weights in place, a push is a version flip, and a load into them (from disk or a "
        "broadcast; an adapter's is fine) is refused. The store holds `dtype`'s weights.",
    )
    enable_return_routed_experts: bool = doc(
        False,
        "SGLang's flag: capture each MoE layer's top-k experts for every token forwarded, so that requests may ask "
        "for them (`return_routed_experts`, docs/protocol.md); without it such a request is a 400. Off: no capture "
        "cost.",
    )
    # LoRA serving (SGLang's flags). Adapters are PEFT directories (adapter_config.json +
    # adapter_model.safetensors); a request names one by `lora_path` (/generate) or `model` (OpenAI).
    enable_lora: bool = doc(False, "also on when lora_paths is given")
    lora_paths: list[str] = doc_factory(
        list,
        'Adapters loaded at start, each PATH, NAME=PATH or JSON {"lora_name", "lora_path", "pinned"}.',
    )
    max_loras_per_batch: int = doc(8, "distinct adapters in the running batch (base rows need none); rows beyond wait")
    max_loaded_loras: int | None = doc(None, "adapters held at once (None: no limit); at least max_loras_per_batch")
    max_lora_rank: int | None = doc(None, "smaller ranks are padded to it; None: the largest rank among lora_paths")
    lora_target_modules: list[str] = doc_factory(
        list,
        "Module names adapters may target (q_proj, v_proj, ..., or all); empty: the union of the lora_paths adapters' "
        "targets, or all linear layers of the decoder when none is given.",
    )

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
        at_least(0, self, "", "cpu_threads")
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
        if self.enable_deterministic_inference and (self.enable_lora or self.lora_paths):
            raise ValueError(
                "enable_deterministic_inference (--enable-deterministic-inference): not with LoRA serving "
                "(enable_lora, lora_paths); the adapters' kernels are not batch-invariant"
            )
        if self.enable_deterministic_inference and self.device != "cpu":
            raise ValueError(
                "enable_deterministic_inference (--enable-deterministic-inference): the built-in engine's batch-invariant "
                f"kernels are made and measured for CPU (MKL); device is {self.device!r}"
            )
        if self.tp_size != 1:
            raise ValueError(
                f"engine.tp_size (--tp-size) must be 1: the built-in engine runs on one device; tensor "
                f"parallelism needs SGLang (launch.engine_kind=sglang), got {self.tp_size}"
            )
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"engine.device (--device) must be cpu, cuda or cuda:K, got {self.device!r}")
        if self.shared_weights and (self.device != "cpu" or self.await_weights or self.cpu_packed_linear):
            raise ValueError(
                "engine.shared_weights (--shared-weights) maps host memory the trainer writes: it needs device=cpu, "
                "no await_weights (the store is always whole) and cpu_packed_linear off (a packed copy would be a "
                f"second, stale copy), got device={self.device!r}, await_weights={self.await_weights}, "
                f"cpu_packed_linear={self.cpu_packed_linear}"
            )
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
