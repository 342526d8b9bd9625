"""slime.utils.processing_utils: the tokenizer (slimish's own inside a rollout) and processor helpers.

slimish trains text models: `load_processor` gives None, so slime code takes its text path.
"""

from __future__ import annotations

from typing import Any

from slimish.compat.slime.calls import current_context


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    """The run's tokenizer when called inside a slime function run by slimish for that model,
    else `AutoTokenizer.from_pretrained(name_or_path, **kwargs)`."""
    ctx = current_context()
    if ctx is not None and str(ctx.config.model) == str(name_or_path):
        return ctx.tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> None:
    """None: slimish has no multimodal processor."""
    return None


def build_processor_kwargs(multimodal_inputs: dict | None = None) -> dict:
    """A processor's keyword arguments for a sample's `multimodal_inputs`: its entries, with text
    ids returned as lists (`text_kwargs`) and each modality's outputs as tensors."""
    kwargs = dict(multimodal_inputs or {})
    kwargs["text_kwargs"] = {**kwargs.get("text_kwargs", {}), "return_tensors": None, "return_mm_token_type_ids": False}
    for modality in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        kwargs[modality] = {**kwargs.get(modality, {}), "return_tensors": "pt"}
    return kwargs


def encode_image_for_rollout_engine(image: Any) -> str:
    raise NotImplementedError("slimish trains text models: images cannot be sent to its engines")


__all__ = ["build_processor_kwargs", "encode_image_for_rollout_engine", "load_processor", "load_tokenizer"]
