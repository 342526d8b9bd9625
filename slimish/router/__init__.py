"""The slimish router: a load-balancing gateway in front of SGLang-protocol engines.

`config` holds the settings, `workers` the registry and health checks, `policy` the routing
policies, `gate` the per-request checks, `proxy` the forwarding, `app` the HTTP routes, `cli` the
`slimish router` command; `wire` is its HTTP/1.1 server and `upstream` its client to the workers
on the serving path; `scaleout` and `shared` make N processes one router.

Nothing is re-exported here: importing one module of the package loads only what that module needs.
"""
