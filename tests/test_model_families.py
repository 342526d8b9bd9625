"""tests/model_families.py: real vocabularies, special tokens and chat templates in tiny model dirs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from model_families import FAMILIES, TEMPLATES, build_family, fit
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TEXT = 'Hello world! Ünïcödé, 你好 — 1234567\n\n  def f(x):\n\treturn {"a": [1, 2]}\n'


def tool_conversation(family, city: str = "Paris") -> list[dict]:
    args: dict | str = {"city": city}
    if FAMILIES[family].arguments == "str":
        args = json.dumps(args)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"What is the weather in {city}?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": f"It is 21 degrees in {city}."},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def tokenizers(family_dirs):
    return {name: AutoTokenizer.from_pretrained(d) for name, d in family_dirs.items()}


def test_known_encodings(tokenizers):
    for name in ("qwen2.5", "qwen3", "qwen3-coder"):
        assert tokenizers[name].encode("Hello world", add_special_tokens=False) == [9707, 1879]
        assert tokenizers[name].encode("Hello world") == [9707, 1879]  # Qwen adds no BOS
    for name in ("llama3.1", "llama3.2", "hermes3"):
        assert tokenizers[name].encode("Hello world", add_special_tokens=False) == [9906, 1917]
        assert tokenizers[name].encode("Hello world") == [128000, 9906, 1917]  # as Llama 3's post-processor
    # Stand-ins: DeepSeek = Llama 3 ranks + 3 (BOS added like DeepSeek's tokenizer), GLM = Qwen ranks.
    assert tokenizers["deepseek-v3.1"].encode("Hello world") == [0, 9909, 1920]
    assert tokenizers["glm4.6"].encode("Hello world") == [9707, 1879]
    # The real pre-tokenizer splits: Qwen digits one by one, Llama 3 in runs of three.
    assert len(tokenizers["qwen3"].encode("1234567", add_special_tokens=False)) == 7
    assert len(tokenizers["llama3.1"].encode("1234567", add_special_tokens=False)) == 3


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_text_round_trips(tokenizers, name):
    tok = tokenizers[name]
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert tok.decode(ids) == TEXT
    assert max(ids) < FAMILIES[name].tokenizer_size


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_special_tokens_at_real_ids(tokenizers, name):
    f, tok = FAMILIES[name], tokenizers[name]
    assert len(tok) == f.tokenizer_size
    for i, content, special in f.specials:
        assert tok.convert_tokens_to_ids(content) == i
        assert tok.convert_ids_to_tokens(i) == content
        assert tok.added_tokens_decoder[i].special is special, content
        assert tok.encode(content, add_special_tokens=False) == [i]  # never split into pieces
    assert set(tok.all_special_ids) == f.special_ids
    assert tok.eos_token == f.eos and tok.eos_token_id == f.token_id(f.eos)
    assert tok.bos_token == f.bos and tok.pad_token == f.pad


SPOT_CHECKS = {  # id -> (content, special) from the published tokenizer configs
    "qwen2.5": {
        151643: ("<|endoftext|>", True),
        151645: ("<|im_end|>", True),
        151656: ("<|video_pad|>", True),
        151657: ("<tool_call>", False),
        151664: ("<|file_sep|>", False),
    },
    "qwen3": {151665: ("<tool_response>", False), 151667: ("<think>", False), 151668: ("</think>", False)},
    "llama3.1": {
        128000: ("<|begin_of_text|>", True),
        128004: ("<|finetune_right_pad_id|>", True),
        128008: ("<|eom_id|>", True),
        128009: ("<|eot_id|>", True),
        128010: ("<|python_tag|>", True),
        128011: ("<|reserved_special_token_3|>", True),
        128255: ("<|reserved_special_token_247|>", True),
    },
    "deepseek-v3.1": {
        0: ("<｜begin▁of▁sentence｜>", True),
        1: ("<｜end▁of▁sentence｜>", True),
        2: ("<｜▁pad▁｜>", True),
        128798: ("<think>", False),
        128803: ("<｜User｜>", False),
        128804: ("<｜Assistant｜>", False),
        128805: ("<|EOT|>", True),
        128806: ("<｜tool▁calls▁begin｜>", False),
        128814: ("<｜tool▁sep｜>", False),
    },
    "glm4.6": {
        151329: ("<|endoftext|>", True),
        151331: ("[gMASK]", True),
        151336: ("<|user|>", True),
        151338: ("<|observation|>", True),
        151350: ("<think>", False),
        151352: ("<tool_call>", False),
        151356: ("<arg_key>", False),
        151360: ("/nothink", True),
        151362: ("<|end_of_box|>", False),
    },
}


@pytest.mark.parametrize("name", sorted(SPOT_CHECKS))
def test_spot_checked_ids(tokenizers, name):
    tok = tokenizers[name]
    for i, (content, special) in SPOT_CHECKS[name].items():
        assert tok.convert_tokens_to_ids(content) == i
        assert tok.added_tokens_decoder[i].special is special


def test_skip_special_tokens_keeps_tool_tags(tokenizers):
    """Qwen's tool tags are added tokens but not special: decoding for text keeps them."""
    tok = tokenizers["qwen3"]
    ids = tok.encode("<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<tool_call>\n{}\n</tool_call>"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dir_loads_and_renders_tool_conversation(family_dirs, tokenizers, name):
    f, d, tok = FAMILIES[name], family_dirs[name], tokenizers[name]
    model = AutoModelForCausalLM.from_pretrained(d)
    assert type(model).__name__ == "LlamaForCausalLM" and not model.config.tie_word_embeddings
    assert model.config.vocab_size == f.config_vocab_size >= len(tok)
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == (TEMPLATES / f.template).read_text(encoding="utf-8")
    gen = GenerationConfig.from_pretrained(d)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert eos == list(f.eos_token_ids)

    messages = tool_conversation(name)
    ids = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    text = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert "Paris" in text and "21" in text
    if f.bos is not None:
        assert ids.count(f.bos_token_id) == 1  # the template's bos_token only, no second one from encoding
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[-32:]])).logits
    assert logits.shape == (1, min(32, len(ids)), f.config_vocab_size)


def test_rendering_details(tokenizers):
    llama = tokenizers["llama3.1"]
    ids = llama.apply_chat_template(
        tool_conversation("llama3.1"), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[:2] == [128000, 128006] and ids.count(128000) == 1
    assert ids[-4:] == [128006, 78191, 128007, 271]  # <|start_header_id|>assistant<|end_header_id|>\n\n
    qwen = tokenizers["qwen2.5"]
    ids = qwen.apply_chat_template(
        tool_conversation("qwen2.5"), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[-3:] == [151644, 77091, 198] and 151657 in ids  # <|im_start|>assistant\n, <tool_call>
    glm = tokenizers["glm4.6"]
    ids = glm.apply_chat_template(
        tool_conversation("glm4.6"), tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[:2] == [151331, 151333] and ids[-1] == 151337  # [gMASK]<sop> ... <|assistant|>
    assert {151352, 151356, 151358} <= set(ids)  # <tool_call>, <arg_key>, <arg_value>
    ds = tokenizers["deepseek-v3.1"]
    text = ds.apply_chat_template(tool_conversation("deepseek-v3.1"), add_generation_prompt=True, tokenize=False)
    assert '<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>' in text and text.endswith("<｜Assistant｜></think>")


def test_sources_name_every_template():
    sources = (TEMPLATES / "SOURCES.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`([^`]+\.jinja)`", sources))
    assert {p.name for p in TEMPLATES.glob("*.jinja")} <= named
    assert {f.template for f in FAMILIES.values()} <= {p.name for p in TEMPLATES.glob("*.jinja")}


def _target(tok, prompt: list[int], completion: str, eos: int) -> tuple[list[int], list[int]]:
    out = tok.encode(completion, add_special_tokens=False) + [eos]
    return prompt + out, [0] * len(prompt) + [1] * len(out)


def test_fit_reproduces_targets_in_shared_dirs(tmp_path):
    a, b = build_family("qwen2.5", tmp_path / "qwen2.5"), build_family("qwen3", tmp_path / "qwen3", seed=1)
    tok_a, tok_b = AutoTokenizer.from_pretrained(a), AutoTokenizer.from_pretrained(b)
    pa = tok_a.apply_chat_template(
        tool_conversation("qwen2.5")[:2], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # Qwen2.5's and Qwen3's templates render this prompt identically: a second target after the
    # same prompt would be a conflict, so the second sequence asks about another city.
    pb = tok_b.apply_chat_template(
        tool_conversation("qwen3", "Rome")[:2],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    seq_a = _target(
        tok_a, pa, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', 151645
    )
    seq_b = _target(tok_b, pb, "<think>\n\n</think>\n\nIt is sunny.", 151645)
    fit([a, b], [seq_a, seq_b])

    assert os.path.samefile(a / "model.safetensors", b / "model.safetensors")  # one fitted file
    for d, (ids, mask) in ((a, seq_a), (b, seq_b)):
        model = AutoModelForCausalLM.from_pretrained(d)
        n = mask.index(1)
        out = model.generate(
            torch.tensor([ids[:n]]),
            max_new_tokens=len(ids) - n + 5,
            do_sample=False,
            generation_config=GenerationConfig.from_pretrained(d),
        )
        assert out[0, n:].tolist() == ids[n:]  # every target, then stops on the eos id


def test_fit_rejects_conflicts_and_reports_failure(tmp_path):
    d = build_family("llama3.2", tmp_path / "llama")
    with pytest.raises(ValueError, match="conflicting targets"):
        fit([d], [([128000, 9906, 1917], [0, 0, 1]), ([128000, 9906, 1234], [0, 0, 1])])
    with pytest.raises(ValueError, match="position 0"):
        fit([d], [([9906, 1917], [1, 1])])
    with pytest.raises(ValueError, match="architecture and vocab_size"):
        fit([d, build_family("qwen3", tmp_path / "qwen3")], [([1, 2], [0, 1])])
    with pytest.raises(RuntimeError, match="target tokens wrong"):
        fit([d], [([128000] + list(range(1000, 1040)), [0] + [1] * 40)], max_steps=1)
