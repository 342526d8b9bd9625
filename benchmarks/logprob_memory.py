"""Peak memory of a train step: full-vocabulary logits (`trainer.logprob_chunk_tokens=0`) against
chunked log-probs (`trainer.logprob_chunk_tokens=1024`), on CPU, in one run.

The model is a random-init llama with a 32k vocabulary and a small body (hidden 128, 2 layers:
the LM head is where the memory goes), built once into `--model-cache`. The batch is one group of
`--samples` samples of `--tokens` / `--samples` tokens each (64 prompt tokens, the rest response),
one micro-batch: 4096 tokens by default. Each variant runs in a fresh subprocess with
`TorchTrainer` and the default GRPO loss (entropy measured, not trained): a no-grad `logprobs`
pass (the old / reference log-probs), then two `train_step`s (forward, backward of the loss,
AdamW step). The second step is the steady state one; the first also allocates AdamW's state.

How memory is measured: the process's resident set high-water mark (`VmHWM` in
/proc/self/status), reset just before each measured phase by writing 5 to /proc/self/clear_refs,
after `gc.collect()` and glibc's `malloc_trim(0)`; the children run with glibc's mmap threshold
fixed at 1 MiB (`MALLOC_MMAP_THRESHOLD_`), so every tensor above 1 MiB is mapped on its own and
given back when freed, and freed heap memory from an earlier phase cannot hide (or fragmentation
inflate) a phase's own allocations. Printed: the phase's peak above the RSS it started from
("added"), which is what the logits cost, and the process's absolute peak (python, torch, the
model, its gradients and AdamW state included). `tracemalloc` does not see torch's allocations;
RSS does, including the allocator's slack, so it is an upper bound of what the phase needed.
Times are printed too, but the fixed mmap threshold slows both variants a little; this is a
memory benchmark. Target: chunked added peak of train step 2 <= 0.5x full.

    .venv/bin/python benchmarks/logprob_memory.py                    # 4096 tokens, vocab 32000 (~1-2 min)
    .venv/bin/python benchmarks/logprob_memory.py --tokens 1024      # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

TARGET = 0.5
# glibc serves allocations below its mmap threshold (dynamic, up to 32 MiB) from the heap and keeps
# them after free, fragmented: the RSS then over-counts phases whose tensors are a few MiB, and by
# chance. A fixed 1 MiB threshold maps every larger tensor on its own, given back when freed.
MMAP_THRESHOLD = 1 << 20
PROMPT_TOKENS = 64
BODY = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def bench_model(cache: Path, vocab: int, max_tokens: int) -> Path:
    """A random-init llama of `vocab` tokens and a small body; the tiny llama's tokenizer (ids
    above its own vocabulary are simply never decoded)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from slimish.tiny_model import make_tiny_model

    path = cache / f"llama-v{vocab}-h{BODY['hidden_size']}-l{BODY['num_hidden_layers']}-p{max_tokens}"
    if any(path.glob("*.safetensors")):
        return path
    make_tiny_model(path, arch="llama", size="tiny", seed=0)  # the tokenizer; the model is replaced below
    tok = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=max_tokens,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **BODY,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


def _settle() -> int:
    """Free what can be freed, reset the high-water mark; the RSS now, in KiB."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _status_kib("VmRSS")


def measure(fn) -> dict[str, float]:
    base = _settle()
    started = time.perf_counter()
    fn()
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    return {"added_mib": (peak - base) / 1024, "peak_mib": peak / 1024, "base_mib": base / 1024, "seconds": seconds}


def child(args: argparse.Namespace) -> None:
    """One variant in this (fresh) process; prints one JSON line."""
    import random

    import torch

    from slimish.config import load_run_config
    from slimish.trainer.torch_backend import TorchTrainer
    from slimish.types import Sample

    cfg = load_run_config(
        None,
        [
            f"model={args.model}",
            "data.source=unused",
            "steps=2",
            "trainer.cpu_threads=1",
            f"trainer.micro_batch_tokens={args.tokens}",
            f"trainer.logprob_chunk_tokens={args.chunk}",
        ],
    )
    trainer = TorchTrainer(cfg)
    rng = random.Random(0)
    per_sample = args.tokens // args.samples
    group = []
    for k in range(args.samples):
        s = Sample(prompt="", group_id=0, index=k)
        s.set_prompt([rng.randrange(args.vocab) for _ in range(PROMPT_TOKENS)])
        n = per_sample - PROMPT_TOKENS
        s.append_model([rng.randrange(args.vocab) for _ in range(n)], [0.0] * n)
        s.reward = float(k % 2)
        group.append(s)
    out: dict[str, object] = {
        "chunk": args.chunk,
        "tokens": sum(len(s.tokens) for s in group),
        "response_tokens": sum(s.response_length for s in group),
    }

    def old_logprobs() -> None:
        for s, lp in zip(group, trainer.logprobs(group)):
            s.rollout_logprobs = (
                lp + 0.1 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(s.index))
            ).tolist()

    out["logprobs"] = measure(old_logprobs)
    metrics: list[dict[str, float]] = []
    out["step1"] = measure(lambda: metrics.append(trainer.train_step([group], 1)))
    out["step2"] = measure(lambda: metrics.append(trainer.train_step([group], 2)))
    out["loss"] = [m["train/loss"] for m in metrics]
    out["grad_norm"] = [m["train/grad_norm"] for m in metrics]
    print(json.dumps(out), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens in the batch (one micro-batch)")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens of the chunked variant")
    p.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    model = bench_model(args.model_cache, args.vocab, args.tokens // args.samples)
    print(
        f"model {model} (vocab {args.vocab}, {BODY}), batch {args.samples} x {args.tokens // args.samples} tokens, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results = {}
    for name, chunk in (("full", 0), ("chunked", args.chunk)):
        cmd = [
            sys.executable,
            __file__,
            "--child",
            f"--model={model}",
            f"--tokens={args.tokens}",
            f"--samples={args.samples}",
            f"--vocab={args.vocab}",
            f"--chunk={chunk}",
        ]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if MMAP_THRESHOLD else None
        done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
    full, chunked = results["full"], results["chunked"]
    logits_mib = full["response_tokens"] * args.vocab * 4 / 2**20
    print(
        f"{full['tokens']} tokens, {full['response_tokens']} scored; fp32 logits of the scored tokens: {logits_mib:.0f} MiB"
    )
    print(
        f"{'phase':<26} {'full added':>11} {'chunked added':>14} {'ratio':>6}   {'full peak':>10} {'chunked peak':>13} {'ratio':>6}   "
        f"{'full s':>6} {'chunked s':>9}"
    )
    for phase, label in (
        ("logprobs", "logprobs (no grad)"),
        ("step1", "train step 1 (+AdamW init)"),
        ("step2", "train step 2"),
    ):
        a, b = full[phase], chunked[phase]
        print(
            f"{label:<26} {a['added_mib']:>7.0f} MiB {b['added_mib']:>10.0f} MiB {b['added_mib'] / a['added_mib']:>5.2f}x   "
            f"{a['peak_mib']:>6.0f} MiB {b['peak_mib']:>9.0f} MiB {b['peak_mib'] / a['peak_mib']:>5.2f}x   "
            f"{a['seconds']:>6.1f} {b['seconds']:>9.1f}"
        )
    print(f"train/loss full {full['loss']}, chunked {chunked['loss']}")
    print(f"train/grad_norm full {full['grad_norm']}, chunked {chunked['grad_norm']}")
    ratio = chunked["step2"]["added_mib"] / full["step2"]["added_mib"]
    verdict = "met" if ratio <= TARGET else "MISSED"
    print(f"train step added peak, chunked / full: {ratio:.2f}x (target <= {TARGET}x: {verdict})")


if __name__ == "__main__":
    main()
