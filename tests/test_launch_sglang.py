"""`launch.engine_kind: sglang | external`. SGLang cannot run without a GPU, so the launcher is run
against the strict SGLang 0.5.23 double (tests/sglang_double, the `sglang_double` fixture): it
parses SGLang's command line, records it, and serves the built-in engine under SGLang's rules
(same pid)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import sys
from pathlib import Path

import httpx
import pytest
from helpers import SGLANG_DOUBLE, generate

from slimish.config import load_run_config
from slimish.launch.config import LaunchConfig
from slimish.launch.local import engine_server, local_servers
from slimish.launch.sglang import MODULE, sglang_argv, sglang_process
from slimish.trainer.backend import WeightExport
from slimish.trainer.config import WeightSyncConfig
from slimish.trainer.weight_sync import WeightSync

WAIT_S = 120.0
PROMPT = [5, 17, 42, 99, 7]
GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
ASK = {"input_ids": PROMPT, "sampling_params": GREEDY}


def starts(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


@pytest.fixture(scope="module")
def sglang_servers(sglang_double, tiny_model_dir, tmp_path_factory):
    """One SGLang engine as a colocated run launches it (`--enable-memory-saver` added), which the
    other pushes (a broadcast, disk) take as any SGLang engine."""
    launch = LaunchConfig(
        engine_kind="sglang",
        sglang_args=["--sglang-tp-size", "1", "--mem-fraction-static=0.5"],
        start_timeout=WAIT_S,
        colocate=True,
    )
    with local_servers(launch, tiny_model_dir, tmp_path_factory.mktemp("logs")) as servers:
        yield servers


def test_sglang_arguments_pass_through_with_or_without_the_prefix():
    argv = sglang_argv(
        "/m",
        "10.0.0.2",
        30001,
        ["--sglang-tp-size", "2", "--sglang-mem-fraction-static=0.7", "--trust-remote-code"],
        api_key="k",
    )
    assert argv == [
        "--model-path",
        "/m",
        "--host",
        "10.0.0.2",
        "--port",
        "30001",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "2",
        "--mem-fraction-static=0.7",
        "--trust-remote-code",
        "--api-key",
        "k",
    ]
    assert sglang_argv("/m", "h", 1, ["--api-key", "own"], api_key="k")[-2:] == ["--api-key", "own"]  # theirs wins
    proc = sglang_process("/m", [], host="0.0.0.0", port=30002)
    assert (proc.module, proc.name, proc.url) == (MODULE, MODULE, "http://127.0.0.1:30002")


@pytest.mark.parametrize("flag", ["--port", "--sglang-host=0.0.0.0", "--model-path"])
def test_flags_the_launcher_sets_are_refused(flag):
    with pytest.raises(ValueError, match=r"launch.sglang_args: --(port|host|model-path) is set by the launcher"):
        sglang_argv("/m", "h", 1, [flag, "x"])


def test_engine_flags_the_launcher_sets_are_refused():
    with pytest.raises(ValueError, match=r"launch.engine_flag: host, port set by the launcher"):
        engine_server(LaunchConfig(engine_flag=["port=1", "host=0.0.0.0", "max_running_requests=4"]), "/m", None)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["launch.engine_kind=vllm"], "launch.engine_kind must be one of builtin, sglang, external, got 'vllm'"),
        (["launch.engine_kind=external"], "launch.engine_urls: engine_kind=external needs"),
        (["launch.engine_urls=[http://h:1]"], "launch.engine_urls needs launch.engine_kind=external"),
        (["launch.mode=slurm"], "launch.mode must be one of local, ray, got 'slurm'"),
        (
            ["launch.mode=ray", "launch.engine_kind=external", "launch.engine_urls=[http://h:1]"],
            "launch.mode=ray places engines",
        ),
        (["launch.placement_strategy=ANY"], "launch.placement_strategy must be PACK"),
        (["launch.engine_gpus=-1"], "engine_cpus/engine_gpus >= 0"),
    ],
)
def test_bad_launch_settings_name_the_field(overrides, message):
    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_run_config(None, ["model=/m", "data.source=task:max_digit", *overrides])


def test_sglang_engine_started_registered_and_synced(
    sglang_servers, sglang_double, tiny_model_dir, tiny_model_dir_other_seed
):
    (start,) = starts(sglang_double)
    engine = sglang_servers.engines[0]
    port = str(engine.port)
    assert start["argv"] == [
        "--model-path",
        str(tiny_model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        port,
        "--base-gpu-id",
        "0",
        "--dtype",
        "bfloat16",
        "--tp-size",
        "1",
        "--mem-fraction-static=0.5",
        "--enable-memory-saver",
    ]
    assert start["pid"] == engine.proc.pid  # the supervised child is the server itself
    workers = httpx.get(sglang_servers.router_url + "/workers", timeout=30).json()["workers"]
    assert [w["url"] for w in workers] == sglang_servers.engine_urls == [engine.url]
    assert generate(sglang_servers.router_url, **ASK)["output_ids"] == generate(engine.url, **ASK)["output_ids"]

    from transformers import AutoModelForCausalLM

    pushed = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir_other_seed).named_parameters())
    with WeightSync(WeightSyncConfig(timeout_s=60.0), sglang_servers.engine_urls) as sync:
        sync.push(WeightExport(pushed), 3)
        assert sync.engines.sessions is True  # probed: begin/end_weight_update bracket the push
    assert httpx.get(engine.url + "/model_info", timeout=30).json()["weight_version"] == "3"


def test_a_colocated_push_releases_resumes_and_hands_over_ipc_handles(sglang_servers, sglang_double, tiny_model_dir):
    """The GPU form of launch.colocate against the double, with CPU tensors in place of CUDA ones:
    SGLang's calls in slime's order, the tensors as one base64 pickle per TP rank in a session,
    checked as SGLang's SafeUnpickler would take them (sglang_double/sglang/tensors.py) and never
    unpickled; what SGLang refuses is refused."""
    from transformers import AutoModelForCausalLM

    from slimish.trainer.colocated_sglang import SGLangColocatedSync, ipc_payload

    url = sglang_servers.engine_urls[0]
    calls = sglang_double.parent / "calls.jsonl"
    seen = len(calls.read_text().splitlines()) if calls.exists() else 0
    named = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    sync = SGLangColocatedSync(WeightSync(WeightSyncConfig(timeout_s=60.0, bucket_mb=0.5), [url]))
    try:
        sync.connect()
        sync.release()
        pushed = sync.push(WeightExport(named), 5)
    finally:
        sync.close()
    assert pushed["buckets"] >= 2 and pushed["bytes"] == sum(p.numel() * 4 for _, p in named)
    sequence = [json.loads(line) for line in calls.read_text().splitlines()[seen:]]
    assert sequence == [
        {"path": "/flush_cache"},
        {"path": "/release_memory_occupation", "tags": None},
        {"path": "/resume_memory_occupation", "tags": ["weights"]},
        {"path": "/begin_weight_update"},
        *[{"path": "/update_weights_from_tensor", "entries": 1}] * int(pushed["buckets"]),
        {"path": "/end_weight_update"},
        {"path": "/resume_memory_occupation", "tags": ["kv_cache", "cuda_graph"]},
        {"path": "/update_weight_version"},
    ]
    assert httpx.get(url + "/model_info", timeout=30).json()["weight_version"] == "5"
    assert generate(url, **ASK)["meta_info"]["weight_version"] == "5"  # the KV cache is back

    entries = ipc_payload(named[:1], 1)
    bad_pickle = base64.b64encode(pickle.dumps(os.system)).decode()

    def update(**body):
        return httpx.post(url + "/update_weights_from_tensor", json=body, timeout=30)

    assert update(serialized_named_tensors=entries).status_code == 400  # outside a session
    assert httpx.post(url + "/begin_weight_update", json={}, timeout=30).status_code == 200
    try:
        for body, why in [
            ({"serialized_named_tensors": entries * 2}, "one entry per TP rank"),
            ({"serialized_named_tensors": ["not base64!"]}, "not base64"),
            ({"serialized_named_tensors": [bad_pickle]}, "Blocked unsafe global"),
        ]:
            refused = update(**body)
            assert refused.status_code == 400 and why in refused.json()["message"], refused.text
        httpx.post(url + "/release_memory_occupation", json={"tags": ["weights"]}, timeout=30).raise_for_status()
        refused = update(serialized_named_tensors=entries)
        assert refused.status_code == 400 and "released" in refused.json()["message"]
        httpx.post(url + "/resume_memory_occupation", json={"tags": ["weights"]}, timeout=30).raise_for_status()
        assert update(serialized_named_tensors=entries).json()["success"] is True
    finally:
        httpx.post(url + "/end_weight_update", json={}, timeout=30)


def test_a_dead_sglang_server_is_started_again_with_the_same_command_line(sglang_servers, sglang_double):
    engine = sglang_servers.engines[0]
    engine.kill()
    assert sglang_servers.restart_dead(WAIT_S) == [engine.url]
    first, again = starts(sglang_double)[-2:]
    assert again["argv"] == first["argv"] and again["pid"] == engine.proc.pid  # no --await-weights: SGLang has none
    assert httpx.get(engine.url + "/health", timeout=30).status_code == 200


def test_a_server_that_exits_while_starting_fails_with_its_log(sglang_double, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_SHIM_EXIT", "3")
    proc = sglang_process(tiny_model_dir, [], log_path=tmp_path / "sglang.log")
    with pytest.raises(RuntimeError, match=r"(?s)sglang.launch_server on port \d+ exited with 3.*refusing to start"):
        proc.start(WAIT_S)


def test_external_engines_get_a_router_and_are_left_running(sglang_servers, tmp_path):
    url = sglang_servers.engine_urls[0]
    launch = LaunchConfig(engine_kind="external", engine_urls=[url + "/"], start_timeout=WAIT_S)
    with local_servers(launch, "unused", tmp_path) as servers:
        assert servers.engine_urls == [url] and servers.restart_dead(WAIT_S) == []
        served = generate(servers.router_url, **ASK)["meta_info"]
        assert served["weight_version"] == httpx.get(url + "/model_info", timeout=30).json()["weight_version"]
        assert served["completion_tokens"] > 0
    assert httpx.get(url + "/health", timeout=30).status_code == 200  # not ours to stop


def test_the_double_is_what_runs(sglang_double):
    """Guard: with the double on PYTHONPATH a child resolves `sglang` to it, not a real install."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", "import sglang; print(sglang.__file__)"], capture_output=True, text=True, timeout=60
    )
    assert out.stdout.strip() == str(SGLANG_DOUBLE / "sglang" / "__init__.py")
