"""Where engines and trainer ranks go on GPUs, the engines' command lines (SGLang's flags, for the
built-in engine too), and the recipes' dry runs (slimish/launch/plan.py, `slimish train --dry-run`).
No GPU here: placement is checked on the command lines the launcher builds and spawns."""

from __future__ import annotations

import argparse
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import ray.util
import torch
import transformers
from helpers import ROOT

from megatron_bridge.config import from_hf
from slimish.cli import main
from slimish.config import load_run_config
from slimish.engine.config import EngineConfig
from slimish.flags import add_config_arguments
from slimish.launch.commands import rollout_batch_launch
from slimish.launch.config import LaunchConfig, TeacherConfig
from slimish.launch.local import engine_process, engine_server, local_engines, router_process
from slimish.launch.plan import model_params, next_gpu, teacher_launch
from slimish.launch.sglang import sglang_argv
from slimish.net import free_port, listening_socket
from slimish.processes import ServerProcess
from slimish.rollout.config import RolloutConfig

RECIPES = ROOT / "configs"


def base_gpu_ids(argvs: list[list[str]]) -> list[int]:
    return [int(argv[argv.index("--base-gpu-id") + 1]) for argv in argvs]


# ---- placement (issue 42, finding 4) --------------------------------------------------------------


def test_local_sglang_engines_start_after_the_trainer_gpus_each_on_their_own(sglang_double, tmp_path, monkeypatch):
    """Three engines of tp 2 after 2 trainer GPUs: --base-gpu-id 2, 4, 6, in the command lines the
    launcher really spawns (the SGLang double records them, then exits: no engine has to serve)."""
    monkeypatch.setenv("SGLANG_SHIM_EXIT", "3")
    engines = local_engines(
        LaunchConfig(engine_kind="sglang", engines=3, sglang_args=["--tp-size", "2"]), "/m", tmp_path, first_gpu=2
    )
    for engine in engines:
        engine.launch()
    assert [engine.proc.wait(timeout=60) for engine in engines] == [
        3,
        3,
        3,
    ]  # each parsed its command line as SGLang would
    argvs = [json.loads(line)["argv"] for line in sglang_double.read_text().splitlines()]
    assert sorted(base_gpu_ids(argvs)) == [2, 4, 6]


def test_a_given_base_gpu_id_places_the_first_engine():
    """`--base-gpu-id` in launch.sglang_args is where engine 0 goes (sharing the trainer's GPU if
    told); the others follow, and no engine gets the flag twice."""
    launch = LaunchConfig(
        engine_kind="sglang", engines=2, sglang_args=["--sglang-base-gpu-id", "0", "--mem-fraction-static", "0.3"]
    )
    argvs = [e.argv for e in local_engines(launch, "/m", ROOT, first_gpu=1)]
    assert base_gpu_ids(argvs) == [0, 1] and all(argv.count("--base-gpu-id") == 1 for argv in argvs)


def test_builtin_gpu_engines_get_one_gpu_each_and_cpu_engines_none():
    def devices(*flags: str) -> list[str | None]:
        argvs = [
            e.argv for e in local_engines(LaunchConfig(engines=2, engine_flag=list(flags)), "/m", ROOT, first_gpu=1)
        ]
        return [argv[argv.index("--device") + 1] if "--device" in argv else None for argv in argvs]

    assert devices("device=cuda") == ["cuda:1", "cuda:2"]
    assert devices("device=cuda:0") == ["cuda:0", "cuda:0"]  # named: kept
    assert devices() == [None, None]


def test_cpu_engines_run_the_rollouts_samples_in_flight_in_one_batch():
    """64 samples in flight on engines of 32 rows would decode in two waves: each engine's batch
    is widened to its share, unless the user set it or the engines are on GPUs."""
    wide = RolloutConfig(max_concurrency=64)

    def rows(launch: LaunchConfig, rollout: RolloutConfig = wide) -> list[str]:
        return [f for f in rollout_batch_launch(launch, rollout).engine_flag if f.startswith("max_running_requests")]

    assert rows(LaunchConfig()) == ["max_running_requests=64"]
    assert rows(LaunchConfig(engines=3)) == []  # 22 each: the default's 32 hold them
    assert rows(LaunchConfig(engines=2), RolloutConfig(max_concurrency=100)) == ["max_running_requests=50"]
    assert rows(LaunchConfig(engine_flag=["max_running_requests=8"])) == ["max_running_requests=8"]  # theirs stands
    assert rows(LaunchConfig(engine_flag=["device=cuda"])) == []  # planned against the card's memory
    assert rollout_batch_launch(LaunchConfig(engine_kind="sglang"), wide) == LaunchConfig(engine_kind="sglang")
    assert EngineConfig.max_running_requests == 32  # what the cases above assume


def test_teacher_engines_go_after_the_policy_engines(tmp_path):
    cfg = load_run_config(
        str(RECIPES / "qwen3_4b_grpo.yaml"),
        [
            "algorithm.opd.coef=1",
            "launch.teacher.model=/models/Qwen3-4B",
            "launch.teacher.engine_kind=sglang",
            "launch.engines=3",
        ],
    )
    first = next_gpu(cfg.launch, 4)
    assert first == 7 and base_gpu_ids([e.argv for e in local_engines(teacher_launch(cfg), "/t", tmp_path, first)]) == [
        7
    ]


# ---- SGLang command lines (findings 9e, 10) ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "dtype"),
    [([], "--dtype bfloat16"), (["--dtype", "float16"], "--dtype float16"), (["--sglang-dtype=half"], "--dtype=half")],
)
def test_sglang_engines_run_bf16_unless_told(args, dtype):
    """SGLang's `auto` serves an fp32 checkpoint in fp16; the launcher asks for bf16 unless the
    user named a dtype (then theirs, once)."""
    argv = sglang_argv("/m", "h", 1, args)
    assert [a if "=" in a else f"{a} {argv[i + 1]}" for i, a in enumerate(argv) if a.startswith("--dtype")] == [dtype]


def test_config_booleans_are_bare_flags_as_sglangs():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    args = parser.parse_args(
        ["--model-path", "m", "--enable-lora", "--max-lora-rank", "8", "--no-await-weights", "--tp-size", "1"]
    )
    assert (args.model, args.enable_lora, args.await_weights, args.disable_radix_cache, args.tp_size) == (
        "m",
        True,
        False,
        False,
        1,
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--enable-lora", "true"])  # the old form: a value is no longer taken


def test_engine_flags_from_yaml_become_bare_flags():
    """`launch.engine_flag: [enable_lora=true]` (YAML configs) keeps working: a boolean's text
    becomes the bare flag; anything but true/false is refused by name."""
    launch = LaunchConfig(engine_flag=["enable_lora=true", "max_lora_rank=8", "disable_radix_cache=false"])
    argv = engine_server(launch, "/m", None).argv
    assert "--enable-lora" in argv and "--no-disable-radix-cache" in argv and "true" not in argv and "false" not in argv
    with pytest.raises(ValueError, match="engine flag enable_lora: true or false, got 'yes'"):
        engine_server(LaunchConfig(engine_flag=["enable_lora=yes"]), "/m", None)


def test_the_builtin_engine_starts_from_an_sglang_launch_line(tiny_model_dir, tmp_path):
    sock = listening_socket()
    port = sock.getsockname()[1]
    argv = [
        "engine",
        "--model-path",
        str(tiny_model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--disable-radix-cache",
        "--tp-size",
        "1",
    ]
    with ServerProcess(argv, port=port, log_path=tmp_path / "engine.log", sock=sock).start(120) as engine:
        state = httpx.get(engine.url + "/server_info", timeout=10).json()["internal_states"][0]
    assert (state["model"], state["enable_lora"], state["max_lora_rank"], state["disable_radix_cache"]) == (
        str(tiny_model_dir),
        True,
        8,
        True,
    )


def test_the_builtin_engine_refuses_tensor_parallelism(capsys):
    with pytest.raises(
        SystemExit, match=r"engine.tp_size \(--tp-size\) must be 1: the built-in engine runs on one device"
    ):
        main(["engine", "--model-path", "/m", "--tp-size", "2"])


# ---- Ray and start-up settings (findings 5, 9c) ----------------------------------------------


def test_master_address_is_this_nodes_ip_on_a_ray_cluster():
    node_ip = ray.util.get_node_ip_address()
    if node_ip.startswith("127."):
        pytest.skip("this machine has no address but loopback")

    def address(*overrides: str) -> str:
        return load_run_config(None, ["model=/m", "data.source=x", *overrides]).weight_sync.master_address

    assert address("launch.mode=ray", "launch.ray_address=auto") == node_ip
    assert (
        address("launch.mode=ray", "launch.ray_address=auto", "weight_sync.master_address=10.1.2.3") == "10.1.2.3"
    )  # given: kept
    assert (
        address() == "127.0.0.1" and address("launch.mode=ray") == "127.0.0.1"
    )  # local, or a Ray of its own on loopback


def test_ray_sglang_engines_need_their_tp_in_gpus():
    with pytest.raises(
        ValueError, match=r"launch.engine_gpus \(1\) must be >= the SGLang engines' tp size \(2, launch.sglang_args\)"
    ):
        LaunchConfig(mode="ray", engine_kind="sglang", sglang_args=["--tp-size", "2"], engine_gpus=1)
    assert LaunchConfig(mode="ray", engine_kind="sglang", sglang_args=["--tp-size=2"], engine_gpus=2).engine_gpus == 2


def test_sglang_engines_get_a_longer_start_timeout():
    assert LaunchConfig().start_timeout == 300 and LaunchConfig(engine_kind="sglang").start_timeout == 1800
    assert LaunchConfig(teacher=TeacherConfig(engine_kind="sglang")).start_timeout == 1800
    assert LaunchConfig(engine_kind="sglang", start_timeout=60).start_timeout == 60


def test_a_launched_servers_port_is_its_own_before_it_binds(tiny_model_dir, tmp_path):
    """Found on two test workers: a port only picked free was bound by another test's engine in
    the seconds the run's router took to start, and that engine answered the router's health
    checks. The launcher holds each port from the moment it picks it and the child serves on the
    socket it inherits; a respawn binds the same port again."""
    engine = engine_process(tiny_model_dir, log_path=tmp_path / "engine.log")
    router = router_process(LaunchConfig(), [engine.url], tmp_path)
    for port in (engine.port, router.port):
        with pytest.raises(OSError):
            socket.create_server(("127.0.0.1", port))
    with engine.start(120), router.start(60):
        assert httpx.get(router.url + "/workers", timeout=10).json()["workers"][0]["url"] == engine.url
        router.kill()
        router.start(60)
        assert (
            httpx.post(
                router.url + "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            ).status_code
            == 200
        )


def test_a_server_not_healthy_in_time_names_its_log(tmp_path):
    """A static file server on the port: up, but /health is a 404, so it never becomes healthy."""
    port, log = free_port(), tmp_path / "server.log"
    proc = ServerProcess(["--bind", "127.0.0.1", str(port)], port=port, log_path=log, module="http.server")
    with pytest.raises(
        TimeoutError, match=rf"http.server on port {port} not healthy within 2s; read its log, {re.escape(str(log))}"
    ):
        proc.start(timeout=2)


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_another_servers_health_on_a_childs_port_is_not_the_childs(tmp_path):
    """A child that binds its own port (SGLang, after loading its model) can find it taken by
    another server in the meantime, whose /health answers 200: that is not the child's health.
    The wait goes on and its error names who holds the port."""
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    (tmp_path / "loads_a_model.py").write_text("import time\ntime.sleep(600)\n")
    child = ServerProcess([], port=port, module="loads_a_model", env={"PYTHONPATH": str(tmp_path)})
    try:
        with pytest.raises(TimeoutError, match=rf"port {port} answers from another process: pid {os.getpid()} "):
            child.start(timeout=2)
        assert child.proc.poll() is not None  # stopped on the way out
    finally:
        other.shutdown()
        other.server_close()


IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"
)


class _StuckInTheKernel(subprocess.Popen):
    """A child that SIGKILL does not end within any bounded wait, as one inside a GPU driver call:
    no process can be put in that state here, so the wait says so (it reaps the real child only
    when unbounded)."""

    def wait(self, timeout: float | None = None) -> int:
        if timeout is not None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return super().wait()


def test_a_child_that_outlives_its_sigkill_is_left_with_a_warning(caplog):
    """`stop` (SIGTERM, then SIGKILL) and the watch loops' `kill` must not fail on such a child."""
    child = ServerProcess([], port=0, module="a_gpu_engine")
    child.proc = _StuckInTheKernel([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    assert child.proc.stdout.readline() == b"ready\n"
    with caplog.at_level(logging.WARNING, logger="slimish.processes"):
        child.stop(timeout=0.1)
    assert "did not exit within 10 s of SIGKILL" in caplog.text
    assert child.proc.wait() == -9  # the SIGKILL was sent


# ---- the recipes' dry runs --------------------------------------------------------------------

SHAPES = {
    "llama": dict(intermediate_size=128, tie_word_embeddings=False),
    "qwen2": dict(intermediate_size=128, tie_word_embeddings=False),  # q/k/v biases
    "qwen3": dict(intermediate_size=128, head_dim=32, tie_word_embeddings=True),  # q/k norms, a free head_dim
    "qwen3_moe": dict(
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("model_type", SHAPES)
def test_parameter_counts_equal_the_hf_models(model_type):
    """The memory figures rest on the plan's count of parameters: equal to the HF model's own."""
    hf = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1000,
        **SHAPES[model_type],
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert model_params(from_hf(hf)) == sum(p.numel() for p in model.parameters())


def dry_run(capsys, recipe: str, *extra: str) -> str:
    assert main(["train", "--config", str(RECIPES / recipe), "--dry-run", "--gpu-memory-gib", "80", *extra]) == 0
    return capsys.readouterr().out


def test_dense_recipe_plan(capsys):
    out = dry_run(capsys, "qwen3_4b_grpo.yaml", "--gpus-per-node", "8")
    assert "trainer: megatron, trainer.nproc 4 = tp 2 x pp 1 x dp 2, bfloat16" in out
    assert all(f"trainer rank {r}: node 0 GPU {r}\n" in out for r in range(4))
    assert all(f"engine {i}: node 0 GPU {4 + i}\n" in out for i in range(4))
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if "sglang.launch_server" in line]
    assert base_gpu_ids([line.split() for line in lines]) == [4, 5, 6, 7] and all(
        "--dtype bfloat16" in line for line in lines
    )
    assert (
        "node 0 GPU 0: trainer rank 0: weights 3.7 + grads 7.5 + fp32 main weights 7.5 + Adam 15.0 = 33.7 of 80" in out
    )
    assert (
        "node 0 GPU 7: engine 3: weights 7.5 + KV cache 60.5 (mem_fraction_static 0.85: 441k tokens) = 68.0 of 80"
        in out
    )
    assert "trainer: python -m torch.distributed.run --standalone --nproc-per-node=4 -m slimish.train --config" in out


def test_moe_recipe_plan(capsys):
    out = dry_run(capsys, "qwen3_30b_a3b_grpo.yaml", "--gpus-per-node", "8")
    assert "30.53 B parameters, 48 layers, 32 attention heads, 4 KV heads, 128 experts (top 8)" in out
    assert "trainer: megatron, trainer.nproc 8 = tp 1 x pp 8 x dp 1" in out and "trainer rank 7: node 0 GPU 7\n" in out
    assert "= 67.9 of 80" in out and "each GPU of engine 1: weights 14.2 + KV cache 53.8" in out
    assert "engine 0: a Ray bundle of 4 GPUs (PACK)" in out and "--base-gpu-id" not in out  # Ray's bundle places them
    assert f"master_address {ray.util.get_node_ip_address()}, 9 ranks" in out


def test_lora_agent_recipe_plan(capsys):
    out = dry_run(capsys, "qwen3_4b_lora_agent.yaml", "--gpus-per-node", "1")
    assert "trainer rank 0: node 0 GPU 0\n" in out and "engine 0: node 0 GPU 0\n" in out
    assert re.search(r"node 0 GPU 0: trainer rank 0: .*; engine 0: weights 7.5 \+ KV cache 40.5 .* = 64.0 of 80", out)
    assert "engine --model /models/Qwen3-4B --host 127.0.0.1 --port PORT --device cuda:0 --dtype bfloat16" in out
    assert "--enable-lora --max-lora-rank 32 --lora-target-modules q_proj k_proj" in out


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        (
            "qwen3_4b_grpo.yaml",
            ["trainer.nproc=5"],
            r"trainer.nproc \(5\) must be a multiple of trainer.tp x trainer.pp \(2 x 1\)",
        ),
        (
            "qwen3_4b_grpo.yaml",
            ["trainer.tp=3", "trainer.nproc=3"],
            r"trainer.tp=3, trainer.pp=1: num_key_value_heads=8 must be divisible",
        ),
        (
            "qwen3_4b_grpo.yaml",
            ["launch.sglang_args=[--tp-size,3]"],
            r"launch.sglang_args --tp-size 3: num_attention_heads=32",
        ),
        ("qwen3_4b_grpo.yaml", ["launch.engines=5"], r"launch.engines: engine 4 would use GPU 8 but the node has 8"),
        ("qwen3_30b_a3b_grpo.yaml", ["trainer.tp=2", "trainer.pp=4"], r"trainer.tp=2 with an MoE model"),
        (
            "qwen3_30b_a3b_grpo.yaml",
            ["trainer.pp=4", "trainer.nproc=4"],
            r"node 0 GPU 0 would hold 130.6 GiB \(trainer rank 0\) of its 80: raise trainer.tp / trainer.pp",
        ),
        (
            "qwen3_30b_a3b_grpo.yaml",
            ["launch.sglang_args=[--tp-size,4,--ep-size,3]"],
            r"launch.sglang_args --ep-size 3",
        ),
    ],
)
def test_recipe_sizes_that_do_not_fit_fail_naming_the_field(recipe, overrides, message):
    with pytest.raises(SystemExit, match=message):
        main(
            [
                "train",
                "--config",
                str(RECIPES / recipe),
                "--dry-run",
                "--gpus-per-node",
                "8",
                "--gpu-memory-gib",
                "80",
                *overrides,
            ]
        )
