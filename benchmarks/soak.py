"""Soak: a router and two built-in engines under bounded load for a fixed time. Does anything
leak or degrade? The run's own first window is the baseline, so the verdict is in ratios.

Load (`--mode agents`, the default: 32 agents for 30 minutes): `--concurrency` agents run back to
back through the agent gateway, as a run's rollout process serves them: each opens a session
(`ctx.openai_base_url()` / `anthropic_base_url()`), has a conversation of 1-3 turns over OpenAI
Chat Completions (80%) or Anthropic Messages (20%), and hands it in (`ctx.captured_samples()`,
which frees the session). Every turn must be a 200 and every conversation must come back as
samples with tokens; at the end no session may be live. The gateway lives in this process, so
its RSS is this process's.

Load (`--mode router`: 16 workers for 120 s): `--concurrency` workers send requests back to back for
`--seconds`, a fixed mix of
`/generate` (random prompts of 8-64 ids, 4-32 new tokens, seeded sampling, logprobs), streamed
`/generate`, `/v1/chat/completions`, and deliberately bad requests (an unknown sampling param,
which must come back 400), all through the router.

Reported: errors (an exception, a timeout, or any status other than the expected 200 / 400),
the p50 and p99 latency of the requests that finished in the first and in the last window
(`--window`, default a fifth of the run) and their ratio last/first, and the RSS of each process
(router, engine0, engine1) sampled every second: at the start, at the end of the first window
(allocators and caches have warmed up by then: the baseline) and at the end, and the ratio
end/baseline (and a line every tenth of the run, to see whether it is flat). Latency moves with the neighbours' load on a shared machine, so the servers' CPU
time per reply in each window is reported too (with the load averages): a server that degrades
spends more CPU per reply; one that is only starved does not. Targets: 0 errors, p50 drift
<= 1.25x, p99 drift <= 1.5x, CPU per reply drift <= 1.25x, RSS growth <= 1.10x.

    .venv/bin/python benchmarks/soak.py [--seconds 1800 --concurrency 32]
    .venv/bin/python benchmarks/soak.py --mode router [--seconds 120 --concurrency 16]
    .venv/bin/python benchmarks/soak.py --smoke        # 20 s
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
from engine_throughput import bench_model, cpu_seconds  # noqa: E402  (same directory)

from slimish.config import load_run_config  # noqa: E402
from slimish.launch.local import engine_process  # noqa: E402
from slimish.net import free_port  # noqa: E402
from slimish.processes import ServerProcess, start_all  # noqa: E402
from slimish.rollout.api import RolloutContext, RolloutRuntime  # noqa: E402
from slimish.types import Sample  # noqa: E402

MIX = (("generate", 0.70), ("stream", 0.15), ("chat", 0.10), ("bad", 0.05))
DEFAULTS = {"agents": (1800.0, 32), "router": (120.0, 16)}  # --mode: (--seconds, --concurrency)
TARGETS = {"p50": 1.25, "p99": 1.5, "cpu": 1.25, "rss": 1.10}


@dataclass
class Tally:
    done: list[tuple[float, float]] = field(default_factory=list)  # (finished at, latency s) of good replies
    errors: list[str] = field(default_factory=list)
    bad_refused: int = 0
    sessions: int = 0  # agents: conversations handed in (their sessions freed)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def request(kind: str, rng: random.Random, vocab: int) -> tuple[str, dict, int]:
    """(path, body, expected status) of one request of the mix."""
    ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 64))]
    params = {"max_new_tokens": rng.randint(4, 32), "temperature": 1.0, "sampling_seed": rng.randrange(1 << 30)}
    if kind == "chat":
        return (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": f"count to {rng.randint(1, 99)}"}],
                "max_tokens": params["max_new_tokens"],
            },
            200,
        )
    if kind == "bad":
        return "/generate", {"input_ids": ids, "sampling_params": {**params, "no_such_param": 1}}, 400
    return (
        "/generate",
        {"input_ids": ids, "sampling_params": params, "return_logprob": True, "stream": kind == "stream"},
        200,
    )


async def worker(
    session: aiohttp.ClientSession, url: str, until: float, t0: float, seed: int, vocab: int, tally: Tally
) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX)
    while time.perf_counter() < until:
        kind = rng.choices(kinds, weights)[0]
        path, body, expected = request(kind, rng, vocab)
        started = time.perf_counter()
        try:
            async with session.post(url + path, json=body) as r:
                payload = await r.read()
                if r.status != expected:
                    tally.errors.append(f"{kind}: {r.status} {payload[:200]!r}")
                elif expected == 400:
                    tally.bad_refused += 1
                elif kind == "stream" and not payload.rstrip().endswith(b"data: [DONE]"):
                    tally.errors.append(f"stream: no [DONE] at the end: {payload[-200:]!r}")
                else:
                    now = time.perf_counter()
                    tally.done.append((now - t0, now - started))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            tally.errors.append(f"{kind}: {type(exc).__name__} {exc}")


async def agent(
    runtime: RolloutRuntime, http: aiohttp.ClientSession, until: float, t0: float, seed: int, tally: Tally
) -> None:
    """Agents one after another, each as a rollout function runs one: a gateway session, a
    conversation of 1-3 turns, the session handed in as samples."""
    rng = random.Random(seed)
    episode = 0
    while time.perf_counter() < until:
        ctx = RolloutContext(runtime, Sample(prompt="", group_id=seed, index=episode))
        episode += 1
        anthropic = rng.random() < 0.2
        try:
            url = await ctx.anthropic_base_url() + "/v1/messages" if anthropic else await ctx.openai_base_url()
            url += "" if anthropic else "/chat/completions"
            messages: list[dict] = [{"role": "user", "content": f"count to {rng.randint(1, 99)}"}]
            for _ in range(rng.randint(1, 3)):
                body = {"model": "policy", "max_tokens": rng.randint(4, 24), "messages": messages}
                started = time.perf_counter()
                async with http.post(url, json=body) as r:
                    payload = await r.read()
                if r.status != 200:
                    tally.errors.append(f"{'messages' if anthropic else 'chat'}: {r.status} {payload[:200]!r}")
                    break
                now = time.perf_counter()
                tally.done.append((now - t0, now - started))
                reply = json.loads(payload)
                content = reply["content"] if anthropic else reply["choices"][0]["message"]["content"]
                if not content:  # nothing to say back to: the conversation ends here
                    break
                messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "and then?"}]
            samples = ctx.captured_samples()  # frees the session
            if not samples or not all(s.response_length for s in samples):
                tally.errors.append(f"agent {seed}/{episode}: the session came back as {len(samples)} samples")
            tally.sessions += 1
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError) as exc:
            tally.errors.append(f"agent {seed}/{episode}: {type(exc).__name__} {exc}")
        finally:
            ctx.release()


@dataclass
class Probe:
    """One sample of every process: RSS (MiB) and CPU seconds so far, and the 1-min load average."""

    t: float
    rss: dict[str, float]
    cpu: dict[str, float]
    load: float
    live: int = 0  # agents: gateway sessions live


async def sample(
    pids: dict[str, int], every: float, until: float, t0: float, out: list[Probe], live: Callable[[], int] = int
) -> None:
    while True:
        rss = {name: rss_mib(pid) for name, pid in pids.items()}
        out.append(
            Probe(
                time.perf_counter() - t0,
                rss,
                {name: cpu_seconds(pid) for name, pid in pids.items()},
                os.getloadavg()[0],
                live(),
            )
        )
        if time.perf_counter() >= until:
            return
        await asyncio.sleep(every)


async def soak(
    url: str, pids: dict[str, int], seconds: float, concurrency: int, vocab: int
) -> tuple[Tally, list[Probe]]:
    tally, probes = Tally(), []
    t0 = time.perf_counter()
    until = t0 + seconds
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(
            sample(pids, 1.0, until, t0, probes),
            *(worker(session, url, until, t0, seed, vocab, tally) for seed in range(concurrency)),
        )
    return tally, probes


async def soak_agents(
    router_url: str, model_dir: Path, pids: dict[str, int], seconds: float, concurrency: int
) -> tuple[Tally, list[Probe], int]:
    """The agents' soak; also returns the gateway sessions still live at the end."""
    cfg = load_run_config(None, [f"model={model_dir}", "data.source=unused.jsonl"])
    runtime = await RolloutRuntime.create(cfg, router_url)
    tally, probes = Tally(), []
    t0 = time.perf_counter()
    until = t0 + seconds
    try:
        gateway = await runtime.get_gateway()
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            await asyncio.gather(
                sample({**pids, "gateway": os.getpid()}, 1.0, until, t0, probes, lambda: len(gateway.sessions)),
                *(agent(runtime, http, until, t0, seed, tally) for seed in range(concurrency)),
            )
        return tally, probes, len(gateway.sessions)
    finally:
        await runtime.close()


def rss_timeline(probes: list[Probe], seconds: float, points: int = 10) -> None:
    """RSS (and live sessions) every tenth of the run: flat, or climbing?"""
    names = list(probes[0].rss)
    print("RSS over time (MiB)  " + "  ".join(f"{n:>8}" for n in names) + "  live sessions")
    for i in range(points + 1):
        p = min(probes, key=lambda p: abs(p.t - i * seconds / points))
        print(f"  t={p.t:>7.0f} s      " + "  ".join(f"{p.rss[n]:>8.1f}" for n in names) + f"  {p.live:>13}")


def percentile(xs: list[float], q: float) -> float:
    return (
        statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))
    )


def between(probes: list[Probe], start: float, end: float) -> tuple[Probe, Probe]:
    inside = [p for p in probes if start <= p.t <= end + 0.5]
    return inside[0], inside[-1]


def report(tally: Tally, probes: list[Probe], seconds: float, window: float) -> bool:
    first = [lat * 1000 for t, lat in tally.done if t < window]
    last = [lat * 1000 for t, lat in tally.done if t >= seconds - window]
    print(
        f"requests: {len(tally.done)} good, {tally.bad_refused} bad ones refused with 400, {len(tally.errors)} errors"
    )
    for e in tally.errors[:10]:
        print(f"  error: {e}")
    drift = {}
    print(f"latency (ms)  first {window:.0f} s ({len(first)} req)  last {window:.0f} s ({len(last)} req)  last/first")
    for q in (50, 99):
        a, b = percentile(first, q), percentile(last, q)
        drift[f"p{q}"] = b / a
        print(f"  p{q:<10}  {a:>12.1f}  {b:>22.1f}  {b / a:>9.2f}x")
    # CPU seconds of the three servers per good reply: unlike latency, neighbours' load barely moves it.
    windows = [(between(probes, 0, window), len(first)), (between(probes, seconds - window, seconds), len(last))]
    cpu = [(sum(b.cpu.values()) - sum(a.cpu.values())) * 1000 / max(n, 1) for (a, b), n in windows]
    drift["cpu"] = cpu[1] / cpu[0]
    print(f"  server CPU ms/req  {cpu[0]:>6.1f}  {cpu[1]:>22.1f}  {drift['cpu']:>9.2f}x")
    print(
        "  load average (1 min) in the windows: " + ", ".join(f"{a.load:.2f} -> {b.load:.2f}" for (a, b), _ in windows)
    )
    base = next(p.rss for p in probes if p.t >= window)  # the first sample after the first window
    start, end = probes[0].rss, probes[-1].rss
    print("RSS (MiB)     start  after first window    end  max  end/after-first-window")
    growth = {}
    for name in start:
        peak = max(p.rss[name] for p in probes)
        growth[name] = end[name] / base[name]
        print(
            f"  {name:<9} {start[name]:>7.0f}  {base[name]:>18.0f}  {end[name]:>5.0f}  {peak:>4.0f}  {growth[name]:>8.3f}x"
        )
    checks = [
        ("errors", len(tally.errors), len(tally.errors) == 0, "0"),
        ("p50 drift", f"{drift['p50']:.2f}x", drift["p50"] <= TARGETS["p50"], f"<= {TARGETS['p50']}x"),
        ("p99 drift", f"{drift['p99']:.2f}x", drift["p99"] <= TARGETS["p99"], f"<= {TARGETS['p99']}x"),
        ("CPU/req drift", f"{drift['cpu']:.2f}x", drift["cpu"] <= TARGETS["cpu"], f"<= {TARGETS['cpu']}x"),
        (
            "RSS growth (worst)",
            f"{max(growth.values()):.3f}x",
            max(growth.values()) <= TARGETS["rss"],
            f"<= {TARGETS['rss']}x",
        ),
    ]
    print("verdict: " + "; ".join(f"{n} {v} (target {t}) {'PASS' if ok else 'MISS'}" for n, v, ok, t in checks))
    return all(ok for *_, ok, _ in checks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--mode", default="agents", choices=list(DEFAULTS), help="agents through the gateway, or the router"
    )
    ap.add_argument("--seconds", type=float, default=None, help="default: 1800 (agents), 120 (router)")
    ap.add_argument("--smoke", action="store_true", help="a 20 s run")
    ap.add_argument("--concurrency", type=int, default=None, help="default: 32 (agents), 16 (router)")
    ap.add_argument(
        "--window", type=float, default=None, help="seconds of the first and last windows (default: a fifth of the run)"
    )
    ap.add_argument("--model-size", default="tiny", choices=["small", "tiny"])
    ap.add_argument("--model-cache", type=Path, default=Path("runs/bench-models"))
    args = ap.parse_args()
    default_seconds, default_concurrency = DEFAULTS[args.mode]
    seconds = 20.0 if args.smoke else args.seconds or default_seconds
    args.concurrency = args.concurrency or default_concurrency
    window = args.window or seconds / 5
    model_dir = bench_model(args.model_size, "llama", args.model_cache)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    print(
        f"soak ({args.mode}): router + 2 engines ({model_dir}), {seconds:.0f} s, concurrency {args.concurrency}, "
        f"windows {window:.0f} s"
    )
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} cores)")
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    engines = [
        engine_process(model_dir, log_path=logs / f"engine{i}.log", max_running_requests=args.concurrency)
        for i in range(2)
    ]
    router: ServerProcess | None = None
    try:
        start_all(engines, timeout=300)
        port = free_port()
        router = ServerProcess(
            ["router", "--port", str(port), "--worker-urls", *[e.url for e in engines]],
            port=port,
            log_path=logs / "router.log",
        ).start(60)
        pids = {"router": router.proc.pid, **{f"engine{i}": e.proc.pid for i, e in enumerate(engines)}}
        if args.mode == "agents":
            tally, probes, live = asyncio.run(soak_agents(router.url, model_dir, pids, seconds, args.concurrency))
        else:
            tally, probes = asyncio.run(soak(router.url, pids, seconds, args.concurrency, vocab))
    finally:
        for proc in [router, *engines]:
            if proc is not None:
                proc.stop()
    rss_timeline(probes, seconds)
    ok = report(tally, probes, seconds, window)
    if args.mode == "agents":
        print(f"sessions: {tally.sessions} conversations handed in, {live} sessions live at the end (target 0)")
        ok = ok and live == 0
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; logs in {logs}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
