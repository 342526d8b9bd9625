"""Schemathesis fuzzing of a server from its own `/openapi.json`, shared by tests/test_fuzz.py
(engine, router) and tests/test_fuzz_gateway.py (the gateway's three protocols).

`derandomize` makes every run send the same cases, so a failure reproduces; the assertion message
carries the case as a curl command."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

BOTH = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
# An operation: (method, path) -> (how many cases per mode, which modes).
Operations = Mapping[tuple[str, str], tuple[int, tuple[GenerationMode, ...]]]


def fuzz(
    url: str,
    operations: Operations,
    prefix: str = "",
    headers: dict[str, str] | None = None,
    cases_for: Callable[[str, GenerationMode, st.SearchStrategy], st.SearchStrategy] | None = None,
) -> int:
    """Send every operation's cases (paths under `prefix`), each answered without a 5xx and, when
    JSON, parseable; returns how many requests went out. `cases_for(path, mode, cases)` may
    replace an operation's strategy (e.g. to make some bodies real conversations)."""
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    sent = 0
    for (method, path), (examples, modes) in operations.items():
        operation = schema[prefix + path][method]
        for mode in modes:
            cases = operation.as_strategy(generation_mode=mode)
            if cases_for is not None:
                cases = cases_for(path, mode, cases)

            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=cases)
            def one(case: schemathesis.Case) -> None:
                nonlocal sent
                sent += 1
                r = case.call(base_url=url, timeout=60, headers=headers)
                assert r.status_code < 500, (
                    f"{case.method} {case.path} -> {r.status_code}: {r.text[:500]}\n{case.as_curl_command()}"
                )
                if "application/json" in r.headers.get("content-type", [""])[0]:
                    r.json()

            one()
    return sent
