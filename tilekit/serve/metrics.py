"""The server's Prometheus metrics (prometheus-client, a registry of its own): the engine's state read at each
scrape (running and waiting requests, KV blocks, the prefix cache's hit rate, preemptions) and, per request,
histograms of time to first token, inter-token latency, end-to-end latency and queue time, token counters and
finished requests by reason. Names follow vLLM's (tilekit: prefix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineState:
    """A collector that reads the engine's stats() when scraped."""

    def __init__(self, stats, model: str):
        self.stats, self.model = stats, model

    def collect(self):
        s = self.stats()
        for name, doc, value in (
                ("num_requests_running", "Requests running in the engine.", s["running"]),
                ("num_requests_waiting", "Requests waiting to run (the engine's queue and its inbox).", s["waiting"]),
                ("kv_blocks_used", "KV-cache blocks held by requests.", s["blocks_used"]),
                ("kv_blocks_total", "KV-cache blocks in the pool.", s["blocks_total"]),
                ("kv_cache_usage_perc", "Fraction of the KV-cache blocks held.",
                 s["blocks_used"] / max(1, s["blocks_total"])),
                ("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache over prompt tokens looked up.",
                 s["prefix_hit_rate"]),
                ("num_preemptions", "Requests preempted (recomputed later) since the start.", s["preemptions"])):
            family = GaugeMetricFamily(f"tilekit:{name}", doc, labels=["model_name"])
            family.add_metric([self.model], value)
            yield family


class Metrics:
    def __init__(self, stats, model: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(stats, model))
        self.model = model

        def histogram(name, doc):
            return Histogram(f"tilekit:{name}", doc, ["model_name"], registry=self.registry,
                             buckets=LATENCY_BUCKETS).labels(model)
        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's arrival to its first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's consecutive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's arrival to its last token.")
        self.queue = histogram("request_queue_time_seconds", "Time a request waited before it first ran.")
        self.prompt_tokens = Counter("tilekit:prompt_tokens", "Prompt tokens of finished requests.", ["model_name"],
                                     registry=self.registry).labels(model)
        self.generation_tokens = Counter("tilekit:generation_tokens", "Tokens generated.", ["model_name"],
                                         registry=self.registry).labels(model)
        self.finished = Counter("tilekit:request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
