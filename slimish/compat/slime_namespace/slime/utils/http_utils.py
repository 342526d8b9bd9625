"""slime.utils.http_utils: `post` and `get`, run by slimish (slimish.compat.slime.calls.post): requests to
the router carry the sample's routing key and the router's API key, and `/generate` replies are
recorded for the sample being generated."""

from slimish.compat.slime.calls import get, post


def init_http_client(args=None) -> None:
    """slime sets up its HTTP client here; slimish's is the run's own, so there is nothing to do."""


__all__ = ["get", "init_http_client", "post"]
