r"""Throughput of N concurrent guided requests against N unguided ones, on one tiny random model, same run.

    python scripts/bench_guided_serving.py [--arch llama] [--concurrency 32] [--tokens 64] [--rounds 3]

Builds the tiny test model locally, serves it in-process, and sends rounds of `concurrency`
concurrent sampled requests: unguided, then guided (each round alternates the order). The
default constraint, `[\s\S]*` (any text), masks almost nothing, so both kinds detokenize the same
kind of text and the difference is the cost of the mask; `--regex '[a-z ]{512}'` measures a
narrow one. Generated tokens per second are compared (requests may end early on EOS).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.tiny import build_model
from tests.integration.harness import ServerThread
from tgis.pb import generation_pb2 as pb


def _round(server: ServerThread, params: pb.Parameters, concurrency: int) -> tuple[int, float]:
    def one(i: int) -> int:
        request = pb.BatchedGenerationRequest(
            params=params, requests=[pb.GenerationRequest(text=f"Request {i} says")]
        )
        return server.stub.Generate(request, timeout=600).responses[0].generated_token_count

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, range(concurrency)))
    return tokens, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--regex", default=r"[\s\S]*")
    args = parser.parse_args()

    def params(guided: bool, seed: int) -> pb.Parameters:
        message = pb.Parameters(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(seed=seed),
            stopping=pb.StoppingCriteria(max_new_tokens=args.tokens),
        )
        if guided:
            message.decoding.regex = args.regex
        return message

    with tempfile.TemporaryDirectory() as tmp:
        server = ServerThread(build_model(Path(tmp), args.arch), max_batch_size=args.concurrency)
        try:
            for guided in (False, True):  # warm up both at full concurrency; compiles the grammar once
                _round(server, params(guided, 0), args.concurrency)
            totals = {False: [0, 0.0], True: [0, 0.0]}
            for r in range(args.rounds):
                for guided in (False, True) if r % 2 == 0 else (True, False):
                    tokens, seconds = _round(server, params(guided, r), args.concurrency)
                    totals[guided][0] += tokens
                    totals[guided][1] += seconds
        finally:
            server.stop()
    rates = {guided: tokens / seconds for guided, (tokens, seconds) in totals.items()}
    print(f"{args.arch}, {args.concurrency} concurrent, {args.tokens} tokens each, {args.rounds} rounds")
    print(f"guided by {args.regex!r}")
    for guided, (generated, elapsed) in totals.items():
        name = "guided" if guided else "unguided"
        print(f"{name:8s} {int(generated):6d} tokens in {elapsed:6.2f} s = {rates[guided]:8.1f} tokens/s")
    print(f"guided / unguided = {rates[True] / rates[False]:.2f}")


if __name__ == "__main__":
    main()
