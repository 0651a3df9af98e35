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
PARAMS_BUCKETS = (1, 2, 5, 10, 20)
TOKEN_BUCKETS = "1-2-5 up to max_model_len"     # vLLM's build_1_2_5_buckets, made per server


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > largest:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# Every metric once: (attribute, kind, name, help, extra). `extra` is a histogram's buckets,
# or the name of a second label: such a metric is labelled per value by its user, the
# others are bound to the model's name here.
METRICS = (
    ("num_requests_running", Gauge, "vllm:num_requests_running", "Number of requests currently running on GPU.", None),
    ("num_requests_waiting", Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", None),
    ("num_requests_swapped", Gauge, "vllm:num_requests_swapped", "Number of requests swapped to CPU.", None),
    ("gpu_cache_usage", Gauge, "vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", None),
    ("cpu_cache_usage", Gauge, "vllm:cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", None),
    ("gpu_prefix_cache_hit_rate", Gauge, "vllm:gpu_prefix_cache_hit_rate",
     "GPU prefix cache block hit rate.", None),
    ("num_preemptions", Counter, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.",
     None),
    # Not one of vLLM's: which way the engine preempted (recompute or swap).
    ("preemptions_by_mode", Counter, "jaxsched:num_preemptions_by_mode", "Cumulative preemptions by mode.", "mode"),
    ("prompt_tokens", Counter, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", None),
    ("generation_tokens", Counter, "vllm:generation_tokens_total", "Number of generation tokens processed.", None),
    ("request_success", Counter, "vllm:request_success", "Count of successfully processed requests.",
     "finished_reason"),
    ("time_to_first_token", Histogram, "vllm:time_to_first_token_seconds",
     "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    ("time_per_output_token", Histogram, "vllm:time_per_output_token_seconds",
     "Histogram of time per output token in seconds.", TPOT_BUCKETS),
    ("e2e_request_latency", Histogram, "vllm:e2e_request_latency_seconds",
     "Histogram of end to end request latency in seconds.", E2E_BUCKETS),
    ("request_prompt_tokens", Histogram, "vllm:request_prompt_tokens",
     "Number of prefill tokens processed.", TOKEN_BUCKETS),
    ("request_generation_tokens", Histogram, "vllm:request_generation_tokens",
     "Number of generation tokens processed.", TOKEN_BUCKETS),
    ("request_params_n", Histogram, "vllm:request_params_n", "Histogram of the n request parameter.",
     PARAMS_BUCKETS),
    ("request_params_best_of", Histogram, "vllm:request_params_best_of",
     "Histogram of the best_of request parameter.", PARAMS_BUCKETS),
)


def _declare(registry: CollectorRegistry, model_name: str, kind, name: str, doc: str, extra):
    if kind is Counter:
        name = name.removesuffix("_total")      # prometheus-client appends `_total` itself
    if isinstance(extra, str):
        return kind(name, doc, ["model_name", extra], registry=registry)
    more = {"buckets": extra} if kind is Histogram else {}
    return kind(name, doc, ["model_name"], registry=registry, **more).labels(model_name)


class Metrics:
    """One registry per server (not the process-global one: tests may build several apps);
    `max_model_len` bounds the token-count histograms' buckets."""

    def __init__(self, model_name: str, max_model_len: int = 1024):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        for attr, kind, name, doc, extra in METRICS:
            if extra is TOKEN_BUCKETS:
                extra = buckets_1_2_5(max_model_len)
            setattr(self, attr, _declare(self.registry, model_name, kind, name, doc, extra))
