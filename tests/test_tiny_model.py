"""`make_tiny_model` writes directories that transformers loads like hub checkpoints, reproducibly."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from slimish.moe import route_shape, routers
from slimish.tiny_model import (
    ARCHS,
    SIZES,
    SPECIAL_TOKENS,
    add_arguments,
    make_tiny_model,
    model_config,
    parameter_count,
    run,
    train_tokenizer,
)

CLASSES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
}
TEXTS = [
    "What is 12+7? The answer is 19.",
    "def f(x):\n    return x * 2\n\n\tdone  ",
    '{"name": "calculator", "arguments": {"expression": "305*12"}}',
    "ünïcødé 日本語 🙂 Zürich",
    "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call><|endoftext|>",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Seed 0 of every arch, built here (not the conftest models) so this file pins its own inputs."""
    root = tmp_path_factory.mktemp("archs")
    return {arch: make_tiny_model(root / arch, arch=arch, size="tiny", seed=0) for arch in sorted(ARCHS)}


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]):
    return AutoTokenizer.from_pretrained(model_dirs["qwen2"])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_loads_and_runs_forward(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert type(model).__name__ == CLASSES[arch]
    assert model.dtype == torch.float32
    assert (path / "model.safetensors").is_file()
    assert cfg.vocab_size == len(tok) == SIZES["tiny"]["vocab_size"]
    assert cfg.num_key_value_heads < cfg.num_attention_heads
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == (arch not in ("llama", "qwen2_moe")) == cfg.tie_word_embeddings
    if arch.endswith("_moe"):  # every layer routes to 2 of 8 experts; qwen2_moe adds a shared one
        assert route_shape(cfg) == (cfg.num_hidden_layers, 2) and cfg.num_experts == 8
        assert list(routers(model)) == list(range(cfg.num_hidden_layers))
        assert hasattr(model.model.layers[0].mlp, "shared_expert") == (arch == "qwen2_moe")
    if arch == "qwen3":  # head_dim deliberately differs from hidden/heads, as in real Qwen3
        assert cfg.head_dim == 32 != cfg.hidden_size // cfg.num_attention_heads
        assert model.model.layers[0].self_attn.q_proj.out_features == 4 * 32
        assert model.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    ids = torch.tensor([tok.encode(TEXTS[0])])
    with torch.inference_mode():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    assert parameter_count(path) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_special_token_ids_in_configs(model_dirs: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dirs[arch])
    tok = AutoTokenizer.from_pretrained(model_dirs[arch])
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    for cfg in (model.config, model.generation_config):
        assert cfg.eos_token_id == eos
        assert cfg.pad_token_id == tok.convert_tokens_to_ids("<|pad|>")
        assert cfg.bos_token_id is None
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|pad|>", None)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_and_all_loaders_agree(model_dirs: dict[str, Path], text: str) -> None:
    # transformers loads qwen2 dirs with Qwen2Tokenizer, the others with TokenizersBackend; the
    # tokenizer.json is the same file (same seed), so every loader must give the same ids.
    raw = Tokenizer.from_file(str(model_dirs["qwen2"] / "tokenizer.json")).encode(text).ids
    for path in model_dirs.values():
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.encode(text) == raw
        assert tok.decode(raw) == text


def test_text_is_nfc_normalised_by_every_loader(model_dirs: dict[str, Path]) -> None:
    """Qwen2Tokenizer forces NFC on qwen2 dirs, so tokenizer.json carries NFC too: all loaders agree."""
    decomposed, composed = "cafe\u0301 12", "caf\u00e9 12"
    raw = Tokenizer.from_file(str(model_dirs["qwen2"] / "tokenizer.json"))
    assert raw.encode(decomposed).ids == raw.encode(composed).ids
    for path in model_dirs.values():
        tok = AutoTokenizer.from_pretrained(path)
        assert tok.encode(decomposed) == raw.encode(composed).ids
        assert tok.decode(tok.encode(decomposed)) == composed


def test_digits_and_special_tokens_are_single_tokens(tokenizer) -> None:
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("2024+38=2062")) == list("2024+38=2062")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    for token, token_id in zip(SPECIAL_TOKENS, ids):
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.encode(f"a{token}b")[1] == token_id
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)
    assert tokenizer.decode(tokenizer.encode("<|im_end|> x"), skip_special_tokens=True) == " x"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
TOOL_CHAT_PROMPT = (
    "<|im_start|>system\nYou add numbers.\n\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.", '
    '"parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 12+7?<|im_end|>\n"
    "<|im_start|>assistant\nLet me check.\n<tool_call>\n"
    '{"name": "calculator", "arguments": {"expression": "12+7"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _tool_conversation(arguments: object) -> list[dict]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": arguments}}
    return [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 12+7?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "content": "19"},
    ]


@pytest.mark.parametrize("arguments", [{"expression": "12+7"}, '{"expression": "12+7"}'], ids=["dict", "json-str"])
def test_chat_template_renders_tool_calls_like_qwen25(tokenizer, arguments: object) -> None:
    text = tokenizer.apply_chat_template(
        _tool_conversation(arguments), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text == TOOL_CHAT_PROMPT
    ids = tokenizer.apply_chat_template(
        _tool_conversation(arguments), tools=TOOLS, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids == tokenizer.encode(TOOL_CHAT_PROMPT)
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>"):
        assert ids.count(tokenizer.convert_tokens_to_ids(token)) == TOOL_CHAT_PROMPT.count(token)


def test_chat_template_default_system_and_generation_prompt(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_same_seed_same_bytes_other_seed_other_weights(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", arch="qwen2", size="tiny", seed=0)
    other = make_tiny_model(tmp_path / "other", arch="qwen2", size="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (model_dirs["qwen2"] / name).read_bytes(), name
    a = AutoModelForCausalLM.from_pretrained(again).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], b["model.layers.0.self_attn.q_proj.weight"])


def test_build_leaves_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_tiny_model(tmp_path / "m", arch="llama")
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_small_is_about_30m_parameters(arch: str) -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(arch, "small"))
    assert 28e6 <= sum(p.numel() for p in model.parameters()) <= 32e6


def test_small_tokenizer_fills_its_vocabulary() -> None:
    """The parameter band above assumes len(tokenizer) == the target vocab (what make_tiny_model uses)."""
    vocab = SIZES["small"]["vocab_size"]
    assert len(train_tokenizer(vocab, seed=0, max_length=2048)) == vocab


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "gpt2"}, r"arch must be one of \['llama', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'\], got 'gpt2'"),
        ({"size": "huge"}, r"size must be one of \['mini', 'small', 'tiny'\], got 'huge'"),
    ],
)
def test_bad_arch_or_size_is_rejected_before_writing(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimish make-tiny-model")
    add_arguments(parser)
    return parser


def test_cli_builds_a_loadable_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli-model"
    assert run(_parser().parse_args([str(out), "--arch", "qwen3", "--seed", "3"])) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"{out}: qwen3/tiny, {parameter_count(out) / 1e6:.2f}M parameters, built in ")
    assert type(AutoModelForCausalLM.from_pretrained(out)).__name__ == "Qwen3ForCausalLM"


def test_cli_rejects_unknown_arch(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["d", "--arch", "gpt2"])
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err
