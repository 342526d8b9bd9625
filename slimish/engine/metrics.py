"""Prometheus metrics of the built-in engine, under SGLang's names so dashboards read both."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slimish.engine.scheduler import Request, Scheduler


class Metrics:
    """Prometheus metrics under SGLang's names, so existing dashboards read this engine too."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("sglang:num_requests", "Requests finished", registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Requests aborted", registry=r)
        self.running = Gauge("sglang:num_running_reqs", "Requests in the running batch", registry=r)
        self.queued = Gauge("sglang:num_queue_reqs", "Requests waiting", registry=r)
        self.throughput = Gauge("sglang:gen_throughput", "Decode tokens/s of the last step", registry=r)
        self.e2e = Histogram("sglang:e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))  # fmt: skip

    def finished(self, reqs: list[Request]) -> None:
        for r in reqs:
            self.prompt_tokens.inc(len(r.input_ids))
            self.generation_tokens.inc(len(r.output_ids))
            self.requests.inc()
            if r.finish_reason and r.finish_reason["type"] == "abort":
                self.aborted.inc()
            if r.finished_at:
                self.e2e.observe(r.finished_at - r.created)

    def render(self, s: Scheduler) -> bytes:
        self.running.set(len(s.running))
        self.queued.set(len(s.waiting))
        self.throughput.set(s.last_gen_throughput)
        return generate_latest(self.registry)
