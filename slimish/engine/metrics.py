"""Prometheus metrics of the built-in engine under SGLang's names and labels, so dashboards and
SGLang's own clients (`bench_one_batch_server` sums `sglang:cached_tokens_total{...}`) read both.

As in SGLang, the scheduler's gauges carry `model_name`, `engine_type` and the parallel ranks;
the request counters carry `model_name` and `engine_type`, with `is_streaming` or
`cache_source` where SGLang adds them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from slimish.engine.scheduler import Scheduler, Sequence

REQUEST_LABELS = ("model_name", "engine_type")
SCHEDULER_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.labels = {"model_name": model_name, "engine_type": "unified"}
        ranks = {**self.labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        streaming = (*REQUEST_LABELS, "is_streaming")

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, SCHEDULER_LABELS, registry=r, multiprocess_mode="mostrecent").labels(**ranks)

        self.prompt_tokens = Counter("sglang:prompt_tokens", "Prompt tokens processed", streaming, registry=r)
        self.generation_tokens = Counter("sglang:generation_tokens", "Tokens generated", streaming, registry=r)
        self.requests = Counter("sglang:num_requests", "Requests finished", streaming, registry=r)
        self.aborted = Counter("sglang:num_aborted_requests", "Requests aborted", REQUEST_LABELS, registry=r).labels(
            **self.labels
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens",
            "Prompt tokens served from the prefix cache",
            (*REQUEST_LABELS, "cache_source"),
            registry=r,
        )
        self.cached_total = self.cached_tokens.labels(**self.labels, cache_source="total")
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Request latency",
            streaming,
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.running = gauge("sglang:num_running_reqs", "Requests in the running batch")
        self.queued = gauge("sglang:num_queue_reqs", "Requests waiting")
        self.throughput = gauge("sglang:gen_throughput", "Decode tokens/s of the last step")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Share of prompt tokens served from the prefix cache")
        self._prompt_seen = self._cached_seen = 0

    def finished(self, reqs: list[Sequence], stream: bool) -> None:
        labels = {**self.labels, "is_streaming": str(stream).lower()}
        for r in reqs:
            self.prompt_tokens.labels(**labels).inc(len(r.input_ids))
            self.cached_total.inc(r.cached_tokens)
            self._prompt_seen += len(r.input_ids)
            self._cached_seen += r.cached_tokens
            self.generation_tokens.labels(**labels).inc(len(r.output_ids))
            self.requests.labels(**labels).inc()
            if r.finish_reason and r.finish_reason["type"] == "abort":
                self.aborted.inc()
            if r.finished_at:
                self.e2e.labels(**labels).observe(r.finished_at - r.created)

    def render(self, s: Scheduler) -> bytes:
        self.running.set(len(s.running))
        self.queued.set(len(s.waiting))
        self.throughput.set(s.last_gen_throughput)
        self.cache_hit_rate.set(self._cached_seen / max(self._prompt_seen, 1))
        return generate_latest(self.registry)
