"""Tiny random HF model directories for real LLM families: real vocabulary, real special tokens at
their real ids, real chat template; a stand-in network.

Why: multi-turn tool-calling conversations must be recorded token-exactly per family, and what
breaks token-exactness lives in the tokenizer and the template (special tokens that decode to
nothing, BOS added twice, a template that re-renders history differently, a turn that ends on a
token the engine does not stop on). Those must be the real ones; the network need not be.
Everything comes from packages on the package registry, nothing from a model hub:

- BPE ranks: Qwen's `qwen.tiktoken` (in `dashscope`; the same 151643 ranks as Qwen2/2.5/3) and
  Llama 3's `tokenizer.model` (in `llama_models`, 128000 ranks), converted with transformers'
  `TikTokenConverter` (a few seconds, cached per process).
- Special tokens: real ids and `special` flags, each checked against published tokenizer configs
  where the stored sources had them (see the comments at each table; guesses are marked GUESS).
- Chat templates: verbatim copies in `tests/fixtures/chat_templates/` (see SOURCES.md there).
- DeepSeek and GLM ranks are not published on PyPI: their vocabularies are STAND-INS (Llama 3's
  ranks shifted up by 3 for DeepSeek; Qwen's first 151329 ranks for GLM) carrying the real special
  tokens at the real ids, so ordinary text tokenizes differently from the real model, while the
  template's structure tokens are exactly the real ones.

The network is a stand-in for every family: a `llama` architecture (`LlamaForCausalLM`, untied
lm_head) with hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 192, float32, and the real
config `vocab_size` of the family. It is random until `fit` teaches it the exact token sequences a
test needs it to produce under greedy decoding.

Tokenizers load with `AutoTokenizer.from_pretrained(dir)` as `PreTrainedTokenizerFast`, which takes
`tokenizer.json` as written. (transformers 5.25's `Qwen2Tokenizer` rebuilds the BPE model, NFC
normalizer and Qwen2 pre-tokenizer from vocab + merges, dropping `ignore_merges` and any other
pattern; its `LlamaTokenizer`/`LlamaTokenizerFast` builds a SentencePiece-style Metaspace
tokenizer. `PreTrainedTokenizerFast` is `TokenizersBackend` in transformers 5 and is understood by
transformers 4 too, which real SGLang/vLLM installs still use.)

Usage (plain functions, no pytest fixtures):

    d = build_family("qwen3", tmp / "qwen3")        # ~1-1.5 s; + 1-2 s once per rank file per process
    fit([d, other_qwen_dir], [(ids, mask), ...])    # shared weights, one fitted file, hard-linked
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slimish.tiny_model import SIZES

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/2.5/3): digits one per token.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's (meta-llama tokenizer.json; tiktoken's cl100k pattern): digits in runs of up to 3.
# GLM-4's tokenizer uses the same pattern (to our recollection of ChatGLM4Tokenizer; not verified here).
LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# The stand-in network: the tiny model's (only vocab_size differs), with room for long conversations.
NETWORK = {**{k: v for k, v in SIZES["tiny"].items() if k != "vocab_size"}, "max_position_embeddings": 4096}


@dataclass(frozen=True)
class Vocabulary:
    """Ordinary (BPE) ids: ranks `0 .. n_ranks-1` of `ranks` become ids `first_id ..`."""

    name: str
    ranks: str  # "qwen" | "llama3": which rank file
    pattern: str
    nfc: bool  # NFC normalizer (Qwen2's tokenizer.json has one)
    first_id: int
    n_ranks: int
    ignore_merges: bool  # a pre-token found whole in the vocabulary is one token (tiktoken's rule)
    stand_in: bool  # not the family's real ranks (only its special tokens are real)


VOCABULARIES: dict[str, Vocabulary] = {
    "qwen": Vocabulary("qwen", "qwen", QWEN_PATTERN, True, 0, 151643, False, False),
    "llama3": Vocabulary("llama3", "llama3", LLAMA3_PATTERN, False, 0, 128000, True, False),
    # DeepSeek-V3's own ranks are not on PyPI: Llama 3's ranks shifted up by 3 (ids 0-2 are
    # DeepSeek's BOS/EOS/pad, as in the real tokenizer) and cut at 127997 so that ordinary ids end at
    # 127999 as DeepSeek's do. Cutting BPE ranks keeps the merges consistent (a token's parts always
    # have lower ranks than the token).
    "deepseek": Vocabulary("deepseek", "llama3", LLAMA3_PATTERN, False, 3, 127997, True, True),
    # GLM-4.5/4.6's ranks are not on PyPI either: Qwen's first 151329 ranks (GLM's specials start at
    # 151329), with GLM-4's pre-tokenizer pattern.
    "glm": Vocabulary("glm", "qwen", LLAMA3_PATTERN, False, 0, 151329, False, True),
}

Special = tuple[int, str, bool]  # (id, content, special flag as in the real added_tokens_decoder)


# --- Qwen ------------------------------------------------------------------------------------------
# Verified against stored copies of Qwen2.5's and Qwen3's tokenizer_config.json (added_tokens_decoder:
# 151643-151656 special true; 151657-151664 `<tool_call>` .. `<|file_sep|>` special false; Qwen3 adds
# 151665-151668 `<tool_response>` .. `</think>`, special false).
def numbered(first: int, tokens: str, special: bool) -> tuple[Special, ...]:
    """Consecutive ids from `first` for the space-separated `tokens`."""
    return tuple((first + i, t, special) for i, t in enumerate(tokens.split()))


QWEN25_SPECIALS: tuple[Special, ...] = numbered(
    151643,
    "<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|> <|box_start|> <|box_end|> "
    "<|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|> <|vision_pad|> <|image_pad|> <|video_pad|>",
    True,
) + numbered(
    151657,
    "<tool_call> </tool_call> <|fim_prefix|> <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|>",
    False,
)
QWEN3_SPECIALS: tuple[Special, ...] = QWEN25_SPECIALS + numbered(
    151665, "<tool_response> </tool_response> <think> </think>", False
)

# --- Llama 3.1 / 3.2 -------------------------------------------------------------------------------
# meta-llama Llama-3.1/3.2 tokenizer_config.json: all 256 added tokens special. Verified: 128000,
# 128001, 128004, 128006-128010 (stored Llama-3.1 fine-tune configs), and 256 reserved slots
# 128000-128255 with reserved_special_token_247 last (Meta's tokenizer.py layout).
_LLAMA3_NAMED = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128002: "<|reserved_special_token_0|>",
    128003: "<|reserved_special_token_1|>",
    128004: "<|finetune_right_pad_id|>",
    128005: "<|reserved_special_token_2|>",
    128006: "<|start_header_id|>",
    128007: "<|end_header_id|>",
    128008: "<|eom_id|>",
    128009: "<|eot_id|>",
    128010: "<|python_tag|>",
}


def _llama3_specials(overrides: dict[int, tuple[str, bool]] | None = None) -> tuple[Special, ...]:
    out = []
    for i in range(128000, 128256):
        content = _LLAMA3_NAMED.get(i, f"<|reserved_special_token_{i - 128008}|>")
        special = True
        if overrides and i in overrides:
            content, special = overrides[i]
        out.append((i, content, special))
    return tuple(out)


LLAMA3_SPECIALS = _llama3_specials()

# --- Hermes 3 (Llama 3.1 vocabulary + ChatML) ------------------------------------------------------
# GUESS: Hermes 3 puts its ChatML and tool tags into Llama 3's reserved slots, but no stored public
# source had Hermes 3's tokenizer_config.json, so the slots (from reserved_special_token_3 = 128011
# on, in this order) and their special flags (true, as the reserved slots they replace) are ours.
HERMES3_TOKENS = [
    "<|im_start|>",
    "<|im_end|>",
    "<tools>",
    "</tools>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
HERMES3_SPECIALS = _llama3_specials({128011 + i: (t, True) for i, t in enumerate(HERMES3_TOKENS)})
HERMES3_IM_END = 128011 + HERMES3_TOKENS.index("<|im_end|>")

# --- DeepSeek-V3 / V3.1 ----------------------------------------------------------------------------
# Ids verified: 0-2 and 128800-128814 (DeepSeek-V3-0324 GGUF token listing; splintr's deepseek_v3
# table); 128796-128799 are V3.1's `<｜search▁begin｜>`, `<｜search▁end｜>`, `<think>`, `</think>`
# (a V3.1 config comparison; in V3 these four were placeholders, R1 already had <think> at 128798).
# Special flags verified for V3 (splintr, measured on DeepSeek-V3's tokenizer.json): 128800-128804
# and 128806-128814 special false; 0-2, the placeholders and `<|EOT|>` (128805) special true.
# GUESS: <think>/</think> special false as in R1's tokenizers (stored R1-Distill tokenizer.json);
# the two search tokens special true like the placeholders they replaced.
DEEPSEEK_SPECIALS: tuple[Special, ...] = tuple(
    [(0, "<｜begin▁of▁sentence｜>", True), (1, "<｜end▁of▁sentence｜>", True), (2, "<｜▁pad▁｜>", True)]
    + [(128000 + i, f"<｜place▁holder▁no▁{i}｜>", True) for i in range(796)]
    + [
        (128796, "<｜search▁begin｜>", True),
        (128797, "<｜search▁end｜>", True),
        (128798, "<think>", False),
        (128799, "</think>", False),
        (128800, "<｜fim▁hole｜>", False),
        (128801, "<｜fim▁begin｜>", False),
        (128802, "<｜fim▁end｜>", False),
        (128803, "<｜User｜>", False),
        (128804, "<｜Assistant｜>", False),
        (128805, "<|EOT|>", True),
        (128806, "<｜tool▁calls▁begin｜>", False),
        (128807, "<｜tool▁calls▁end｜>", False),
        (128808, "<｜tool▁call▁begin｜>", False),
        (128809, "<｜tool▁call▁end｜>", False),
        (128810, "<｜tool▁outputs▁begin｜>", False),
        (128811, "<｜tool▁outputs▁end｜>", False),
        (128812, "<｜tool▁output▁begin｜>", False),
        (128813, "<｜tool▁output▁end｜>", False),
        (128814, "<｜tool▁sep｜>", False),
    ]
)

# --- GLM-4.5 / 4.6 ---------------------------------------------------------------------------------
# Ids 151329-151364 verified (stored GLM-4 tokenizer_config.json for 151329-151342; splintr's glm4
# table and llama.cpp's GLM-4.5 preserved-token list for the rest). Special flags: 151329-151346 are
# special in every stored GLM config; splintr measured GLM-4.5's tokenizer.json: 151350-151359
# (think, tool, arg tags) and 151361-151364 (box, image, video) special false, the rest (code_*,
# /nothink) special true.
GLM_SPECIALS: tuple[Special, ...] = tuple(
    (151329 + i, t, not (151350 <= 151329 + i <= 151359 or 151329 + i >= 151361))
    for i, t in enumerate(
        [
            "<|endoftext|>",
            "[MASK]",
            "[gMASK]",
            "[sMASK]",
            "<sop>",
            "<eop>",
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|observation|>",
            "<|begin_of_image|>",
            "<|end_of_image|>",
            "<|begin_of_video|>",
            "<|end_of_video|>",
            "<|begin_of_audio|>",
            "<|end_of_audio|>",
            "<|begin_of_transcription|>",
            "<|end_of_transcription|>",
            "<|code_prefix|>",
            "<|code_middle|>",
            "<|code_suffix|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "/nothink",
            "<|begin_of_box|>",
            "<|end_of_box|>",
            "<|image|>",
            "<|video|>",
        ]
    )
)


@dataclass(frozen=True)
class Family:
    """One model family: vocabulary, added tokens, special tokens, template, stop ids.

    `specials` are all added tokens as (id, content, special). `eos_token_ids` go into
    generation_config.json and config.json (what engines stop on). `add_bos`: the tokenizer.json
    post-processor prepends BOS on `encode(text)` with special tokens (Llama 3's and DeepSeek's do;
    their templates write `{{ bos_token }}` themselves and `apply_chat_template` encodes without
    special tokens, so a rendered chat has one BOS). `clean_up_tokenization_spaces` is the real
    config's value: True for Llama 3 (decode then turns " ," into ","), False elsewhere.
    """

    name: str
    vocab: str
    template: str
    specials: tuple[Special, ...] = field(repr=False)
    eos: str
    eos_token_ids: tuple[int, ...]
    config_vocab_size: int
    bos: str | None = None
    pad: str | None = None
    add_bos: bool = False
    clean_up_tokenization_spaces: bool = False
    tokenizer_class: str = "PreTrainedTokenizerFast"
    # How the template wants assistant tool-call `arguments`: "dict" (rendered with tojson or
    # iterated) or "str" (concatenated: DeepSeek-V3.1's template raises TypeError on a dict).
    arguments: str = "dict"
    notes: str = ""

    def token_id(self, content: str) -> int:
        for i, c, _ in self.specials:
            if c == content:
                return i
        raise KeyError(f"{content!r} is not an added token of {self.name}")

    @property
    def special_ids(self) -> set[int]:
        """Ids of added tokens flagged special (decode(skip_special_tokens=True) drops these)."""
        return {i for i, _, s in self.specials if s}

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos is None else self.token_id(self.bos)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad is None else self.token_id(self.pad)

    @property
    def tokenizer_size(self) -> int:
        return max(i for i, _, _ in self.specials) + 1


_QWEN = dict(
    vocab="qwen", eos="<|im_end|>", pad="<|endoftext|>", eos_token_ids=(151645, 151643), config_vocab_size=151936
)
_LLAMA = dict(
    vocab="llama3", bos="<|begin_of_text|>", add_bos=True, clean_up_tokenization_spaces=True, config_vocab_size=128256
)
_DEEPSEEK = dict(
    vocab="deepseek",
    specials=DEEPSEEK_SPECIALS,
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    pad="<｜end▁of▁sentence｜>",
    add_bos=True,
    eos_token_ids=(1,),
    config_vocab_size=129280,
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("qwen2.5", template="Qwen-Qwen2.5-7B-Instruct.jinja", specials=QWEN25_SPECIALS, **_QWEN),
        Family("qwen3", template="Qwen-Qwen3-0.6B.jinja", specials=QWEN3_SPECIALS, **_QWEN),
        Family("qwen3-coder", template="Qwen3-Coder.jinja", specials=QWEN3_SPECIALS, **_QWEN),
        Family(
            "llama3.1",
            template="meta-llama-Llama-3.1-8B-Instruct.jinja",
            specials=LLAMA3_SPECIALS,
            eos="<|eot_id|>",
            eos_token_ids=(128001, 128008, 128009),
            **_LLAMA,
        ),
        Family(
            "llama3.2",
            template="meta-llama-Llama-3.2-3B-Instruct.jinja",
            specials=LLAMA3_SPECIALS,
            eos="<|eot_id|>",
            eos_token_ids=(128001, 128008, 128009),
            **_LLAMA,
        ),
        # GUESS: stop ids. Hermes 3 ends turns with <|im_end|>; 128001 kept as Llama 3's end of text.
        Family(
            "hermes3",
            template="NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
            specials=HERMES3_SPECIALS,
            eos="<|im_end|>",
            eos_token_ids=(HERMES3_IM_END, 128001),
            notes="Hermes' ChatML/tool token ids are guesses (reserved slots from 128011)",
            **_LLAMA,
        ),
        # DeepSeek-V3 through SGLang's tool template (DeepSeek-V3's own HF template has no tools
        # section); the vocabulary has V3.1's four tokens at 128796-128799 (V3: placeholders). The
        # template tojson-encodes the first call's arguments and concatenates later ones (a string).
        Family("deepseek-v3", template="deepseek-v3-sglang-tool.jinja", notes="stand-in ranks", **_DEEPSEEK),
        Family(
            "deepseek-v3.1",
            template="deepseek-ai-DeepSeek-V3.1-hf.jinja",
            arguments="str",
            notes="stand-in ranks",
            **_DEEPSEEK,
        ),
        # GLM's assistant turn has no closing token: it stops on the next role token.
        Family(
            "glm4.6",
            vocab="glm",
            template="GLM-4.6.jinja",
            specials=GLM_SPECIALS,
            eos="<|endoftext|>",
            pad="<|endoftext|>",
            eos_token_ids=(151329, 151336, 151338),
            config_vocab_size=151552,
            notes="stand-in ranks",
        ),
    ]
}

# --- tokenizers --------------------------------------------------------------------------------------


def _rank_file(ranks: str) -> str:
    if ranks == "qwen":
        return str(importlib.resources.files("dashscope") / "resources" / "qwen.tiktoken")
    if ranks == "llama3":
        return str(importlib.resources.files("llama_models") / "llama3" / "tokenizer.model")
    raise ValueError(f"unknown ranks {ranks!r}")


@functools.cache
def _vocab_and_merges(ranks: str) -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Byte-level vocabulary (token -> rank) and merges (in priority order) of a tiktoken rank file."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = _rank_file(ranks)
    vocab, merges = TikTokenConverter(vocab_file=path).extract_vocab_merges_from_model(path)
    return vocab, tuple(merges)


@functools.cache
def _base_tokenizer_json(vocab_name: str, low_specials: tuple[tuple[int, str], ...]) -> str:
    """tokenizer.json text of a vocabulary without added tokens (model, normalizer, pre-tokenizer,
    decoder); `low_specials` are added tokens whose ids come before the ordinary ids (DeepSeek's 0-2),
    which must be in the model's vocabulary to get those ids. Cached: building costs seconds."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    v = VOCABULARIES[vocab_name]
    ranks, merges = _vocab_and_merges(v.ranks)
    vocab = {tok: rank + v.first_id for tok, rank in ranks.items() if rank < v.n_ranks}
    kept = [m for m in merges if ranks[m[0] + m[1]] < v.n_ranks]
    for i, content in low_specials:
        if i >= v.first_id:
            raise ValueError(f"{content!r} at {i} collides with ordinary ids of {vocab_name}")
        vocab[content] = i
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise AssertionError(f"{vocab_name}: ordinary ids are not contiguous")
    tok = Tokenizer(models.BPE(vocab, kept, fuse_unk=False, ignore_merges=v.ignore_merges))
    if v.nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(v.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def build_tokenizer(family: Family | str):
    """The family's `tokenizers.Tokenizer`: ordinary ids, then every added token at its real id."""
    from tokenizers import AddedToken, Tokenizer, processors

    f = FAMILIES[family] if isinstance(family, str) else family
    v = VOCABULARIES[f.vocab]
    low = tuple((i, c) for i, c, _ in sorted(f.specials) if i < v.first_id)
    tok = Tokenizer.from_str(_base_tokenizer_json(f.vocab, low))
    for i, content, special in sorted(f.specials):
        if i >= v.first_id and i != tok.get_vocab_size(with_added_tokens=True):
            raise ValueError(f"{f.name}: {content!r} wants id {i}, next free id is {tok.get_vocab_size(True)}")
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
        if tok.token_to_id(content) != i:
            raise AssertionError(f"{f.name}: {content!r} got id {tok.token_to_id(content)}, wanted {i}")
    post = [processors.ByteLevel(trim_offsets=False)]
    if f.add_bos:
        if f.bos is None:
            raise ValueError(f"{f.name}: add_bos without a bos token")
        post.append(
            processors.TemplateProcessing(
                single=f"{f.bos}:0 $A:0",
                pair=f"{f.bos}:0 $A:0 {f.bos}:1 $B:1",
                special_tokens=[(f.bos, f.bos_token_id)],
            )
        )
    tok.post_processor = post[0] if len(post) == 1 else processors.Sequence(post)
    return tok


def tokenizer_config(family: Family | str) -> dict:
    """tokenizer_config.json in the classic format (read by transformers 4 and 5 alike)."""
    f = FAMILIES[family] if isinstance(family, str) else family
    named = {f.bos, f.eos, f.pad} - {None}
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": c,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, c, s in sorted(f.specials)
        },
        # So that `all_special_ids` is exactly the set of added tokens flagged special.
        "additional_special_tokens": [c for _, c, s in sorted(f.specials) if s and c not in named],
        "bos_token": f.bos,
        "eos_token": f.eos,
        "pad_token": f.pad,
        "unk_token": None,
        "clean_up_tokenization_spaces": f.clean_up_tokenization_spaces,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": NETWORK["max_position_embeddings"],
        "tokenizer_class": f.tokenizer_class,
        "chat_template": (TEMPLATES / f.template).read_text(encoding="utf-8"),
    }


# --- model directories -------------------------------------------------------------------------------


def model_config(family: Family | str):
    from transformers import LlamaConfig

    f = FAMILIES[family] if isinstance(family, str) else family
    if f.config_vocab_size < f.tokenizer_size:
        raise ValueError(f"{f.name}: config vocab {f.config_vocab_size} < tokenizer size {f.tokenizer_size}")
    return LlamaConfig(
        **NETWORK,
        vocab_size=f.config_vocab_size,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        dtype="float32",
        bos_token_id=f.bos_token_id,
        eos_token_id=list(f.eos_token_ids),
        pad_token_id=f.pad_token_id,
    )


def build_family(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A model dir for the family: config.json, generation_config.json, model.safetensors (random
    stand-in network, reproducible from `seed`), tokenizer.json and tokenizer_config.json (with the
    chat template)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; known: {sorted(FAMILIES)}")
    f = FAMILIES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = model_config(f)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=f.bos_token_id, eos_token_id=list(f.eos_token_ids), pad_token_id=f.pad_token_id
    )
    model.save_pretrained(out)
    build_tokenizer(f).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(f), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return out


# --- fitting -----------------------------------------------------------------------------------------


def _check_sequences(sequences: list[tuple[list[int], list[int]]], vocab_size: int) -> dict[tuple[int, int], int]:
    """Validate and return {(sequence, position): target}; raise on contradicting targets."""
    targets: dict[tuple[int, int], int] = {}
    trie: dict = {}  # a prefix trie over all sequences; a node's "target" is what must follow it
    for s, (ids, mask) in enumerate(sequences):
        ids, mask = list(ids), list(mask)
        if len(ids) != len(mask):
            raise ValueError(f"sequence {s}: {len(ids)} ids but {len(mask)} mask values")
        if any(m not in (0, 1) for m in mask):
            raise ValueError(f"sequence {s}: mask values must be 0 or 1")
        if mask and mask[0]:
            raise ValueError(f"sequence {s}: position 0 has nothing before it to predict from; mask it 0")
        if any(not 0 <= i < vocab_size for i in ids):
            raise ValueError(f"sequence {s}: ids must be in [0, {vocab_size})")
        node = trie
        for t, (i, m) in enumerate(zip(ids, mask)):
            if m:
                seen = node.get("target")
                if seen is not None and seen[0] != i:
                    raise ValueError(
                        f"conflicting targets: sequence {s} wants {i} at position {t}, but sequence {seen[1]} "
                        f"wants {seen[0]} after the same {t} ids (a model cannot continue one context two ways)"
                    )
                node["target"] = (i, s)
                targets[(s, t)] = i
            node = node.setdefault(i, {})
    if not targets:
        raise ValueError("no mask-1 positions: nothing to fit")
    return targets


def fit(model_dirs: list[Path], sequences: list[tuple[list[int], list[int]]], max_steps: int = 500) -> None:
    """Train the (shared) weights until greedy decoding reproduces every target token of every
    sequence, then write the fitted weights into every dir in model_dirs (one file, hard-linked).

    sequences: (token ids, loss mask) pairs; mask 1 marks ids the model must predict (each from the
    ids before it). Sequences sharing a context but wanting different continuations raise ValueError;
    not getting there in `max_steps` raises RuntimeError. Starts from the weights in model_dirs[0].

    How it is fast on a CPU with a 150k vocabulary: every lm_head row of a token that is not a target
    is set to zero, and only the embedding rows of tokens in the inputs, the lm_head rows of the
    targets, the transformer layers and the final norm are trained, on compact copies. With the other
    rows exactly zero the full-vocabulary cross-entropy is exact and cheap: log Z = logaddexp(
    logsumexp(target-row logits), log(V - K)). A plain full forward pass of the saved HF model then
    checks that the argmax at every mask-1 position is its target.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    dirs = [Path(d) for d in model_dirs]
    if not dirs:
        raise ValueError("model_dirs is empty")
    shapes = set()
    for d in dirs:
        c = AutoConfig.from_pretrained(d)
        shapes.add(
            (
                c.model_type,
                c.vocab_size,
                c.hidden_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.intermediate_size,
                c.tie_word_embeddings,
            )
        )
    if len(shapes) != 1:
        raise ValueError(f"model dirs must share one architecture and vocab_size to share weights: {shapes}")
    vocab_size = shapes.pop()[1]
    targets = _check_sequences(sequences, vocab_size)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32)
            if model.config.tie_word_embeddings:
                raise ValueError("fit needs an untied lm_head (tie_word_embeddings=False)")
            rows, row_targets = _training_rows(sequences, targets)
            _train(model, rows, row_targets, max_steps)
        _verify(model, sequences, targets)
        # One fitted file, linked into every dir (a real file each, so from_pretrained works).
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        fd, tmp = tempfile.mkstemp(dir=dirs[0], suffix=".safetensors.tmp")
        os.close(fd)
        save_file(state, tmp, metadata={"format": "pt"})
        os.replace(tmp, dirs[0] / "model.safetensors")  # new inode: old links elsewhere stay as they were
        for d in dirs[1:]:
            dst = d / "model.safetensors"
            if dst.exists() and os.path.samefile(dst, dirs[0] / "model.safetensors"):
                continue
            tmp = d / "model.safetensors.tmp"
            tmp.unlink(missing_ok=True)
            try:
                os.link(dirs[0] / "model.safetensors", tmp)
            except OSError:  # another file system
                shutil.copyfile(dirs[0] / "model.safetensors", tmp)
            os.replace(tmp, dst)
        reloaded = AutoModelForCausalLM.from_pretrained(dirs[-1], dtype=torch.float32)
        _verify(reloaded, sequences, targets)
    finally:
        torch.set_num_threads(threads)


def _training_rows(
    sequences: list[tuple[list[int], list[int]]], targets: dict[tuple[int, int], int]
) -> tuple[list[list[int]], dict[tuple[int, int], int]]:
    """What to train on: each sequence cut after its last target (a causal model's later ids do not
    change earlier predictions), and a sequence that is a prefix of another folded into it (a
    multi-turn record usually contains the previous turn's). Returns (rows, {(row, pos): target})."""
    cut: dict[int, int] = {}
    for s, t in targets:
        cut[s] = max(cut.get(s, 0), t + 1)
    seqs = {s: list(sequences[s][0][:n]) for s, n in cut.items()}
    kept: list[int] = []
    host: dict[int, int] = {}
    for s in sorted(seqs, key=lambda q: (-len(seqs[q]), q)):
        host[s] = next((k for k in kept if seqs[k][: len(seqs[s])] == seqs[s]), s)
        if host[s] == s:
            kept.append(s)
    row_of = {k: r for r, k in enumerate(kept)}
    return [seqs[k] for k in kept], {(row_of[host[s]], t): i for (s, t), i in targets.items()}


def _train(model, rows: list[list[int]], targets: dict[tuple[int, int], int], max_steps: int) -> None:
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    vocab_size = head.shape[0]
    inputs = sorted({i for ids in rows for i in ids})
    outs = sorted(set(targets.values()))
    in_index = {t: k for k, t in enumerate(inputs)}
    out_index = {t: k for k, t in enumerate(outs)}
    n, length = len(rows), max(len(ids) for ids in rows)
    x = torch.zeros(n, length, dtype=torch.long)  # right padding: causal attention never looks ahead
    for s, ids in enumerate(rows):
        x[s, : len(ids)] = torch.tensor([in_index[i] for i in ids])
    rows = torch.tensor([s for s, _ in targets])
    cols = torch.tensor([t - 1 for _, t in targets])  # logits at t-1 predict the id at t
    y = torch.tensor([out_index[i] for i in targets.values()])

    compact_emb = torch.nn.Parameter(emb.detach()[inputs].clone())
    compact_head = torch.nn.Parameter(head.detach()[outs].clone())
    body = list(model.model.layers.parameters()) + list(model.model.norm.parameters())
    opt = torch.optim.Adam([compact_emb, compact_head, *body], lr=1e-2)
    log_rest = torch.log(torch.tensor(float(vocab_size - len(outs)))) if vocab_size > len(outs) else None
    model.train()
    for _ in range(max_steps):
        hidden = model.model(inputs_embeds=compact_emb[x], use_cache=False).last_hidden_state
        logits = hidden[rows, cols] @ compact_head.T  # (targets, K)
        log_z = torch.logsumexp(logits, dim=-1)
        if log_rest is not None:
            log_z = torch.logaddexp(log_z, log_rest)
        picked = logits.gather(1, y[:, None])[:, 0]
        losses = log_z - picked
        with torch.no_grad():
            others = logits.scatter(1, y[:, None], float("-inf")).max(dim=-1).values
            if log_rest is not None:
                others = others.clamp(min=0.0)  # the zeroed rows score 0
            done = bool((picked - others > 1.0).all()) and losses.mean().item() < 0.01
        if done:
            break
        opt.zero_grad(set_to_none=True)
        losses.mean().backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        emb[inputs] = compact_emb.detach()
        head.zero_()
        head[outs] = compact_head.detach()


@torch.no_grad()
def _verify(model, sequences, targets: dict[tuple[int, int], int]) -> None:
    """Plain HF forward passes: the argmax over the whole vocabulary at every mask-1 position."""
    model.eval()
    wrong = []
    for s, (ids, _) in enumerate(sequences):
        positions = [t for (q, t) in targets if q == s]
        if not positions:
            continue
        keep = torch.tensor([t - 1 for t in positions])
        logits = model(input_ids=torch.tensor([list(ids)]), logits_to_keep=keep, use_cache=False).logits[0]
        for t, got in zip(positions, logits.argmax(-1).tolist()):
            if got != targets[(s, t)]:
                wrong.append((s, t, targets[(s, t)], got))
    if wrong:
        raise RuntimeError(
            f"fit did not reach greedy reproduction: {len(wrong)} of {len(targets)} target tokens wrong "
            f"(sequence, position, want, got): {wrong[:10]}; raise max_steps or shorten the sequences"
        )
