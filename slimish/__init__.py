"""slimish: a server-based RL engine for post-training LLMs and LLM agents."""

__version__ = "0.1.0"
