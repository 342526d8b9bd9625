"""slime.rollout.filter_hub: `base_types.DynamicFilterOutput` and `dynamic_sampling_filters`."""
