"""`slimish tinker`'s settings: one schema, so a flag, its default and its help cannot drift apart."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omegaconf import MISSING

from slimish.net import FD_DOC
from slimish.schema import at_least, doc


@dataclass
class TinkerConfig:
    """A Tinker API server: one base model trained under LoRA adapters, one built-in engine sampling them."""

    model: str = doc(MISSING, "HF model directory: the base model every adapter trains on, and the tokenizer")
    root: str = doc("runs/tinker", "run directory: checkpoints (tinker://RUN/weights|sampler_weights/NAME) and logs")
    model_name: str | None = doc(
        None,
        "the name get_info reports (e.g. Qwen/Qwen3-8B, so the cookbook picks its renderer); None: the model directory",
    )
    host: str = doc("127.0.0.1", "bind address; the API has no TLS, so loopback unless you trust the network")
    port: int = doc(8000, "the port TINKER_BASE_URL points at")
    fd: int | None = doc(None, FD_DOC)
    api_key: str | None = doc(None, "required X-API-Key on every request; None: any key (the SDK always sends one)")
    device: str = doc("cpu", "where the base model trains and the engine samples: cpu, cuda or cuda:K (both on it)")
    max_lora_rank: int = doc(64, "the largest LoRA rank a client may create: the engine reserves it per adapter")
    keep_snapshots: int = doc(
        4, "unnamed sampler snapshots (save_weights_and_get_sampling_client) kept loaded per model; older are unloaded"
    )
    poll_s: float = doc(20.0, "retrieve_future waits this long for a result before 'try_again' (the SDK waits 45 s)")
    seq_gap_s: float = doc(
        60.0, "a model's request waits this long for a missing earlier seq_id, then runs (the gap is logged)"
    )
    start_timeout: float = doc(300.0, "seconds the engine gets to load and answer /health")
    micro_batch_tokens: int = doc(8192, "forward_backward: padded tokens (datums x longest) of one forward pass")
    logprob_chunk_tokens: int = doc(
        256, "forward_backward: the LM head's tokens at a time (a [chunk, vocab] fp32 logits block, checkpointed)"
    )

    def __post_init__(self) -> None:
        at_least(1, self, "", "max_lora_rank", "keep_snapshots", "micro_batch_tokens", "logprob_chunk_tokens")
        at_least(0.1, self, "", "poll_s", "seq_gap_s")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ValueError(f"device must be cpu, cuda or cuda:K, got {self.device!r}")
        if self.poll_s >= 45:
            raise ValueError(f"poll_s ({self.poll_s}) must be under 45: the SDK gives up on a poll after 45 s")
