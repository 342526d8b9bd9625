"""What the engine's, the router's and the Tinker API's HTTP servers share: OpenAPI request
bodies, a warning when one listens beyond loopback with no key, and serving on a launcher's socket.

Their routes read raw bodies (to answer in SGLang's error shapes, with strict types), so FastAPI
cannot see the request models; `document_bodies` puts them into `/openapi.json`, for clients and
for the schema-driven fuzz tests (tests/test_fuzz.py).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

log = logging.getLogger(__name__)


def add_request_bodies(doc: dict[str, Any], bodies: dict[str, type[BaseModel]]) -> dict[str, Any]:
    """`doc` with a JSON request body on every POST/PUT of each path (a POST where the path is
    served outside FastAPI's routes); the models' shared definitions go to components."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    paths = doc.setdefault("paths", {})
    for path, model in bodies.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        ops = paths.setdefault(path, {"post": {"summary": path, "responses": {"200": {"description": "OK"}}}})
        for method in ("post", "put"):
            if method in ops:
                ops[method]["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return doc


def document_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve `add_request_bodies` of the app's generated schema as its `/openapi.json`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = add_request_bodies(doc, bodies)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def load_json(raw: bytes) -> Any:
    """`json.loads`, refusing lone UTF-16 surrogates (`"\ud800"`): valid JSON escapes, but no
    UTF-8 exists for them, so a prompt or an echoed field holding one fails later, as a 500."""
    data = json.loads(raw)
    if b"\\ud" in raw.lower():  # only then can there be one: check by encoding
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"a string holds a lone surrogate {exc.object[exc.start : exc.end]!r}, which is not valid Unicode"
            ) from None
    return data


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(server: str, host: str, api_key: str | None) -> None:
    """Listening beyond loopback is allowed (clusters need it), but not silently without a key."""
    if not is_loopback(host) and api_key is None:
        log.warning(
            "%s listens on %s with no --api-key: anyone who can reach this port can generate, "
            "pause generation and replace the weights",
            server,
            host,
        )


def run_uvicorn(app: Any, host: str, port: int, fd: int | None, log_level: str) -> int:
    """Serve `app` on host:port, or on the inherited listening socket `fd` (a launcher's:
    slimish/processes.py), until SIGTERM or Ctrl-C. 1 where it could not start, as `uvicorn.run`.
    uvicorn is imported here: the router, the gateway and the rollout import this module too, and
    serve without it."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False))
    server.run(sockets=None if fd is None else [socket.socket(fileno=fd)])
    return 0 if server.started else 1
