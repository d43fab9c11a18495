"""Per-request latency histograms and token counters, under TGIS-style and vLLM's names: one streamed
request of two tokens shows each new histogram with a count of 1, and the counters its tokens."""

from __future__ import annotations

import openai
from transformers import AutoTokenizer

from tests.ops.serving import OpsServer
from tests.ops.test_metrics_scrape import parse

HISTOGRAMS = (
    "tgi_request_first_token_duration",
    "tgi_request_inter_token_duration",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
)


def test_a_streamed_request_is_one_observation_in_every_new_histogram(model_dirs) -> None:
    with OpsServer(model_dirs("llama"), served_model_name="tiny") as server:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="none", max_retries=0
        )
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt="one two three",
                max_tokens=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
        assert chunks[-1].choices[0].finish_reason == "length"
        status, body = server.http_get("/metrics")
    assert status == 200
    scrape = parse(body.decode())
    vllm = {"model_name": "tiny"}
    for name in HISTOGRAMS:
        labels = vllm if name.startswith("vllm:") else {}
        assert scrape.types[name] == "histogram", name
        assert scrape.value(f"{name}_count", **labels) == 1, name
        assert scrape.value(f"{name}_bucket", le="+Inf", **labels) == 1, name
        assert scrape.value(f"{name}_sum", **labels) > 0, name
    prompt_tokens = len(AutoTokenizer.from_pretrained(model_dirs("llama"))("one two three")["input_ids"])
    assert scrape.value("vllm:prompt_tokens_total", **vllm) == prompt_tokens
    assert scrape.value("vllm:generation_tokens_total", **vllm) == 2
    assert scrape.value("tgi_prompt_tokens_total") == scrape.value("tgi_prompt_tokens") == prompt_tokens
    assert scrape.value("tgi_generation_tokens_total") == scrape.value("tgi_generation_tokens") == 2
    # time to first token counts from the call's arrival, so it holds the queue time within it
    assert scrape.value("vllm:time_to_first_token_seconds_sum", **vllm) >= scrape.value(
        "vllm:request_queue_time_seconds_sum", **vllm
    )
    assert "vllm:prompt_tokens" not in scrape.types  # vLLM's counters have their `_total` name only
