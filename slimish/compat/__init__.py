"""Adapters that run functions written for other RL frameworks unchanged (`slimish.compat.slime`)."""
