"""slime.utils as slimish provides it: `types` (Sample, RolloutBatch, ParamInfo), `http_utils` (post, get),
`misc` (load_function), `processing_utils` (load_tokenizer, build_processor_kwargs)."""
