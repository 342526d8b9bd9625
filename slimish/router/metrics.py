"""Prometheus metrics of one router app, in a registry of its own (several apps, one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from slimish.router.workers import WorkerRegistry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class _WorkerGauges:
    """In-flight and health per worker, read from the registry at scrape time (no hot-path cost)."""

    def __init__(self, workers: WorkerRegistry) -> None:
        self.workers = workers

    def collect(self):
        inflight = GaugeMetricFamily("slimish_router_worker_inflight", "Open requests per worker", labels=["worker"])
        healthy = GaugeMetricFamily("slimish_router_worker_healthy", "1 if the worker takes traffic", labels=["worker"])
        for w in self.workers.all():
            inflight.add_metric([w.url], w.inflight)
            healthy.add_metric([w.url], float(w.healthy))
        yield inflight
        yield healthy


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "slimish_router_requests", "Requests answered, by route and status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "slimish_router_request_duration_seconds",
            "Time from request to the last byte of the reply",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream = Counter(
            "slimish_router_upstream_requests", "Requests sent to each worker", ["worker"], registry=r
        )
        self.retries = Counter(
            "slimish_router_retries", "Requests retried after this worker failed", ["worker"], registry=r
        )
        self.errors = Counter(
            "slimish_router_upstream_errors", "Upstream failures by worker and cause", ["worker", "cause"], registry=r
        )
        r.register(_WorkerGauges(workers))
        self._children: dict[tuple, tuple] = {}  # labels() looked up once: it is on the hot path

    def observe(self, route: str, status: int, seconds: float) -> None:
        key = (route, status)
        if (children := self._children.get(key)) is None:
            children = self._children[key] = (self.requests.labels(route, str(status)), self.latency.labels(route))
        children[0].inc()
        children[1].observe(seconds)

    def sent(self, worker: str) -> None:
        if (child := self._children.get(worker)) is None:
            child = self._children[worker] = self.upstream.labels(worker)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
