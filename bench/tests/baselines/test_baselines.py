"""The in-process baselines on a tiny llama: generate() eager and with a static cache, the decode floor
(checked token for token against generate()), the plan that runs them and how a failure is reported."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tgis_bench.baselines import plan as baseline_plan
from tgis_bench.baselines.common import load_model
from tgis_bench.baselines.decode_floor import WARMUP_STEPS, decode_floor, run_decode_steps
from tgis_bench.baselines.generate import generate_batches, generate_kwargs, static_compile
from tgis_bench.baselines.plan import BaselinePlan, run_baselines
from tgis_bench.load.workload import LengthRange, WorkloadSpec, build_workload

SPEC = WorkloadSpec(requests=6, prompt_tokens=LengthRange(12, 12), new_tokens=LengthRange(3, 5), seed=2)


@pytest.fixture(scope="module")
def llama(model_dirs) -> Any:
    return load_model(model_dirs("llama"), "float32")


@pytest.fixture(scope="module")
def requests(model_dirs):
    return build_workload(AutoTokenizer.from_pretrained(model_dirs("llama")), SPEC)


def test_the_static_cache_compiles_on_cuda_and_on_the_cpu_only_when_asked():
    cuda = static_compile(torch.device("cuda"), compile_cpu=False)
    assert cuda.mode == "reduce-overhead" and "CUDA graphs" in cuda.note
    assert static_compile(torch.device("cpu"), compile_cpu=True).mode == "default"
    eager = static_compile(torch.device("cpu"), compile_cpu=False)
    assert eager.mode is None and "--compile-cpu" in eager.note
    assert generate_kwargs(None) == {}
    assert generate_kwargs(eager) == {"cache_implementation": "static", "disable_compile": True}
    compiled = generate_kwargs(cuda)
    assert compiled["cache_implementation"] == "static"
    assert (
        compiled["compile_config"].mode == "reduce-overhead"
        and not compiled["compile_config"]._compile_all_devices
    )
    assert generate_kwargs(static_compile(torch.device("cpu"), compile_cpu=True))[
        "compile_config"
    ]._compile_all_devices


@pytest.mark.parametrize("static", [False, True], ids=["dynamic-cache", "static-cache"])
def test_batched_generate_counts_the_asked_tokens(llama, requests, static):
    how = static_compile(llama.device, compile_cpu=False) if static else None
    tokens, seconds = generate_batches(llama, requests, batch_size=4, static=how, progress=False)
    assert tokens == sum(r.max_new_tokens for r in requests) and seconds > 0


def test_the_decode_floor_makes_generates_greedy_tokens(llama, requests):
    prompts = [r.input_ids for r in requests[:3]]
    run = run_decode_steps(llama, prompts, steps=5, mode=None)
    assert len(run.seconds) == 5 and all(s > 0 for s in run.seconds)
    new = 1 + WARMUP_STEPS + 5  # the prefill's token, the warm-up steps' and the timed ones'
    with torch.no_grad():
        ids = torch.tensor(prompts)
        out = llama.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
            min_new_tokens=new, pad_token_id=0,
        )  # fmt: skip
    assert run.tokens == out[:, ids.shape[1] :].tolist()
    assert len({tuple(row) for row in run.tokens}) > 1  # the rows differ: a real check, not a constant


def test_the_decode_floor_reports_step_percentiles(llama, requests):
    floor = decode_floor(llama, [r.input_ids for r in requests[:2]], steps=4, mode=None, note="eager")
    assert (floor.batch_size, floor.prompt_tokens, floor.steps, floor.timer) == (
        2,
        12,
        4,
        "time.perf_counter",
    )
    assert 0 < floor.step.p50 <= floor.step.p90 <= floor.step.p99
    assert floor.tokens_per_second == pytest.approx(2 / floor.step.p50)
    with pytest.raises(ValueError, match="one length"):
        run_decode_steps(llama, [(1, 2, 3), (1, 2)], steps=2, mode=None)


def test_the_plan_runs_every_baseline_in_order_at_its_batch(model_dirs, requests):
    plan = BaselinePlan(
        names=("compiled-batched", "sequential", "compiled", "generate-batched", "batched"),
        batch_size=2,
        per_client=2,
        floor_batches=(1, 2),
        floor_prompt_tokens=10,
        floor_steps=3,
        progress=False,
    )
    outcome = run_baselines(model_dirs("llama"), requests, plan)
    ran = [(b.name, b.batch_size, b.tokens) for b in outcome.results]
    first_two, first_four = (
        sum(r.max_new_tokens for r in requests[:2]),
        sum(r.max_new_tokens for r in requests[:4]),
    )
    assert ran == [
        ("sequential", 1, first_two),  # per client 2: two requests at batch 1, four at batch 2
        ("batched", 2, first_four),
        ("generate-batched", 2, first_four),
        ("compiled", 1, first_two),
        ("compiled-batched", 2, first_four),
    ]
    assert "not compiled" in outcome.results[3].note and outcome.results[0].note == ""
    assert [(f.batch_size, f.prompt_tokens, f.steps) for f in outcome.floor] == [(1, 10, 3), (2, 10, 3)]
    assert outcome.failures == []


def test_a_compiled_baseline_that_fails_is_reported_not_raised(model_dirs, requests, monkeypatch):
    real = baseline_plan.generate_batches

    def failing(model: Any, chosen: Any, **kwargs: Any) -> tuple[int, float]:
        if kwargs["static"] is not None:
            raise RuntimeError("no compiler\nsecond line")
        return real(model, chosen, **kwargs)

    monkeypatch.setattr(baseline_plan, "generate_batches", failing)
    plan = BaselinePlan(names=("sequential", "compiled"), batch_size=2, progress=False)
    outcome = run_baselines(model_dirs("llama"), requests[:2], plan)
    assert [b.name for b in outcome.results] == ["sequential"]
    assert outcome.failures == [
        "sequential generate(), static cache + torch.compile: failed (RuntimeError: no compiler)"
    ]
    eager_failure = dataclasses.replace(plan, names=("sequential",))
    monkeypatch.setattr(
        baseline_plan, "generate_batches", lambda *a, **k: (_ for _ in ()).throw(ValueError("x"))
    )
    with pytest.raises(ValueError):  # an eager baseline's failure is a real error
        run_baselines(model_dirs("llama"), requests[:2], eager_failure)


def test_a_plan_refuses_unknown_baselines_and_empty_floors():
    with pytest.raises(ValueError, match="unknown baselines"):
        BaselinePlan(names=("sequential", "vllm"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        BaselinePlan(floor_batches=(0,))
    assert BaselinePlan(batch_size=8).batch_of("compiled") == 1
    assert BaselinePlan(batch_size=8).batch_of("compiled-batched") == 8
