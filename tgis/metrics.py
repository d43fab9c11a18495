"""Every Prometheus metric the server exports, declared once with TGIS names, labels, buckets (§11)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

# TGIS exports no `<name>_created` series; they would double the size of a scrape for nothing.
disable_created_metrics()

DURATION_BUCKETS = tuple(0.0001 * 1.5**k for k in range(1, 36))
# vLLM's buckets for its latency histograms (vllm/v1/metrics/loggers.py), so its dashboards read alike.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)  # fmt: skip
VLLM_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                        120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKENIZE_TOKEN_BUCKETS = tuple(float(2**k) for k in range(6, 20))


def _linear_buckets(limit: int) -> tuple[float, ...]:
    return tuple(limit / 64 * k for k in range(1, 65))


class BareCounterNames(Collector):
    """Every counter again under its bare TGIS name: prometheus-client only writes `<name>_total`,
    while TGIS dashboards query the bare name. Exposed as untyped here; `Metrics.render` types it."""

    def __init__(self, counters: Iterable[Counter]) -> None:
        self._counters = tuple(counters)

    def collect(self) -> Iterator[Metric]:
        for counter in self._counters:
            for family in counter.collect():
                bare = Metric(family.name, family.documentation, "unknown")
                for sample in family.samples:
                    if sample.name == family.name + "_total":
                        bare.add_sample(family.name, sample.labels, sample.value)
                yield bare

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(family.name for counter in self._counters for family in counter.describe())


class VllmLatency:
    """Latency histograms and token counters under vLLM's names, with its `model_name` label, for
    dashboards and autoscalers built on vLLM's metrics; recorded beside their tgi_* twins."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry)
            return family.labels(model_name=model_name)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            VLLM_ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            VLLM_REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            VLLM_REQUEST_BUCKETS,
        )

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name=model_name)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")


class Metrics:
    """The server's metrics on its own registry (one per server, so tests can run several)."""

    def __init__(
        self,
        *,
        max_sequence_length: int,
        max_new_tokens: int,
        max_batch_size: int,
        registry: CollectorRegistry | None = None,
        model_name: str = "demo",
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        # prometheus-client's standard series (process_*, python_info, python_gc_*), as its default
        # registry has them: memory, CPU time, open files and start time of the serving process.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        r.register(GC_COLLECTOR)
        self.build_info = Gauge(
            "tgi_build_info",
            "Always 1; the labels say what is serving",
            ("version", "engine", "dtype", "model"),
            registry=r,
        )

        def duration(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, buckets=DURATION_BUCKETS, registry=r)

        self.request_count = Counter("tgi_request_count", "Generate calls", ["kind"], registry=r)
        self.request_input_count = Counter("tgi_request_input_count", "Generate inputs", registry=r)
        self.request_failure = Counter("tgi_request_failure", "Failed requests", ["err"], registry=r)
        self.request_unauthorized = Counter(
            "tgi_request_unauthorized",
            "Requests refused before they ran: no valid API key or client certificate (tgis's own)",
            ["door", "reason"],
            registry=r,
        )
        self.request_success = Counter(
            "tgi_request_success", "Completed requests", ["stop_reason", "kind"], registry=r
        )
        self.request_max_new_tokens = Histogram(
            "tgi_request_max_new_tokens",
            "Effective max_new_tokens",
            buckets=_linear_buckets(max_new_tokens),
            registry=r,
        )
        self.request_input_length = Histogram(
            "tgi_request_input_length",
            "Validated input length",
            buckets=_linear_buckets(max_sequence_length),
            registry=r,
        )
        self.request_raw_input_length = Histogram(
            "tgi_request_raw_input_length", "Tokenized input length", registry=r
        )
        self.request_generated_tokens = Histogram(
            "tgi_request_generated_tokens",
            "Generated tokens",
            buckets=_linear_buckets(max_new_tokens),
            registry=r,
        )
        self.request_total_tokens = Histogram(
            "tgi_request_total_tokens",
            "Input plus generated tokens",
            buckets=_linear_buckets(max_sequence_length),
            registry=r,
        )
        self.request_validation_duration = duration("tgi_request_validation_duration", "Validation seconds")
        self.request_queue_duration = duration("tgi_request_queue_duration", "Queue seconds")
        self.request_inference_duration = duration(
            "tgi_request_inference_duration", "Batch entry to completion"
        )
        self.request_mean_time_per_token_duration = duration(
            "tgi_request_mean_time_per_token_duration", "Inference seconds per generated token"
        )
        self.request_duration = duration("tgi_request_duration", "End-to-end seconds")
        self.request_first_token_duration = duration(
            "tgi_request_first_token_duration", "Arrival to the first generated token, seconds"
        )
        self.request_inter_token_duration = duration(
            "tgi_request_inter_token_duration", "Between a request's successive token steps, seconds"
        )
        self.prompt_tokens = Counter("tgi_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("tgi_generation_tokens", "Tokens generated", registry=r)
        self.vllm = VllmLatency(r, model_name)
        self.batch_concatenation_count = Counter(
            "tgi_batch_concatenation_count", "Merges into the running batch", registry=r
        )
        self.batch_inference_count = Counter(
            "tgi_batch_inference_count", "Forward passes", ["method"], registry=r
        )
        self.batch_inference_success = Counter(
            "tgi_batch_inference_success", "Successful forward passes", ["method"], registry=r
        )
        self.batch_inference_failure = Counter(
            "tgi_batch_inference_failure", "Failed forward passes", ["method", "reason"], registry=r
        )
        self.batch_inference_batch_size = Histogram(
            "tgi_batch_inference_batch_size",
            "Rows per forward pass",
            ["method"],
            buckets=tuple(float(k) for k in range(1, max_batch_size + 1)),
            registry=r,
        )
        self.batch_inference_duration = duration(
            "tgi_batch_inference_duration", "Step seconds", ("method", "makeup")
        )
        self.batch_inference_forward_duration = duration(
            "tgi_batch_inference_forward_duration", "Model forward seconds", ("method", "makeup")
        )
        self.batch_inference_tokproc_duration = duration(
            "tgi_batch_inference_tokproc_duration", "Token processing seconds", ("method", "makeup")
        )
        self.batch_next_tokens = Histogram(
            "tgi_batch_next_tokens", "Prefill tokens incl. padding", registry=r
        )
        self.batch_current_size = Gauge("tgi_batch_current_size", "Running batch size", registry=r)
        self.batch_input_tokens = Gauge(
            "tgi_batch_input_tokens", "Running batch tokens incl. padding", registry=r
        )
        self.batch_max_remaining_tokens = Gauge(
            "tgi_batch_max_remaining_tokens", "Remaining token budget", registry=r
        )
        self.queue_size = Gauge("tgi_queue_size", "Queued requests", registry=r)
        self.queue_jump = Counter("tgi_queue_jump", "Requests admitted ahead of a skipped one", registry=r)
        self.granular_batch_addition = Counter(
            "tgi_granular_batch_addition", "Granular-check admissions", registry=r
        )
        self.prefill_weight_limit_exceeded = Counter(
            "tgi_prefill_weight_limit_exceeded", "Prefill weight skips", registry=r
        )
        self.prefill_padding_limit_exceeded = Counter(
            "tgi_prefill_padding_limit_exceeded", "Prefill padding skips", registry=r
        )
        # The paged engine's KV blocks (empty on padded engines).
        self.prefix_cache_queries = Counter(
            "tgi_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "tgi_prefix_cache_hits", "Prompt tokens served from the prefix cache", registry=r
        )
        self.kv_cache_usage = Gauge(
            "tgi_kv_cache_usage_perc", "Share (0-1) of the KV blocks running requests hold", registry=r
        )
        self.kv_cache_blocks = Gauge(
            "tgi_kv_cache_blocks",
            "KV blocks by state: total, used (referenced), cached (reusable)",
            ("state",),
            registry=r,
        )
        self.attention_path = Gauge(
            "tgi_attention_path",
            "Always 1 (paged step): `path` is how the layers attend, `fallback` why a faster path does not "
            "serve (empty: none faster on this device)",
            ("path", "fallback"),
            registry=r,
        )
        self.cuda_graphs_captured = Gauge(
            "tgi_cuda_graphs_captured",
            "Decode-step CUDA graphs captured at start (0: decode steps run eagerly)",
            registry=r,
        )
        # Speculative decoding (SPECULATOR_NAME); zero without it.
        self.speculation_proposed = Counter(
            "tgi_speculation_proposed_tokens", "Draft tokens verified by the model", registry=r
        )
        self.speculation_accepted = Counter(
            "tgi_speculation_accepted_tokens", "Draft tokens the model accepted", registry=r
        )
        self.speculation_acceptance = Gauge(
            "tgi_speculation_acceptance_rate", "Share of draft tokens accepted, over recent steps", registry=r
        )
        self.speculation_tokens_per_step = Histogram(
            "tgi_speculation_tokens_per_step",
            "Tokens a speculating sequence gained in one step (accepted draft tokens + 1)",
            buckets=tuple(range(1, 18)),
            registry=r,
        )
        self.prompt_load_failure = Counter("tgi_prompt_load_failure", "Prefix load failures", registry=r)
        self.prompt_load_duration = duration("tgi_prompt_load_duration", "Prefix load seconds")
        self.tokenize_request_count = Counter("tgi_tokenize_request_count", "Tokenize calls", registry=r)
        self.tokenize_request_input_count = Counter(
            "tgi_tokenize_request_input_count", "Tokenize inputs", registry=r
        )
        self.tokenize_request_tokens = Histogram(
            "tgi_tokenize_request_tokens",
            "Tokens per Tokenize call",
            buckets=TOKENIZE_TOKEN_BUCKETS,
            registry=r,
        )
        self.tokenize_request_duration = duration("tgi_tokenize_request_duration", "Tokenize seconds")
        # Guided decoding (tgis/guided.py): the compiled-grammar cache.
        self.guided_grammar_cache = Counter(
            "tgi_guided_grammar_cache",
            "Guided-decoding grammar lookups by result (hit, miss)",
            ("result",),
            registry=r,
        )
        self.guided_grammar_cache_size = Gauge(
            "tgi_guided_grammar_cache_size", "Compiled guided-decoding grammars held", registry=r
        )
        self.guided_grammar_compile_duration = duration(
            "tgi_guided_grammar_compile_duration", "Guided-decoding grammar compile seconds (misses)"
        )
        self.bare_counters = BareCounterNames(
            value for value in vars(self).values() if isinstance(value, Counter)
        )  # TGIS's names only: vLLM's (self.vllm) have `_total` alone, as vLLM exports them
        r.register(self.bare_counters)
        self._untyped_lines = {
            f"# TYPE {name} untyped\n".encode(): f"# TYPE {name} counter\n".encode()
            for name in self.bare_counters.names
        }

    def set_build_info(self, *, version: str, engine: str, dtype: str, model: str) -> None:
        self.build_info.clear()
        self.build_info.labels(version=version, engine=engine, dtype=dtype, model=model).set(1)

    def render(self) -> bytes:
        """The Prometheus text exposition, with the bare counter names typed `counter` as in TGIS."""
        text = generate_latest(self.registry)
        for untyped, typed in self._untyped_lines.items():
            text = text.replace(untyped, typed)
        return text
