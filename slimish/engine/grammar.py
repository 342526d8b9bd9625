"""Constrained decoding (`regex`, `json_schema`, `ebnf`, `structural_tag`) with xgrammar, the
library SGLang uses by default, so a grammar means the same here as there.

One compiler per engine caches compiled grammars by their text (an agent sends the same tool
schema every turn); each sequence gets its own matcher, which the sampler asks for a token mask
and the scheduler feeds every token the row emits.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

import torch

from slimish.protocol import GRAMMAR_FIELDS, SamplingParams

if TYPE_CHECKING:  # xgrammar takes a second to import: only engines that get a grammar pay it
    import xgrammar


class GrammarError(ValueError):
    """A grammar SGLang would refuse, in SGLang's words, after the field's name."""


def grammar_field(params: SamplingParams) -> str | None:
    """The one constrained-decoding field set, None for free generation; two set is an error
    (SGLang refuses that too)."""
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise GrammarError(
            f"sampling_params.{given[1]}: Only one of json_schema, regex, ebnf, or structural_tag can be set (got {' and '.join(given)})."
        )
    return given[0] if given else None


class Grammars:
    """Compiles a request's grammar, once per distinct text."""

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.end_ids = tokenizer, vocab_size, sorted(end_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None

    @property
    def compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.end_ids
            )
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        return self._compiler

    def compile(self, params: SamplingParams) -> xgrammar.CompiledGrammar | None:
        field = grammar_field(params)
        if field is None:
            return None
        text = getattr(params, field)
        kind = "json" if field == "json_schema" else field
        if "\x00" in text:  # as SGLang: the C++ side reads C strings
            raise GrammarError(f"sampling_params.{field}: Invalid {kind}: NUL bytes (\\u0000) are not allowed")
        try:
            if field == "json_schema":
                return self.compiler.compile_json_schema(text)
            if field == "regex":
                return self.compiler.compile_regex(text)
            if field == "ebnf":
                return self.compiler.compile_grammar(text)
            return self.compiler.compile_structural_tag(_structural_tag(text))
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError or its own errors
            raise GrammarError(f"sampling_params.{field}: Failed to compile {kind} grammar: {_reason(exc)}") from None


def matcher(compiled: xgrammar.CompiledGrammar | None) -> xgrammar.GrammarMatcher | None:
    """A sequence's own matcher of a compiled grammar (None: free generation)."""
    if compiled is None:
        return None
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ log prefix (`[04:57:12] /project/cpp/x.cc:83: `)."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(exc).__name__


def _structural_tag(text: str) -> str:
    """SGLang accepts xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`) and
    the older `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`."""
    import xgrammar

    tag = json.loads(text)
    if not isinstance(tag, dict) or "structures" not in tag:
        return text
    items = [
        xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return xgrammar.StructuralTag.from_legacy_structural_tag(items, tag.get("triggers", [])).model_dump_json()


def mask_logits(logits: torch.Tensor, matchers: list[Any]) -> None:
    """In place: -inf for every token row i's grammar does not allow next (rows without one: none)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(matchers), logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
