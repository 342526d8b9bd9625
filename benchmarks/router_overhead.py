"""What the router adds to a request: slimish router vs sglang-router 0.3.2, same backend, one run.

A minimal loopback backend answers `/generate` at once. The same fixed number of requests is
sent directly to it, through the slimish router (one process, and `--processes N` processes on one
port) and through sglang-router, at concurrency 1 and 64, by a raw-asyncio load generator (keep-alive, one connection per concurrent client). The
direct path shows the load generator's own ceiling: when it is far above the routed numbers, the
routers are what is measured. Printed: req/s, p50/p99 latency, the latency each router adds
over the direct path, and slimish / sglang-router ratios, against the targets (added p50 <= 1 ms
at concurrency 1, throughput >= 1.0x sglang-router at 64).

    .venv/bin/python benchmarks/router_overhead.py [--requests 4000] [--processes 2]

All processes share this machine's cores: on a 2-core box the load generator, the router and
the backend compete, so the numbers are lower bounds for every router alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import psutil

from slimish.net import free_port

GENERATE_BODY = json.dumps(
    {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
).encode()
REPLY = json.dumps(
    {
        "text": "a",
        "output_ids": [5],
        "meta_info": {
            "id": "0",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 4,
            "completion_tokens": 1,
        },
    }
).encode()
JSON = {"content-type": "application/json"}
# What sglang-router asks a worker for when it registers it (docs/protocol.md 5).
INFO = json.dumps(
    {"model_path": "/nonexistent/bench-model", "dp_size": 1, "tp_size": 1, "served_model_name": "bench"}
).encode()


# ---- the backend: raw asyncio HTTP/1.1, so it costs next to nothing per request ------------------


class _Backend(asyncio.Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].decode("latin-1")
            if head.startswith("PRI *"):  # sglang-router's HTTP/2 probe: not spoken here
                self.transport.close()
                return
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            path = head.split(" ", 2)[1]
            body = REPLY if path.startswith("/generate") else INFO if "info" in path else b"{}"
            self.transport.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )


def serve_backend(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Backend, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


# ---- the load generator -----------------------------------------------------------------------


async def _client(host: str, port: int, request: bytes, todo: list[int], latencies: list[float]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while todo:
            todo.pop()
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"unexpected reply from port {port}: {head[:200]!r}")
            await _read_body(reader, head)
            latencies.append(time.perf_counter() - start)
    finally:
        writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> None:
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    at = lower.index(b"content-length:") + len(b"content-length:")
    await reader.readexactly(int(lower[at : lower.index(b"\r\n", at)]))


def load(url: str, concurrency: int, requests: int) -> tuple[float, list[float]]:
    """req/s and sorted latencies (s) of `requests` POSTs to /generate at `concurrency`."""
    host, port = url.split("//")[1].split(":")
    request = (
        b"POST /generate HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (host.encode(), len(GENERATE_BODY), GENERATE_BODY)
    )

    async def main() -> tuple[float, list[float]]:
        latencies: list[float] = []
        todo = list(range(requests))
        start = time.perf_counter()
        await asyncio.gather(*(_client(host, int(port), request, todo, latencies) for _ in range(concurrency)))
        return requests / (time.perf_counter() - start), sorted(latencies)

    return asyncio.run(main())


# ---- the run ----------------------------------------------------------------------------------


@dataclass
class Result:
    target: str
    concurrency: int
    rps: float
    p50: float
    p99: float
    cpu_us: float  # CPU time of the target's processes per request


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its children so far."""
    proc = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [proc, *proc.children(recursive=True)])


def wait_healthy(url: str, procs: list, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            code = p.poll() if isinstance(p, subprocess.Popen) else p.exitcode
            if code is not None:
                raise RuntimeError(f"a server for {url} exited with {code}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                # Routers report healthy before a worker is routable; wait for one real reply.
                if httpx.post(url + "/generate", content=GENERATE_BODY, headers=JSON, timeout=5.0).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not serving within {timeout:.0f}s")


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4000, help="per target and concurrency")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all targets; req/s is the median")
    parser.add_argument(
        "--processes", type=int, default=os.cpu_count() or 2, help="router processes of the scaled-out slimish target"
    )
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    ctx = mp.get_context("spawn")
    backend_port, slimish_port, sglang_port, scaled_port = free_port(), free_port(), free_port(), free_port()
    backend = f"http://127.0.0.1:{backend_port}"
    procs: list = [ctx.Process(target=serve_backend, args=(backend_port,), daemon=True)]
    procs[0].start()

    def slimish_router(port: int, processes: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "slimish.cli",
                "router",
                "--processes",
                str(processes),
                "--port",
                str(port),
                "--worker-urls",
                backend,
                "--policy",
                "round_robin",
            ]
        )

    procs.append(slimish_router(slimish_port, 1))
    procs.append(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sglang_router.launch_router",
                "--host",
                "127.0.0.1",
                "--port",
                str(sglang_port),
                "--worker-urls",
                backend,
                "--policy",
                "round_robin",
                "--prometheus-port",
                str(free_port()),
                "--log-level",
                "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    procs.append(slimish_router(scaled_port, args.processes))
    scaled = f"slimish-p{args.processes}"
    targets = {
        "direct": backend,
        "slimish": f"http://127.0.0.1:{slimish_port}",
        scaled: f"http://127.0.0.1:{scaled_port}",
        "sglang-router": f"http://127.0.0.1:{sglang_port}",
    }
    pids = dict(zip(["direct", "slimish", "sglang-router", scaled], (p.pid for p in procs)))  # procs' order
    results: list[Result] = []
    try:
        for url in targets.values():
            wait_healthy(url, procs)
        for concurrency in (1, 64):
            for url in targets.values():
                load(url, concurrency, args.warmup)
            rounds: dict[str, list[tuple[float, list[float], float]]] = {name: [] for name in targets}
            for _ in range(args.rounds):  # targets in turn, so drifting load from other jobs hits all alike
                for name, url in targets.items():
                    cpu = cpu_seconds(pids[name])
                    rps, lat = load(url, concurrency, args.requests)
                    rounds[name].append((rps, lat, (cpu_seconds(pids[name]) - cpu) / args.requests * 1e6))
            for name, runs in rounds.items():
                lat = sorted(x for _, run, _ in runs for x in run)
                rps, cpu_us = statistics.median(r[0] for r in runs), statistics.median(r[2] for r in runs)
                results.append(Result(name, concurrency, rps, percentile(lat, 0.5), percentile(lat, 0.99), cpu_us))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10) if isinstance(p, subprocess.Popen) else p.join(10)
    report(results, args.requests, scaled)


def report(results: list[Result], requests: int, scaled: str) -> None:
    by = {(r.target, r.concurrency): r for r in results}
    print(
        f"\n{requests} POST /generate per row and round (req/s: median of rounds); the backend answers at once (cores: {os.cpu_count()})"
    )
    print(
        f"{'target':<14} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/req':>10} {'added p50':>10} {'added p99':>10}"
    )
    for r in results:
        d = by[("direct", r.concurrency)]
        added = "" if r.target == "direct" else f"{(r.p50 - d.p50) * 1e3:10.3f} {(r.p99 - d.p99) * 1e3:10.3f}"
        print(
            f"{r.target:<14} {r.concurrency:>4} {r.rps:8.0f} {r.p50 * 1e3:8.3f} {r.p99 * 1e3:8.3f} {r.cpu_us:10.0f} {added}"
        )
    g1, d1, g64 = by[("sglang-router", 1)], by[("direct", 1)], by[("sglang-router", 64)]
    print(f"\nadded p50 at concurrency 1: sglang-router {(g1.p50 - d1.p50) * 1e3:.3f} ms")
    for name in ("slimish", scaled):
        s1, s64 = by[(name, 1)], by[(name, 64)]
        added = (s1.p50 - d1.p50) * 1e3
        print(
            f"{name}: added p50 at concurrency 1 {added:.3f} ms (target <= 1 ms: {'met' if added <= 1 else 'missed'}); "
            f"req/s / sglang-router's at 64: {s64.rps / g64.rps:.2f}x (target >= 1.0x: {'met' if s64.rps >= g64.rps else 'missed'}), "
            f"at 1: {s1.rps / g1.rps:.2f}x; requests per CPU-second / sglang-router's at 64: {g64.cpu_us / s64.cpu_us:.2f}x"
        )


if __name__ == "__main__":
    main()
