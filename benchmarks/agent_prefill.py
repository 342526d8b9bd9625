"""Multi-turn tool agents through the built-in engine with and without its prefix cache, and
through HF `generate` re-prefilling the history every turn, in one run; or, with
`--router-policies`, through the router in front of `--engines` prefix-cached engines.

The workload is `--groups` GRPO groups (default 1) of `--group` agents, each group on its own
task prompt (`--prompt-len` random token ids). Each agent runs `--turns` turns: it sends its whole
history, the model replies with exactly `--reply-tokens` tokens (temperature 1, a seed per agent
and turn), and a tool result of `--tool-tokens` ids is appended. All agents run concurrently.
  cache     - a `slimish engine` process (prefix cache on, the default)
  no cache  - the same with `--disable-radix-cache`
  hf        - HF `model.generate` on the group's histories as one static batch per turn
Rounds alternate between the three so that drifting load from other jobs hits them alike.
Printed: median wall seconds and engine CPU-seconds per path, cache / no cache (target <= 0.5),
cache / hf, prompt tokens sent and served from the cache, and whether the two engines produced
the same tokens.

With `--router-policies P1,P2,...` the same workload goes instead through a fresh `slimish router`
of each policy (rounds alternate between them; every agent sends its own `X-SMG-Routing-Key`,
which `session` pins by) in front of `--engines` engines with the prefix cache, flushed between
rounds. Printed per policy: median wall seconds, engine CPU-seconds (all engines summed) and
router CPU-seconds, prompt tokens sent, the share served from the cache, how many distinct
engines each agent's turns landed on, and each policy's engine CPU and wall against round_robin.

    .venv/bin/python benchmarks/agent_prefill.py                    # small (~30M), the real run
    .venv/bin/python benchmarks/agent_prefill.py --model-size tiny --turns 3   # smoke run
    .venv/bin/python benchmarks/agent_prefill.py --groups 4 --repeats 2 \
        --router-policies round_robin,least_inflight,cache_aware,session --engines 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 2 threads are slower here (docs/benchmarks.md, CPU facts)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402
from engine_throughput import bench_model, cpu_seconds, model_arguments, random_prompts  # noqa: E402  (same directory)
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: E402

from slimish.client import Client, ServerError  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.net import free_port  # noqa: E402
from slimish.processes import ServerProcess, start_all  # noqa: E402
from slimish.protocol import ROUTING_KEY_HEADER, GenerateResponse  # noqa: E402
from slimish.router.proxy import WORKER_HEADER  # noqa: E402

TARGET = 0.5  # engine time with the cache / without, at most


@dataclass
class Workload:
    tasks: list[list[int]]  # one task prompt per group
    tools: list[list[list[int]]]  # [agent][turn] tool-result ids; agents are numbered group by group
    turns: int
    reply_tokens: int
    seed: int

    def task(self, agent: int) -> list[int]:
        return self.tasks[agent * len(self.tasks) // len(self.tools)]

    def params(self, agent: int, turn: int) -> dict:
        return {
            "temperature": 1.0,
            "max_new_tokens": self.reply_tokens,
            "ignore_eos": True,
            "sampling_seed": self.seed + 1000 * agent + turn,
        }


@dataclass
class Round:
    wall: float
    cpu: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # every reply, in (agent, turn) order
    served: list[list[str]] = field(default_factory=list)  # [agent][turn] the engine that served it (router runs)
    router_cpu: float = 0.0


async def _generate(client: Client, routing_key: str, **body: object) -> tuple[GenerateResponse, str | None]:
    """`client.generate`, and which engine served it: the router's reply header (None from an engine)."""
    url = client.base_url + "/generate"
    async with client.session.post(
        url, json={**body, "stream": False}, headers={ROUTING_KEY_HEADER: routing_key}
    ) as reply:
        raw = await reply.read()
    if reply.status >= 400:
        raise ServerError(url, reply.status, raw.decode(errors="replace"))
    return GenerateResponse.model_validate_json(raw), reply.headers.get(WORKER_HEADER)


async def _agent(client: Client, w: Workload, agent: int, r: Round) -> list[int]:
    history, replies = list(w.task(agent)), []
    for turn in range(w.turns):
        out, engine = await _generate(
            client, f"agent-{agent}", input_ids=history, sampling_params=w.params(agent, turn)
        )
        if len(out.output_ids) != w.reply_tokens:
            raise RuntimeError(f"agent {agent} turn {turn}: {len(out.output_ids)} tokens, expected {w.reply_tokens}")
        r.prompt_tokens += len(history)
        r.cached_tokens += out.meta_info.cached_tokens
        r.served[agent].append(engine)
        replies += out.output_ids
        history = history + out.output_ids + w.tools[agent][turn]
    return replies


def time_engine(url: str, pids: list[int], w: Workload, router_pid: int | None = None) -> Round:
    """The workload through `url` (an engine, or a router), with the CPU time of the engines `pids`."""

    async def main() -> list[list[int]]:
        async with Client(url) as client:
            return await asyncio.gather(*(_agent(client, w, a, r) for a in range(len(w.tools))))

    def cpu() -> tuple[float, float]:
        return sum(map(cpu_seconds, pids)), cpu_seconds(router_pid) if router_pid else 0.0

    wall, (engine_cpu, router_cpu) = time.perf_counter(), cpu()
    r = Round(0.0, 0.0, served=[[] for _ in w.tools])
    r.outputs = asyncio.run(main())
    r.wall, (engine_end, router_end) = time.perf_counter() - wall, cpu()
    r.cpu, r.router_cpu = engine_end - engine_cpu, router_end - router_cpu
    return r


def time_routed(policies: list[str], engines: list[ServerProcess], w: Workload, repeats: int) -> dict[str, list[Round]]:
    """Each round a fresh router of each policy in turn, in front of `engines` (flushed after)."""
    rounds: dict[str, list[Round]] = {p: [] for p in policies}
    for _ in range(repeats):
        for policy in policies:
            port = free_port()
            argv = ["router", "--port", str(port), "--policy", policy, "--worker-urls", *(e.url for e in engines)]
            with ServerProcess(argv, port=port).start(120) as router:
                rounds[policy].append(time_engine(router.url, [e.proc.pid for e in engines], w, router.proc.pid))
            for e in engines:
                flush(e.url)  # every round starts cold
            print(f"  {policy}: {rounds[policy][-1].wall:.1f} s", flush=True)
    return rounds


@torch.inference_mode()
def time_hf(model: PreTrainedModel, w: Workload) -> Round:
    """Every turn re-prefills every history (equal lengths: one static batch, no padding)."""
    histories = [list(w.task(a)) for a in range(len(w.tools))]
    wall, cpu = time.perf_counter(), time.process_time()
    r = Round(0.0, 0.0)
    for turn in range(w.turns):
        ids = torch.tensor(histories)
        torch.manual_seed(w.seed + turn)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=w.reply_tokens,
            min_new_tokens=w.reply_tokens,
            pad_token_id=model.config.pad_token_id,
        )
        r.prompt_tokens += ids.numel()
        histories = [h + o[len(h) :] + w.tools[a][turn] for a, (h, o) in enumerate(zip(histories, out.tolist()))]
    r.wall, r.cpu = time.perf_counter() - wall, time.process_time() - cpu
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", type=int, default=8, help="agents on the same task prompt, run concurrently")
    ap.add_argument("--groups", type=int, default=1, help="groups, each on its own task prompt, all concurrent")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256, help="task prompt (system, tools, question) tokens")
    ap.add_argument("--reply-tokens", type=int, default=24)
    ap.add_argument("--tool-tokens", type=int, default=32)
    model_arguments(ap)
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds per path (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--router-policies",
        help="comma-separated router policies to compare instead of the three paths "
        "(round_robin,least_inflight,cache_aware,session)",
    )
    ap.add_argument(
        "--engines", type=int, default=2, help="prefix-cached engines behind the router (with --router-policies)"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()

    model_dir = bench_model(args.model_size, args.arch, args.model_cache)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    agents = args.groups * args.group
    tools = random_prompts(agents * args.turns, args.tool_tokens, vocab, args.seed + 1)
    w = Workload(
        tasks=random_prompts(args.groups, args.prompt_len, vocab, args.seed),
        tools=[tools[a * args.turns : (a + 1) * args.turns] for a in range(agents)],
        turns=args.turns,
        reply_tokens=args.reply_tokens,
        seed=args.seed,
    )
    final = args.prompt_len + args.turns * (args.reply_tokens + args.tool_tokens)
    print(
        f"model {model_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, fp32); "
        f"{args.groups} x group {args.group} x {args.turns} turns, task prompt {args.prompt_len}, reply {args.reply_tokens}, "
        f"tool {args.tool_tokens}: history ends at {final} tokens; threads {torch.get_num_threads()}"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in load_start)} ({os.cpu_count()} cores)")

    policies = args.router_policies.split(",") if args.router_policies else []
    if policies:
        engines = [engine_process(model_dir, max_running_requests=agents) for _ in range(args.engines)]
    else:
        engines = [
            engine_process(model_dir, max_running_requests=agents),
            engine_process(model_dir, max_running_requests=agents, disable_radix_cache=True),
        ]
    rounds: dict[str, list[Round]] = {"cache": [], "no cache": [], "hf": []}
    try:
        start_all(engines, timeout=300)
        warm = Workload([w.tasks[0][:16]], [[t[:4] for t in a[:1]] for a in w.tools], 1, 4, args.seed)
        for e in engines:
            time_engine(e.url, [e.proc.pid], warm)
            flush(e.url)
        if policies:
            rounds = time_routed(policies, engines, w, args.repeats)
        else:
            time_hf(model, warm)
            for _ in range(args.repeats):
                for name, e in (("cache", engines[0]), ("no cache", engines[1])):
                    rounds[name].append(time_engine(e.url, [e.proc.pid], w))
                    flush(e.url)  # every round starts cold
                    print(f"  {name}: {rounds[name][-1].wall:.1f} s", flush=True)
                rounds["hf"].append(time_hf(model, w))
                print(f"  hf: {rounds['hf'][-1].wall:.1f} s", flush=True)
    finally:
        for e in engines:
            e.stop()
    (report_routed if policies else report)(rounds)
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
    print(
        f"cache / no cache: {wall['cache'] / wall['no cache']:.2f}x wall, {cpu['cache'] / cpu['no cache']:.2f}x engine CPU "
        f"(target <= {TARGET}x): {'met' if wall['cache'] / wall['no cache'] <= TARGET else 'MISSED'} by wall"
    )
    print(
        f"cache / hf:       {wall['cache'] / wall['hf']:.2f}x wall; no cache / hf: {wall['no cache'] / wall['hf']:.2f}x wall"
    )
    print(f"agents with the same tokens with and without the cache: {same} of {len(rounds['cache'][0].outputs)}")


def report_routed(rounds: dict[str, list[Round]]) -> None:
    """Medians over rounds; engines/agent: the mean over agents and rounds, and the share of agents
    whose turns all landed on one engine; busiest: the share of all requests the busiest engine served."""
    med = {
        k: {f: statistics.median(getattr(r, f) for r in v) for f in ("wall", "cpu", "router_cpu")}
        for k, v in rounds.items()
    }
    base = "round_robin" if "round_robin" in rounds else next(iter(rounds))
    print()
    print(
        f"{'policy':>14}  {'wall s':>7}  {'engine CPU s':>12}  {'router CPU s':>12}  {'prompt tok':>10}  {'cached':>6}  {'engines/agent':>13}  {'busiest':>7}"
    )
    for k, v in rounds.items():
        cached = statistics.median(r.cached_tokens / r.prompt_tokens for r in v)
        spread = [len(set(e)) for r in v for e in r.served]
        one = sum(n == 1 for n in spread) / len(spread)
        busiest = statistics.median(max(Counter(sum(r.served, [])).values()) / sum(map(len, r.served)) for r in v)
        print(
            f"{k:>14}  {med[k]['wall']:7.1f}  {med[k]['cpu']:12.1f}  {med[k]['router_cpu']:12.1f}  {v[0].prompt_tokens:10d}  "
            f"{cached:6.0%}  {statistics.mean(spread):5.2f} ({one:4.0%} on 1)  {busiest:7.0%}"
        )
    print()
    for k, v in rounds.items():
        same = sum(a == b for a, b in zip(v[0].outputs, rounds[base][0].outputs))
        print(
            f"{k:>14} / {base}: {med[k]['cpu'] / med[base]['cpu']:.2f}x engine CPU, {med[k]['wall'] / med[base]['wall']:.2f}x wall; "
            f"agents with the same tokens: {same} of {len(v[0].outputs)}"
        )


if __name__ == "__main__":
    main()
