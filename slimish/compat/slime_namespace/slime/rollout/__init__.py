"""slime.rollout as slimish provides it: `sglang_rollout` (GenerateState, generate, generate_and_rm...),
`rm_hub` (async_rm and slime's rm types) and `filter_hub`."""
