"""SGLang 0.5.23's command line, for the flags slimish and its users pass.

SGLang derives its argparse parser from dataclass fields (sglang 0.5.23:
python/sglang/srt/arg_groups/arg_utils.py:298 `add_cli_args_from_dataclass`): a `bool` field is a
bare `store_true` flag (:394), a list field takes `nargs` values (:376), a field may have aliases.
`prepare_server_args` runs `parse_args` on a parser named "sglang serve"
(python/sglang/srt/server_args.py:679, :696), so an unknown flag exits 2 with argparse's error.
Each entry below names its field's file and line under python/sglang/srt/arg_groups/fields/.
"""

from __future__ import annotations

import argparse

# sglang 0.5.23: python/sglang/srt/utils/common.py:4700 SUPPORTED_LORA_TARGET_MODULES (+ "all", :4724)
LORA_TARGET_MODULES = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "all",
]

# (flags, type: str|int|float|bool|list, extra argparse keywords); bool is store_true.
FLAGS: list[tuple[tuple[str, ...], str, dict]] = [
    # model.py
    (("--model-path", "--model"), "str", {"required": True}),  # model.py:51
    (("--load-format",), "str", {"default": "auto"}),  # model.py:58
    (("--trust-remote-code",), "bool", {}),  # model.py:106
    (("--context-length",), "int", {}),  # model.py:110
    (("--is-embedding",), "bool", {}),  # model.py:118
    (("--revision",), "str", {}),  # model.py:122
    (
        ("--dtype",),
        "str",
        {"default": "auto", "choices": ["auto", "half", "float16", "bfloat16", "float", "float32"]},
    ),  # model.py:160
    (("--quantization",), "str", {}),  # model.py:177
    (
        ("--kv-cache-dtype",),
        "str",
        {
            "default": "auto",
            "choices": ["auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4", "fp4_mx_block16"],
        },
    ),  # model.py:197
    (("--download-dir",), "str", {}),  # model.py:344
    # serving.py
    (("--tokenizer-path",), "str", {}),  # serving.py:32
    (("--tokenizer-mode",), "str", {"default": "auto", "choices": ["auto", "slow"]}),  # serving.py:33
    (("--skip-tokenizer-init",), "bool", {}),  # serving.py:58
    (("--host",), "str", {"default": "127.0.0.1"}),  # serving.py:65
    (("--port",), "int", {"default": 30000}),  # serving.py:66
    (("--skip-server-warmup",), "bool", {}),  # serving.py:116
    (("--api-key",), "str", {}),  # serving.py:160
    (("--admin-api-key",), "str", {}),  # serving.py:164
    (("--served-model-name",), "str", {}),  # serving.py:168
    (("--weight-version",), "str", {"default": "default"}),  # serving.py:172
    (("--chat-template",), "str", {}),  # serving.py:176
    (("--sampling-defaults",), "str", {"default": "model", "choices": ["openai", "model"]}),  # serving.py:232
    (("--stream-interval",), "int", {"default": 1}),  # serving.py:262
    (("--tool-call-parser",), "str", {}),  # server_args.py:378 (choices: the installed parsers)
    (("--reasoning-parser",), "str", {}),  # server_args.py:368 (choices: the installed parsers)
    # schedule.py
    (("--mem-fraction-static",), "float", {}),  # schedule.py:27
    (("--max-running-requests",), "int", {}),  # schedule.py:31
    (("--max-total-tokens",), "int", {}),  # schedule.py:39
    (("--chunked-prefill-size",), "int", {}),  # schedule.py:52
    (("--max-prefill-tokens",), "int", {"default": 16384}),  # schedule.py:71
    (
        ("--schedule-policy",),
        "str",
        {
            "default": "fcfs",
            "choices": [
                "lpm",
                "random",
                "fcfs",
                "dfs-weight",
                "lof",
                "priority",
                "routing-key",
                "hrrn",
                "shortest-prefill-first",
            ],
        },
    ),  # schedule.py:86
    (("--page-size",), "int", {}),  # schedule.py:143
    # parallel.py
    (("--dist-timeout",), "int", {}),  # parallel.py:29
    (("--dist-init-addr", "--nccl-init-addr"), "str", {}),  # parallel.py:32
    (("--nnodes",), "int", {"default": 1}),  # parallel.py:43
    (("--node-rank",), "int", {"default": 0}),  # parallel.py:44
    (("--tp-size", "--tensor-parallel-size"), "int", {"default": 1}),  # parallel.py:45
    (("--pp-size", "--pipeline-parallel-size"), "int", {"default": 1}),  # parallel.py:59
    (("--dp-size", "--data-parallel-size"), "int", {"default": 1}),  # parallel.py:73
    (("--enable-p2p-check",), "bool", {}),  # parallel.py:273
    (("--ep-size", "--expert-parallel-size", "--ep"), "int", {"default": 1}),  # parallel.py:281
    (("--enable-dp-attention",), "bool", {}),  # server_args.py:418 (deprecated spelling, still accepted)
    # device.py
    (("--device",), "str", {}),  # device.py:24
    (("--base-gpu-id",), "int", {"default": 0}),  # device.py:28
    (("--gpu-id-step",), "int", {"default": 1}),  # device.py:32
    (("--random-seed",), "int", {}),  # device.py:47
    (("--watchdog-timeout",), "float", {"default": 300}),  # device.py:66
    # memory.py, exec_.py
    (("--disable-radix-cache",), "bool", {}),  # memory.py:64
    (("--enable-memory-saver",), "bool", {}),  # exec_.py:58
    (("--enable-return-routed-experts",), "bool", {}),  # exec_.py:158
    (("--attention-backend",), "str", {}),  # exec_.py:207
    (("--sampling-backend",), "str", {}),  # server_args.py:359
    (("--enable-torch-compile",), "bool", {}),  # exec_.py:691
    (("--disable-custom-all-reduce",), "bool", {}),  # exec_.py:725
    (("--enable-deterministic-inference",), "bool", {}),  # exec_.py:1153
    (("--disable-cuda-graph",), "bool", {}),  # server_args.py:410 (deprecated spelling, still accepted)
    # observability.py
    (("--log-level",), "str", {"default": "info"}),  # observability.py:31
    (("--log-level-http",), "str", {}),  # observability.py:32
    (("--show-time-cost",), "bool", {}),  # observability.py:69
    (("--enable-metrics",), "bool", {}),  # observability.py:70
    (("--decode-log-interval",), "int", {"default": 40}),  # observability.py:136
    # lora.py
    (("--enable-lora",), "bool", {"default": None}),  # lora.py:34 (Optional[bool]: store_true, default None)
    (("--max-lora-rank",), "int", {}),  # lora.py:42
    (("--lora-target-modules",), "list", {"nargs": "*", "choices": LORA_TARGET_MODULES}),  # lora.py:46
    (("--lora-paths",), "list", {"nargs": "*"}),  # lora.py:54 (LoRAPathAction: PATH, NAME=PATH or JSON)
    (("--max-loaded-loras",), "int", {}),  # lora.py:62
    (("--max-loras-per-batch",), "int", {"default": 8}),  # lora.py:66
    (
        ("--lora-backend",),
        "str",
        {"default": "csgmv", "choices": ["triton", "csgmv", "ascend", "torch_native", "triton_v2"]},
    ),  # lora.py:77
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang serve")
    for flags, kind, extra in FLAGS:
        if kind == "bool":
            parser.add_argument(*flags, action="store_true", **extra)
        elif kind == "list":
            parser.add_argument(*flags, type=str, **extra)
        else:
            parser.add_argument(*flags, type={"str": str, "int": int, "float": float}[kind], **extra)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """SGLang's parse: exits 2 with argparse's message on an unknown flag or a bad value."""
    return build_parser().parse_args(argv)
