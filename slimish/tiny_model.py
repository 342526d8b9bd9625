"""Random-init HF causal LMs with a locally trained tokenizer: `slimish make-tiny-model DIR`.

Why: tests, CI and the CPU quickstart need real model directories (loadable by
`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`, like a hub checkpoint)
on machines that cannot download anything. The weights are random, so text quality is nil, but
every code path (chat template, tool-call tokens, GQA, tied and untied heads, q/k norms, weight
sync) is the one a real Qwen/Llama checkpoint takes.

- `arch`: `qwen2` (tied embeddings), `qwen3` (q/k norms, head_dim != hidden/heads, tied),
  `llama` (untied lm_head); mixture-of-experts `qwen3_moe` (8 experts, top-2, renormalised) and
  `qwen2_moe` (the same plus a gated shared expert). All use grouped-query attention.
- `size`: `tiny` (~0.2M params, builds in seconds, for tests) or `small` (~30M, for benchmarks).
- The tokenizer is byte-level BPE with digits split one per token and NFC normalisation (as Qwen2's;
  any NFC text round-trips), trained on a synthetic corpus generated from `seed`, so nothing
  depends on files of the machine.
  It has ChatML special tokens and a Qwen2.5-style chat template with tool calls.
- Same `seed`, same bytes: `model.safetensors` and `tokenizer.json` are reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

EOS, PAD = "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    EOS,
    PAD,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

ARCHS: dict[str, type[PretrainedConfig]] = {
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "llama": LlamaConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "qwen2_moe": Qwen2MoeConfig,
}
# Mixture-of-experts shape (8 experts, top-2, each an eighth of the dense MLP's width, so every size
# keeps its parameter band). qwen3_moe renormalises the top-k weights;
# qwen2_moe does not, and adds a gated shared expert (the DeepSeek-style layout).
MOE_ARCHS = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
}

# Shared shape per size; ARCH_OVERRIDES keeps every arch of a size in the same parameter band
# (small: 28-32M) although qwen3's wider attention and llama's untied head cost parameters.
SHAPE = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
)
SIZES: dict[str, dict[str, int]] = {
    name: dict(zip(SHAPE, values))
    for name, values in {
        "tiny": (1024, 64, 2, 4, 2, 192, 2048),
        "mini": (1024, 128, 4, 4, 2, 384, 2048),
        "small": (8192, 512, 8, 8, 4, 1536, 2048),
    }.items()
}
ARCH_OVERRIDES: dict[tuple[str, str], dict[str, int]] = {
    ("qwen3", "tiny"): dict(head_dim=32),
    ("qwen3", "small"): dict(head_dim=128, num_hidden_layers=7),
    ("llama", "small"): dict(num_hidden_layers=7),
    ("qwen2_moe", "small"): dict(num_hidden_layers=6),
}

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits (\p{N}), punctuation runs,
# newlines, spaces. Single digits keep arithmetic learnable digit by digit.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2.5's template, with one change: tool-call `arguments` given as a JSON string (OpenAI
# format) are written as is instead of being JSON-encoded a second time.
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were has had been being am did does done said made went gone
number sum add plus minus times equals answer question result value list item name key data file line
word text string code function class method return print input output test check true false none null
error problem step first second third last next before after while until again always never often
small large big little long short high low old young early late right left up down here there where
water food house home city country world school student teacher book story game music money market
computer program system network server client request response message model token tokenizer train
learn reward policy agent tool call search weather calculator time date today tomorrow yesterday
red blue green black white yellow orange purple one two three four five six seven eight nine ten
hundred thousand count total average maximum minimum even odd prime square root divide multiply
cat dog bird fish tree flower sun moon star sky rain snow wind river sea mountain road car train bus
man woman child friend family mother father brother sister name person group team company office
open close start stop read write send receive find show tell ask help try keep let put mean seem
feel leave call run move live believe bring happen begin provide sit stand lose pay meet include
continue set change lead understand watch follow create speak allow spend grow offer remember love
consider appear buy wait serve die build stay fall cut reach kill remain suggest raise pass sell
require report decide pull happy sad quick slow hot cold easy hard simple clear full empty free
important different possible public able real sure best better great little own same few many much
""".split()

PY_KEYWORDS = "def return if elif else for while in import from class with as try except raise lambda yield".split()
TOOLS = ["calculator", "search", "get_weather", "python", "lookup", "read_file"]
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"] + ["ch", "sh", "th", "qu", "st", "tr"]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """Made-up names: enough distinct letter runs for BPE to fill a vocabulary of thousands."""
    endings = ["", "n", "r", "s", "x"]
    return ["".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) + rng.choice(endings) for _ in range(n)]


def _sentence(rng: random.Random, lexicon: list[str]) -> str:
    words = rng.choices(WORDS, k=rng.randint(3, 12))
    words[rng.randrange(len(words))] = rng.choice(lexicon).capitalize()
    return words[0].capitalize() + " " + " ".join(words[1:]) + rng.choice([".", ".", "?", "!", ","])


def _arithmetic(rng: random.Random, lexicon: list[str]) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op, res = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    return rng.choice(
        [
            f"{a}{op}{b}={res}",
            f"{a} {op} {b} = {res}",
            f"What is {a}{op}{b}? The answer is {res}.",
            f"Q: {a} {op} {b}\nA: {res}",
        ]
    )


def _identifier(rng: random.Random, lexicon: list[str]) -> str:
    parts = [rng.choice(lexicon if rng.random() < 0.3 else WORDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.5:
        return "_".join(parts)
    return parts[0] + "".join(p.capitalize() for p in parts[1:])


def _python(rng: random.Random, lexicon: list[str]) -> str:
    f, x, y = (_identifier(rng, lexicon) for _ in range(3))
    n = rng.randint(0, 100)
    return rng.choice(
        [
            f"def {f}({x}, {y}={n}):\n    return {x} + {y}\n",
            f"for {x} in range({n}):\n    {y}.append({x} * {n})\n",
            f'if {x} > {n}:\n    print(f"{{{x}}} is big")\nelse:\n    {x} += 1\n',
            f"class {f.title().replace('_', '')}:\n    def __init__(self, {x}):\n        self.{x} = {x}\n",
            f"{x} = [{', '.join(str(rng.randint(0, 99)) for _ in range(rng.randint(1, 6)))}]\n",
            f"import {x}\nfrom {y} import {f}\n",
            f'{x} = {{"{y}": {n}, "{f}": "{rng.choice(WORDS)}"}}\n',
            " ".join(rng.choices(PY_KEYWORDS, k=4)) + f" {x}:\n",
        ]
    )


def _tool_call(rng: random.Random, lexicon: list[str]) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    args = rng.choice(
        [
            {"expression": f"{a}+{b}"},
            {"query": " ".join(rng.choices(WORDS, k=3))},
            {"city": rng.choice(lexicon).capitalize(), "unit": rng.choice(["celsius", "fahrenheit"])},
            {"code": f"print({a} * {b})"},
        ]
    )
    if rng.random() < 0.3:
        return json.dumps({"result": a * b, "ok": True})
    return json.dumps({"name": rng.choice(TOOLS), "arguments": args})


def synthetic_corpus(seed: int, n_lines: int) -> list[str]:
    """Deterministic training text: prose, made-up names, arithmetic, code and tool-call JSON."""
    rng = random.Random(seed)
    lexicon = _pseudo_words(rng, n_lines // 8)
    makers = [_sentence, _sentence, _arithmetic, _python, _tool_call]
    return [rng.choice(makers)(rng, lexicon) for _ in range(n_lines)]


def train_tokenizer(vocab_size: int, seed: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE on `synthetic_corpus(seed)`; deterministic with or without tokenizers' threads."""
    tok = Tokenizer(models.BPE())
    # NFC like Qwen2's tokenizer.json: transformers loads qwen2 checkpoints with Qwen2Tokenizer,
    # which imposes NFC, so without it here `tokenizers` and `transformers` would disagree.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed, n_lines=2 * vocab_size), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS, PAD)],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


def model_config(
    arch: str, size: str, vocab_size: int | None = None, **token_ids: int | list[int] | None
) -> PretrainedConfig:
    """The HF config of `arch` at `size`; `vocab_size` defaults to the size's tokenizer target."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    shape = {**SIZES[size], **ARCH_OVERRIDES.get((arch, size), {})}
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    if arch in MOE_ARCHS:
        shape.update(MOE_ARCHS[arch], moe_intermediate_size=shape["intermediate_size"] // 8)
        if arch == "qwen2_moe":
            shape["shared_expert_intermediate_size"] = shape["intermediate_size"] // 4
    return ARCHS[arch](
        **shape,
        tie_word_embeddings=arch not in ("llama", "qwen2_moe"),  # as their published checkpoints
        rms_norm_eps=1e-6,
        dtype="float32",
        **token_ids,
    )


def make_tiny_model(out_dir: str | Path, arch: str = "qwen2", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-init `arch` model of `size` and its tokenizer to `out_dir`; return the path."""
    target = model_config(arch, size)  # validates arch and size before any work
    tokenizer = train_tokenizer(target.vocab_size, seed, target.max_position_embeddings)
    token_ids = dict(
        eos_token_id=[tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids("<|endoftext|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    config = model_config(arch, size, vocab_size=len(tokenizer), **token_ids)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**token_ids)
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def scale_experts(src: str | Path, out: str | Path, scale: float) -> Path:
    """A copy of the MoE model `src` with its experts' weights times `scale`, written to `out`. Why: at
    the random init (std 0.02) a tiny model's experts barely move the residual stream, so which expert
    a token takes hardly matters and bf16's own noise hides a routing flip; in a trained model it matters."""
    src, out = Path(src), Path(out)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.mul_(scale)
    model.save_pretrained(out)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def parameter_count(model_dir: str | Path) -> int:
    """Parameters stored in `model_dir`/model.safetensors (a tied lm_head counts once), read from the header."""
    with safe_open(Path(model_dir) / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", metavar="DIR", help="directory to write the model and tokenizer into")
    parser.add_argument("--arch", default="qwen2", choices=sorted(ARCHS))
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    path = make_tiny_model(args.out_dir, arch=args.arch, size=args.size, seed=args.seed)
    seconds = time.perf_counter() - start
    print(f"{path}: {args.arch}/{args.size}, {parameter_count(path) / 1e6:.2f}M parameters, built in {seconds:.1f}s")
    return 0
