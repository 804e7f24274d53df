"""Prometheus metrics of every process, aggregated by the web workers' /metrics.

prometheus-client's multiprocess mode: each process writes its samples to files in
<run dir>/metrics, and /metrics merges them. PROMETHEUS_MULTIPROC_DIR must be set before
prometheus_client is imported, so metrics are created by init(), never at import; before
init() (unit tests of one layer) every metric is a no-op.
"""
from __future__ import annotations

import os

STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400)


class _Noop:
    def labels(self, *a, **k):
        return self

    def inc(self, *a):
        pass

    def observe(self, *a):
        pass

    def set(self, *a):
        pass


class Metrics:
    def __init__(self):
        from prometheus_client import Counter, Gauge, Histogram
        # web
        self.http_requests = Counter("ricordo_http_requests", "HTTP requests by endpoint and status",
                                     ["endpoint", "method", "status"])
        # renderer
        self.prompt_tokens = Counter("ricordo_prompt_tokens", "prompt tokens of finished requests")
        self.cached_tokens = Counter("ricordo_cached_tokens", "prompt tokens reused from the live session or disk")
        self.generated_tokens = Counter("ricordo_generated_tokens", "tokens generated")
        self.lookups = Counter("ricordo_cache_lookups", "cache decisions by outcome (live, disk, miss) and miss reason",
                               ["outcome", "reason"])
        self.ttft = Histogram("ricordo_time_to_first_token_seconds", "from admission to the first token",
                              buckets=LATENCY_BUCKETS)
        self.first_token_stage = Histogram(
            "ricordo_first_token_stage_seconds", "where the time to the first token went: web (HTTP body to "
            "the renderer), render (template, tokens), queue (waiting for a slot), wait (sent to inference "
            "until it began), place (its session restored, copied or cut), prefill, sample (until the first "
            "token was sent), back (to the renderer)", ["stage"], buckets=STAGE_BUCKETS)
        self.tool_calls = Counter("ricordo_tool_calls_rendered", "assistant tool calls by how they were rendered",
                                  ["how"])
        # inference
        self.restore_seconds = Histogram("ricordo_restore_seconds", "checkpoint restore time", buckets=LATENCY_BUCKETS)
        self.bytes_read = Counter("ricordo_cache_bytes_read", "checkpoint bytes read on restore")
        self.prefill_rate = Histogram("ricordo_prefill_tokens_per_second", "prefill speed per request",
                                      buckets=RATE_BUCKETS)
        self.decode_rate = Histogram("ricordo_decode_tokens_per_second", "decode speed per request",
                                     buckets=RATE_BUCKETS)
        self.live_tokens = Gauge("ricordo_live_session_tokens", "tokens in the resident KV sessions",
                                 multiprocess_mode="livesum")
        self.batch_size = Histogram("ricordo_decode_batch_size", "sequences advanced by one decode step",
                                    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
        self.busy = Counter("ricordo_inference_busy_seconds", "seconds the inference loop spent prefilling "
                            "chunks and running decode steps", ["phase"])
        self.drafted = Counter("ricordo_draft_tokens", "tokens drafted by prompt lookup (--draft-lookup) and "
                               "checked in a decode step")
        self.draft_kept = Counter("ricordo_draft_tokens_kept", "drafted tokens that were what the model wrote")
        self.shared_rows = Counter("ricordo_decode_shared_rows",
                                   "K/V rows a batched decode step read once for two sequences or more "
                                   "(each sharing sequence's rows counted once a step)")
        self.decode_threads = Gauge("ricordo_decode_threads", "CPU threads decode steps run on now (--adapt-threads "
                                    "moves it below --threads while that is faster)", multiprocess_mode="livesum")
        self.thread_probes = Counter("ricordo_decode_thread_probes", "probes of another decode thread count, by "
                                     "outcome (kept: the current count was faster; switched; no idle core: "
                                     "more threads not tried, the machine had no idle CPU for them)", ["outcome"])
        self.live_sessions = Gauge("ricordo_live_sessions", "KV sessions resident in memory",
                                   multiprocess_mode="livesum")
        self.resident_bytes = Gauge("ricordo_resident_kv_bytes", "K/V bytes of the resident sessions",
                                    multiprocess_mode="livesum")
        self.graph_captures = Counter("ricordo_cuda_graph_captures", "CUDA graphs captured (decode, prefill): at "
                                      "start, while idle, or on the path of the step that needed one", ["kind"])
        self.graph_pool_copies = Counter("ricordo_cuda_graph_pool_copies", "sessions copied into a slot of a "
                                         "graphs' K/V pool (decode, prefill)", ["pool"])
        self.graph_pool_bytes = Gauge("ricordo_cuda_graph_pool_bytes", "bytes of the graphs' K/V pools (device "
                                      "memory outside --kv-ram-space-mb)", ["pool"], multiprocess_mode="livesum")
        self.graph_fused = Gauge("ricordo_cuda_graph_fused_attention", "1 where a kind of graph step (decode, "
                                 "prefill) attends with torch's fused kernel, 0 with the product",
                                 ["kind"], multiprocess_mode="livesum")
        self.device_peak = Gauge("ricordo_device_memory_peak_bytes", "the most device (CUDA) memory torch has held "
                                 "at once in the inference process", multiprocess_mode="livesum")
        # persister
        self.stored = Counter("ricordo_checkpoints_stored", "checkpoints written by reason", ["reason"])
        self.evictions = Counter("ricordo_evictions", "checkpoints removed (LRU or rejected)", ["why"])
        self.bytes_written = Counter("ricordo_cache_bytes_written", "checkpoint bytes written")
        self.save_seconds = Histogram("ricordo_save_seconds", "checkpoint write time (persister)",
                                      buckets=LATENCY_BUCKETS)
        self.dir_bytes = Gauge("ricordo_cache_dir_bytes", "bytes of valid entries in the cache directory",
                               multiprocess_mode="livesum")
        self.dir_entries = Gauge("ricordo_cache_dir_entries", "valid entries in the cache directory",
                                 multiprocess_mode="livesum")


class _NoMetrics:
    def __getattr__(self, name):
        return _Noop()


M: Metrics | _NoMetrics = _NoMetrics()


def init(run_dir: str) -> None:
    global M
    path = os.path.join(run_dir, "metrics")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    M = Metrics()


def exposition() -> tuple[bytes, str]:
    """The merged text format of every process's samples (call only after init)."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry), CONTENT_TYPE_LATEST
