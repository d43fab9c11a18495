"""What the server does for a lone stream's token around the engine step, timed with its own components.

The step profile (`baselines.step_profile`) splits the engine step. Around it, each token also goes through:
- sampling: the batch sampler with one greedy row that sets min_new_tokens, as the benchmark's
  requests do (its EOS suppression runs every step);
- the output path: detokenizing the token and applying the stop rules (`OutputTracker`);
- the hand-off: the engine thread puts the event on the request's asyncio queue (`EventDelivery`), and
  the time until the waiting coroutine runs is the event loop's wake-up;
- the stream message: the gRPC progress message built and serialized (`stream_token_message`).

Each is timed alone in this process, `rounds` times, and reported as its median. The hand-off waits a
little between events, so every event wakes an idle loop, as at concurrency 1.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

HANDOFF_GAP_SECONDS = 0.002  # between events: the loop is idle when each arrives, as at concurrency 1


@dataclass(frozen=True)
class TokenCosts:
    """Median microseconds per token of each part, in the order the table lists them."""

    sampling_us: float
    output_us: float
    handoff_us: float
    message_us: float
    rounds: int

    def lines(self) -> list[str]:
        rows = (
            ("sampling (greedy, min_new_tokens set)", self.sampling_us),
            ("detokenizing and stop rules", self.output_us),
            ("hand-off to the event loop (put to the waiting coroutine running)", self.handoff_us),
            ("gRPC stream message (built and serialized)", self.message_us),
        )
        return [
            f"Around the step, per token of a lone stream (each part timed alone in process, median of "
            f"{self.rounds}):",
            "",
            "| Part | µs per token |",
            "|---|---:|",
            *(f"| {name} | {us:.0f} |" for name, us in rows),
        ]


def measure_token_costs(
    tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], *, rounds: int = 64
) -> TokenCosts:
    """Time each part `rounds` times on a stream of tokens from `tokenizer`'s vocabulary."""
    prompt = [(7 * i) % vocab_size for i in range(64)]
    tokens = [(11 * i + 5) % vocab_size for i in range(rounds)]
    return TokenCosts(
        sampling_us=_sampling_us(vocab_size, eos_token_ids, prompt, rounds),
        output_us=_output_us(tokenizer, eos_token_ids, prompt, tokens),
        handoff_us=_handoff_us(rounds),
        message_us=_message_us(tokenizer, tokens),
        rounds=rounds,
    )


def _median_us(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e6


def _timed(run: Callable[[], object]) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def _sampling_us(vocab_size: int, eos_token_ids: Sequence[int], prompt: list[int], rounds: int) -> float:
    import torch

    from tgis.sampling.config import SamplingConfig
    from tgis.sampling.sampler import BatchSampler

    sampler = BatchSampler(vocab_size, eos_token_ids, torch.device("cpu"))
    sampler.add_rows([SamplingConfig(greedy=True, min_new_tokens=rounds + 1)], [prompt])
    logits = torch.randn(1, vocab_size, generator=torch.Generator().manual_seed(0))
    return _median_us([_timed(lambda: sampler.sample(logits)) for _ in range(rounds)])


def _output_us(tokenizer: Any, eos_token_ids: Sequence[int], prompt: list[int], tokens: list[int]) -> float:
    from tgis.stopping import OutputTracker, StopCriteria
    from tgis.tokenization.detokenizer import for_tokenizer

    longer = len(tokens) + 1  # the stream never ends while timed
    eos = frozenset(eos_token_ids)
    criteria = StopCriteria(max_new_tokens=longer, min_new_tokens=longer, eos_token_ids=eos)
    source = for_tokenizer(tokenizer, prompt, decoder_only=True, skip_special_tokens=True)
    tracker = OutputTracker(criteria, source)
    return _median_us([_timed(partial(tracker.on_token, token)) for token in tokens])


def _message_us(tokenizer: Any, tokens: list[int]) -> float:
    from tgis.rpc.responses import stream_token_message
    from tgis.types import TokenEvent, TokenInfo

    def build(count: int, token: int) -> bytes:
        text = tokenizer.convert_ids_to_tokens(token)
        event = TokenEvent(generated_token_count=count, text=text, token=TokenInfo(text=text))
        return stream_token_message(event, seed=0).SerializeToString()

    return _median_us([_timed(partial(build, i + 1, t)) for i, t in enumerate(tokens)])


def _handoff_us(rounds: int) -> float:
    """From the engine thread's put to the coroutine awaiting the request's queue running again."""
    from tgis.service.delivery import EventDelivery
    from tgis.types import TokenEvent

    async def receive() -> list[float]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        put = EventDelivery(loop).sink(queue)
        sent: list[float] = []

        def engine_thread() -> None:
            for count in range(1, rounds + 1):
                time.sleep(HANDOFF_GAP_SECONDS)
                sent.append(time.perf_counter())
                put(TokenEvent(generated_token_count=count, text=""))

        thread = threading.Thread(target=engine_thread, name="token-costs-engine", daemon=True)
        thread.start()
        latencies = []
        for index in range(rounds):
            await queue.get()
            latencies.append(time.perf_counter() - sent[index])
        thread.join()
        return latencies

    return _median_us(asyncio.run(receive()))
