"""The soak's request mix: kinds of request, their weights and outcomes, and the seeded arrival schedule."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from tgis_bench.load.workload import LengthRange

Transport = Literal["grpc", "http"]
Need = Literal["lora", "prefix", "chat"]

GRPC_OK = frozenset({"grpc:OK"})
HTTP_OK = frozenset({"http:200"})
# A cancel that arrives after the last token leaves the call finished normally.
GRPC_CANCELLED = frozenset({"grpc:CANCELLED", "grpc:OK"})
HTTP_CLOSED = frozenset({"http:closed", "http:200"})
# A fast server may answer before the client's deadline passes.
GRPC_DEADLINE = frozenset({"grpc:DEADLINE_EXCEEDED", "grpc:OK"})


@dataclass(frozen=True)
class KindSpec:
    """One kind of request in the mix: how often it is sent and which outcomes mean the server behaved."""

    name: str
    transport: Transport
    weight: float
    expected: frozenset[str]
    needs: Need | None = None  # dropped from the mix when the server has no such adapter / chat template


KINDS: tuple[KindSpec, ...] = (
    KindSpec("grpc_unary", "grpc", 8, GRPC_OK),
    KindSpec("grpc_batch", "grpc", 5, GRPC_OK),  # one Generate call with 2-4 inputs
    KindSpec("grpc_stream", "grpc", 10, GRPC_OK),
    KindSpec("grpc_stream_cancel", "grpc", 5, GRPC_CANCELLED),  # the client cancels halfway
    KindSpec("grpc_time_limit", "grpc", 4, GRPC_OK),  # stopping.time_limit_millis
    KindSpec("grpc_deadline", "grpc", 4, GRPC_DEADLINE),  # a client deadline shorter than the generation
    KindSpec("grpc_regex", "grpc", 4, GRPC_OK),
    KindSpec("grpc_json_schema", "grpc", 4, GRPC_OK),
    KindSpec("grpc_choice", "grpc", 4, GRPC_OK),
    KindSpec("grpc_lora", "grpc", 5, GRPC_OK, "lora"),  # streamed
    KindSpec("grpc_prefix", "grpc", 5, GRPC_OK, "prefix"),
    KindSpec("openai_completion", "http", 6, HTTP_OK),
    KindSpec("openai_completion_stream", "http", 6, HTTP_OK),
    KindSpec("openai_chat", "http", 4, HTTP_OK, "chat"),
    KindSpec("openai_chat_stream", "http", 4, HTTP_OK, "chat"),
    KindSpec("openai_json_schema", "http", 3, HTTP_OK),  # response_format
    KindSpec("openai_choice", "http", 2, HTTP_OK),  # guided_choice
    KindSpec("openai_lora", "http", 3, HTTP_OK, "lora"),  # model = the LoRA adapter's id
    KindSpec("openai_stream_cancel", "http", 3, HTTP_CLOSED),  # the client disconnects halfway
    KindSpec("tgi_generate", "http", 5, HTTP_OK),
    KindSpec("tgi_generate_stream", "http", 5, HTTP_OK),
    KindSpec("tgi_regex", "http", 3, HTTP_OK),  # grammar {"type": "regex"}
    KindSpec("tgi_prefix", "http", 3, HTTP_OK, "prefix"),  # parameters.adapter_id
    KindSpec("tgi_stream_cancel", "http", 2, HTTP_CLOSED),
)
KIND_NAMES = tuple(kind.name for kind in KINDS)


@dataclass(frozen=True)
class Arrival:
    """One request of the schedule: when it is sent, what kind it is, which prompt and token budget."""

    index: int
    at: float  # seconds after the soak starts (0 in a closed loop)
    kind: str
    prompt: int  # index into the prompt pool
    new_tokens: int


def available_kinds(
    kinds: Sequence[KindSpec], *, lora: bool, prefix: bool, chat: bool
) -> tuple[KindSpec, ...]:
    """The kinds this server can answer, and whose weight is above 0."""
    have = {"lora": lora, "prefix": prefix, "chat": chat}
    return tuple(k for k in kinds if k.weight > 0 and (k.needs is None or have[k.needs]))


def with_weights(kinds: Sequence[KindSpec], weights: Mapping[str, float]) -> tuple[KindSpec, ...]:
    """The kinds with some weights replaced (0 removes a kind from the mix)."""
    unknown = sorted(set(weights) - {k.name for k in kinds})
    if unknown:
        raise ValueError(f"unknown request kinds {unknown}; known: {', '.join(k.name for k in kinds)}")
    return tuple(replace(k, weight=weights.get(k.name, k.weight)) for k in kinds)


def parse_weights(text: str) -> dict[str, float]:
    """`grpc_unary=10,tgi_prefix=0` → {"grpc_unary": 10.0, "tgi_prefix": 0.0}."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected KIND=WEIGHT, got {part!r}")
        weight = float(value)
        if weight < 0:
            raise ValueError(f"weights must not be negative, got {part!r}")
        weights[name.strip()] = weight
    return weights


def draws(
    kinds: Sequence[KindSpec], rng: random.Random, *, prompts: int, new_tokens: LengthRange
) -> Iterator[Arrival]:
    """Endless arrivals (at 0) drawn by weight: the closed-loop probe takes them as they come."""
    if not kinds:
        raise ValueError("the mix has no kinds left")
    names = [k.name for k in kinds]
    weights = [k.weight for k in kinds]
    index = 0
    while True:
        (kind,) = rng.choices(names, weights)
        yield Arrival(index, 0.0, kind, rng.randrange(prompts), new_tokens.draw(rng))
        index += 1


def poisson_schedule(
    rate: float,
    seconds: float,
    kinds: Sequence[KindSpec],
    *,
    prompts: int,
    new_tokens: LengthRange,
    seed: int,
) -> list[Arrival]:
    """An open loop: exponential gaps of mean 1/rate, so arrivals do not wait for answers."""
    if rate <= 0:
        raise ValueError(f"the arrival rate must be positive, got {rate}")
    rng = random.Random(seed)
    gaps = random.Random(seed + 1)  # its own stream: the same seed gives the same kinds at any rate
    schedule = []
    at = gaps.expovariate(rate)
    for arrival in draws(kinds, rng, prompts=prompts, new_tokens=new_tokens):
        if at >= seconds:
            break
        schedule.append(replace(arrival, at=at))
        at += gaps.expovariate(rate)
    return schedule
