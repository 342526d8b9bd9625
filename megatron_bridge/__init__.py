"""HF <-> Megatron-Core for slimish: model config, weight layout per model family, and the CPU layer.

Modules, one job each:
    cpu       `apply()`: the narrow patches that let Megatron-Core 0.16.1 run without CUDA
    config    HF config -> `BridgeConfig` -> TransformerConfig / layer spec / GPTModel kwargs
    weights   pure HF <-> Megatron shard math, and `export_hf`, the TP/EP-gathering weight iterator
    model     `build_model` / `load_hf_weights` / `load_model` for the current parallel state
    logprobs  `vocab_parallel_logprobs`: per-token log p(target) from vocab-parallel logits
    hf_io     lazy safetensors reading and writing
    convert   `slimish convert hf-to-megatron | megatron-to-hf`

Two facts about GPTModel that callers need. Its RoPE ignores `position_ids` (positions are 0..S-1),
so batches must be right-padded. Its logits have `BridgeConfig.padded_vocab_size(tp)` columns,
split over TP, and the padded columns are 0, not -inf.
"""
