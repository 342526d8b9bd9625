"""The example task of `rollout_plugins/cli_harness.py`: a standalone file-editing agent (`agent.py`,
which imports nothing of slimish) and its task and checker (`task.py`)."""
