"""Load gauges for inference gateways (Gateway API Inference Extension / llm-d endpoint picker).

Read from `EngineLoop.load()` at scrape time, under vLLM's names so the endpoint picker's default
flags work unchanged: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (and the older `vllm:gpu_cache_usage_perc`), `vllm:lora_requests_info`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tgis.engine_loop.core import LoopLoad


class GatewayLoadCollector(Collector):
    """One snapshot of the loop per scrape; `max_adapters` is how many distinct adapters can run at once."""

    def __init__(self, load: Callable[[], LoopLoad], model_name: str, max_adapters: int) -> None:
        self._load = load
        self._model_name = model_name
        self._max_adapters = max_adapters

    def collect(self) -> Iterator[Metric]:
        load = self._load()
        labels = ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_waiting", "Requests queued, not yet running", load.waiting),
            ("vllm:num_requests_running", "Requests in the running batch", load.running),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1", load.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 0-1 (older vLLM name)", load.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric([self._model_name], float(value))
            yield family
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Adapters of running and waiting requests; the value is the snapshot's Unix time",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
        )
        lora.add_metric(
            [",".join(load.running_adapters), ",".join(load.waiting_adapters), str(self._max_adapters)],
            time.time(),
        )
        yield lora

    def describe(self) -> Iterator[Metric]:
        return iter(())
