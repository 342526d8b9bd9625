"""slime.rollout as slimish provides it: `sglang_rollout` (GenerateState, generate) and `filter_hub`."""
