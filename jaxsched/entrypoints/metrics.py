"""The server's Prometheus metrics, under vLLM 0.5.3's names.

The `vllm:` prefix is kept on purpose: Grafana dashboards and alerts written for `vllm serve`
read a jaxsched server unchanged. Gauges are set by the engine loop after every step;
counters and histograms are fed as tokens and requests finish.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (seconds), so histograms line up with vLLM's on one dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class Metrics:
    """One registry per server (not the process-global one: tests may build several apps)."""

    def __init__(self, model_name: str):
        self.registry = reg = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=reg).labels(model_name)

        def counter(name, doc):
            # prometheus-client appends `_total` to counters itself.
            return Counter(name.removesuffix("_total"), doc, labels, registry=reg).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests currently running on GPU.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.num_requests_swapped = gauge("vllm:num_requests_swapped",
                                          "Number of requests swapped to CPU.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "GPU KV-cache usage. 1 means 100 percent usage.")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc",
                                     "CPU KV-cache usage. 1 means 100 percent usage.")
        self.num_preemptions = counter("vllm:num_preemptions_total",
                                       "Cumulative number of preemption from the engine.")
        # Not one of vLLM's: which way the engine preempted (recompute or swap).
        self.preemptions_by_mode = Counter("jaxsched:num_preemptions_by_mode",
                                           "Cumulative preemptions by mode.", ["model_name", "mode"],
                                           registry=reg)
        self.prompt_tokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens_total",
                                         "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["model_name", "finished_reason"], registry=reg)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.", TPOT_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of end to end request latency in seconds.",
                                             E2E_BUCKETS)
        self.model_name = model_name
