"""`slimish serve`: engines and a router from one command, all gone after SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from slimish.net import free_port

SERVE = (
    "import argparse, sys; from slimish.launch import serve; p = argparse.ArgumentParser(); "
    "serve.add_arguments(p); sys.exit(serve.run(p.parse_args(sys.argv[1:])))"
)


def test_serve_starts_engines_and_router_and_stops_them_all(tiny_model_dir, tmp_path):
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE,
            "--model",
            str(tiny_model_dir),
            "--engines",
            "2",
            "--port",
            str(port),
            "--log-dir",
            str(tmp_path),
            "--engine-flag",
            "max_running_requests=4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "serve not ready within 120 s"
            try:
                if httpx.get(router + "/readiness", timeout=1).json().get("healthy_workers") == 2:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        engines = [w["url"] for w in httpx.get(router + "/workers").json()["workers"]]
        assert all(httpx.get(e + "/server_info").json()["max_running_requests"] == 4 for e in engines)
        r = httpx.post(
            router + "/generate",
            json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        )
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0  # a graceful stop: requests in flight finished, engines stopped
        out = proc.stdout.read().decode()
        assert f"router at {router}" in out
        for url in [router, *engines]:
            try:
                httpx.get(url + "/health", timeout=1)
                raise AssertionError(f"{url} still serving after SIGTERM")
            except httpx.ConnectError:
                pass
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
