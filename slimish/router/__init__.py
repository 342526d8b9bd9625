"""The slimish router: a load-balancing gateway in front of SGLang-protocol engines.

`config` holds the settings, `workers` the registry and health checks, `policy` the routing
policies, `gate` the per-request checks, `proxy` the forwarding, `app` the HTTP routes and CLI;
`wire` is its HTTP/1.1 server and `upstream` its client to the workers on the serving path;
`scaleout` and `shared` make N processes one router.
"""

from slimish.router.app import create_app
from slimish.config import RouterConfig

__all__ = ["RouterConfig", "create_app"]
