"""Multi-turn tool agents through the built-in engine with and without its prefix cache, and
through HF `generate` re-prefilling the history every turn, in one run.

The workload is one GRPO group of `--group` agents on the same task prompt (`--prompt-len`
random token ids). Each agent runs `--turns` turns: it sends its whole history, the model replies
with exactly `--reply-tokens` tokens (temperature 1, a seed per agent and turn), and a tool
result of `--tool-tokens` ids is appended. The agents of a group run concurrently.
  cache     - a `slimish engine` process (prefix cache on, the default)
  no cache  - the same with `--disable-radix-cache true`
  hf        - HF `model.generate` on the group's histories as one static batch per turn
Rounds alternate between the three so that drifting load from other jobs hits them alike.
Printed: median wall seconds and engine CPU-seconds per path, cache / no cache (target <= 0.5),
cache / hf, prompt tokens sent and served from the cache, and whether the two engines produced
the same tokens.

    .venv/bin/python benchmarks/agent_prefill.py                    # small (~30M), the real run
    .venv/bin/python benchmarks/agent_prefill.py --model-size tiny --turns 3   # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads are slower here (notes/cpu-runtime.md)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from engine_throughput import bench_model, cpu_seconds, model_arguments, random_prompts  # noqa: E402  (same directory)
from slimish.client import Client  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.launch.process import start_all  # noqa: E402

TARGET = 0.5  # engine time with the cache / without, at most


@dataclass
class Workload:
    task: list[int]
    tools: list[list[list[int]]]  # [agent][turn] tool-result ids
    turns: int
    reply_tokens: int
    seed: int

    def params(self, agent: int, turn: int) -> dict:
        return {"temperature": 1.0, "max_new_tokens": self.reply_tokens, "ignore_eos": True,
                "sampling_seed": self.seed + 1000 * agent + turn}  # fmt: skip


@dataclass
class Round:
    wall: float
    cpu: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # every reply, in (agent, turn) order


async def _agent(client: Client, w: Workload, agent: int, r: Round) -> list[int]:
    history, replies = list(w.task), []
    for turn in range(w.turns):
        out = await client.generate(input_ids=history, sampling_params=w.params(agent, turn))
        if len(out.output_ids) != w.reply_tokens:
            raise RuntimeError(f"agent {agent} turn {turn}: {len(out.output_ids)} tokens, expected {w.reply_tokens}")
        r.prompt_tokens += len(history)
        r.cached_tokens += out.meta_info.cached_tokens
        replies += out.output_ids
        history = history + out.output_ids + w.tools[agent][turn]
    return replies


def time_engine(url: str, pid: int, w: Workload) -> Round:
    async def main() -> list[list[int]]:
        async with Client(url) as client:
            return await asyncio.gather(*(_agent(client, w, a, r) for a in range(len(w.tools))))

    wall, cpu = time.perf_counter(), cpu_seconds(pid)
    r = Round(0.0, 0.0)
    r.outputs = asyncio.run(main())
    r.wall, r.cpu = time.perf_counter() - wall, cpu_seconds(pid) - cpu
    return r


@torch.inference_mode()
def time_hf(model: PreTrainedModel, w: Workload) -> Round:
    """Every turn re-prefills every history (equal lengths: one static batch, no padding)."""
    histories = [list(w.task) for _ in w.tools]
    wall, cpu = time.perf_counter(), time.process_time()
    r = Round(0.0, 0.0)
    for turn in range(w.turns):
        ids = torch.tensor(histories)
        torch.manual_seed(w.seed + turn)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=w.reply_tokens, min_new_tokens=w.reply_tokens, pad_token_id=model.config.pad_token_id,
        )  # fmt: skip
        r.prompt_tokens += ids.numel()
        histories = [h + o[len(h) :] + w.tools[a][turn] for a, (h, o) in enumerate(zip(histories, out.tolist()))]
    r.wall, r.cpu = time.perf_counter() - wall, time.process_time() - cpu
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=8, help="agents on the same task prompt, run concurrently")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256, help="task prompt (system, tools, question) tokens")
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--tool-tokens", type=int, default=32)
    model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds per path (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()

    model_dir = bench_model(args.model_size, args.arch, args.model_cache)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tools = random_prompts(args.group * args.turns, args.tool_tokens, vocab, args.seed + 1)
    w = Workload(
        task=random_prompts(1, args.prompt_len, vocab, args.seed)[0],
        tools=[tools[a * args.turns : (a + 1) * args.turns] for a in range(args.group)],
        turns=args.turns, reply_tokens=args.reply_tokens, seed=args.seed,
    )  # fmt: skip
    final = args.prompt_len + args.turns * (args.reply_tokens + args.tool_tokens)
    print(f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, fp32); "
          f"group {args.group} x {args.turns} turns, task prompt {args.prompt_len}, reply {args.reply_tokens}, "
          f"tool {args.tool_tokens}: history ends at {final} tokens; threads {torch.get_num_threads()}")  # fmt: skip
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)} ({os.cpu_count()} cores)")

    engines = [engine_process(model_dir, max_running_requests=args.group),
               engine_process(model_dir, max_running_requests=args.group, disable_radix_cache="true")]  # fmt: skip
    rounds: dict[str, list[Round]] = {"cache": [], "no cache": [], "hf": []}
    try:
        start_all(engines, timeout=300)
        warm = Workload(w.task[:16], [[t[:4] for t in a[:1]] for a in w.tools], 1, 4, args.seed)
        for e in engines:
            time_engine(e.url, e.proc.pid, warm)
            flush(e.url)
        time_hf(model, warm)
        for _ in range(args.repeats):
            for name, e in (("cache", engines[0]), ("no cache", engines[1])):
                rounds[name].append(time_engine(e.url, e.proc.pid, w))
                flush(e.url)  # every round starts cold
                print(f"  {name}: {rounds[name][-1].wall:.1f} s", flush=True)
            rounds["hf"].append(time_hf(model, w))
            print(f"  hf: {rounds['hf'][-1].wall:.1f} s", flush=True)
    finally:
        for e in engines:
            e.stop()
    report(rounds)
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def flush(url: str) -> None:
    r = httpx.post(url + "/flush_cache", timeout=60)
    if r.status_code != 200:
        raise RuntimeError(f"{url}/flush_cache: {r.status_code} {r.text}")


def report(rounds: dict[str, list[Round]]) -> None:
    wall = {k: statistics.median(r.wall for r in v) for k, v in rounds.items()}
    cpu = {k: statistics.median(r.cpu for r in v) for k, v in rounds.items()}
    print()
    print(f"{'path':>9}  {'wall s':>7}  {'CPU s':>7}  {'prompt tok':>10}  {'cached tok':>10}")
    for k, v in rounds.items():
        print(f"{k:>9}  {wall[k]:7.1f}  {cpu[k]:7.1f}  {v[0].prompt_tokens:10d}  {v[0].cached_tokens:10d}")
    same = sum(a == b for a, b in zip(rounds["cache"][0].outputs, rounds["no cache"][0].outputs))
    print()
    print(f"cache / no cache: {wall['cache'] / wall['no cache']:.2f}x wall, {cpu['cache'] / cpu['no cache']:.2f}x engine CPU "
          f"(target <= {TARGET}x): {'met' if wall['cache'] / wall['no cache'] <= TARGET else 'MISSED'} by wall")  # fmt: skip
    print(f"cache / hf:       {wall['cache'] / wall['hf']:.2f}x wall; no cache / hf: {wall['no cache'] / wall['hf']:.2f}x wall")
    print(f"agents with the same tokens with and without the cache: {same} of {len(rounds['cache'][0].outputs)}")


if __name__ == "__main__":
    main()
