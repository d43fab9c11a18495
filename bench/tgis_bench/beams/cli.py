"""`tgis-bench beams`: what beam search costs beside greedy decoding on a running server.

The same prompts go to the server's OpenAI completions route greedy (n=1) and as a beam search of
`--width` beams, each at every `--concurrency` level, in alternating rounds (so the machine's drift
touches both alike). Every request generates exactly `--new-tokens` tokens per sequence (`ignore_eos`),
so a beam request computes `width` times the positions of a greedy one. Reported per level, as the
median over the rounds with its range: requests per second and latency of each mode, and the beam
request's cost in greedy requests (greedy requests/s over beam requests/s). In the same run, the
in-process peer: transformers' own `generate(num_beams=width)` against its greedy `generate()`, one
request at a time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tgis_bench.machine import machine_info
from tgis_bench.reports.files import write_report_files

WORDS = (
    "the", "a", "of", "river", "stone", "light", "quiet", "north", "garden", "window", "paper", "silver",
    "morning", "answer", "letter",
)  # fmt: skip


@dataclass(frozen=True)
class Sample:
    round: int
    mode: str  # "greedy" or "beams"
    concurrency: int
    seconds: float
    requests: int
    latencies: tuple[float, ...]

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds


def prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def completion(url: str, prompt: str, new_tokens: int, width: int) -> float:
    """One request's latency; beams when width > 1."""
    body: dict[str, object] = {
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if width > 1:
        body.update(n=width, use_beam_search=True)
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    if len(answer["choices"]) != max(width, 1):
        raise RuntimeError(f"expected {width} choices, got {len(answer['choices'])}")
    return time.perf_counter() - started


def drive(
    url: str, texts: Sequence[str], concurrency: int, new_tokens: int, width: int
) -> tuple[float, list[float]]:
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(lambda text: completion(url, text, new_tokens, width), texts))
    return time.perf_counter() - started, latencies


def transformers_peer(model_dir: Path, texts: Sequence[str], new_tokens: int, width: int) -> dict[str, float]:
    """Seconds per request of transformers' generate(), greedy and with `width` beams, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    seconds: dict[str, float] = {}
    for mode, beams in (("greedy", 1), ("beams", width)):
        started = time.perf_counter()
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")
            with torch.inference_mode():
                model.generate(
                    **ids,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    num_beams=beams,
                    num_return_sequences=beams,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                )
        seconds[mode] = (time.perf_counter() - started) / len(texts)
    return seconds


@dataclass(frozen=True)
class Row:
    """One concurrency level, medians over the rounds; `beam_cost`: greedy requests/s over beam
    requests/s, per round."""

    concurrency: int
    greedy_requests_per_second: float
    beam_requests_per_second: float
    greedy_latency_p50: float
    beam_latency_p50: float
    beam_cost: float
    beam_cost_range: tuple[float, float]


def summarize(samples: Sequence[Sample], levels: Sequence[int]) -> list[Row]:
    rows = []
    for level in levels:
        greedy = {s.round: s for s in samples if s.concurrency == level and s.mode == "greedy"}
        beams = {s.round: s for s in samples if s.concurrency == level and s.mode == "beams"}
        cost = [greedy[r].requests_per_second / beams[r].requests_per_second for r in greedy if r in beams]
        rows.append(
            Row(
                concurrency=level,
                greedy_requests_per_second=statistics.median(s.requests_per_second for s in greedy.values()),
                beam_requests_per_second=statistics.median(s.requests_per_second for s in beams.values()),
                greedy_latency_p50=statistics.median(x for s in greedy.values() for x in s.latencies),
                beam_latency_p50=statistics.median(x for s in beams.values() for x in s.latencies),
                beam_cost=statistics.median(cost),
                beam_cost_range=(min(cost), max(cost)),
            )
        )
    return rows


def render(rows: Sequence[Row], width: int, peer: dict[str, float] | None, about: str) -> str:
    lines = [
        f"# Beam search ({width} beams) against greedy decoding",
        "",
        about,
        "",
        "| concurrency | greedy req/s | beam req/s | greedy p50 | beam p50 | beam request / greedy request |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        low, high = row.beam_cost_range
        lines.append(
            f"| {row.concurrency} | {row.greedy_requests_per_second:.2f} "
            f"| {row.beam_requests_per_second:.2f} "
            f"| {row.greedy_latency_p50:.3f} s | {row.beam_latency_p50:.3f} s "
            f"| {row.beam_cost:.2f}x ({low:.2f}-{high:.2f}) |"
        )
    if peer is not None:
        lines += [
            "",
            f"transformers' generate(), one request at a time: greedy {peer['greedy']:.3f} s, {width} beams "
            f"{peer['beams']:.3f} s per request ({peer['beams'] / peer['greedy']:.2f}x).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tgis-bench beams", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's HTTP base URL, e.g. http://localhost:3000")
    p.add_argument(
        "--model-dir", type=Path, help="the served model, for transformers' generate() as the peer"
    )
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=int, default=16, help="requests per level, mode and round")
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    texts = prompts(args.requests, args.prompt_words, args.seed)
    completion(args.url, texts[0], 2, args.width)  # warm-up
    samples = []
    for round_ in range(args.rounds):
        for level in levels:
            modes = [("greedy", 1), ("beams", args.width)]
            for mode, width in modes if round_ % 2 == 0 else modes[::-1]:
                seconds, latencies = drive(args.url, texts, level, args.new_tokens, width)
                samples.append(Sample(round_, mode, level, seconds, len(texts), tuple(latencies)))
    peer = None
    if args.model_dir is not None:
        peer = transformers_peer(args.model_dir, texts[: min(4, len(texts))], args.new_tokens, args.width)
    machine = machine_info()
    about = (
        f"{machine.cpu} ({machine.cores} cores; {machine.cpu_flags or 'no vector flags read'}), torch "
        f"{machine.torch}. {args.requests} requests per level and mode, {args.prompt_words}-word prompts, "
        f"{args.new_tokens} new tokens per sequence, {args.rounds} alternating rounds; medians (range)."
    )
    rows = summarize(samples, levels)
    text = render(rows, args.width, peer, about)
    print(text)
    if args.out is not None:
        data = {
            "machine": asdict(machine),
            "rows": [asdict(row) for row in rows],
            "peer": peer,
            "samples": [asdict(s) for s in samples],
        }
        write_report_files(args.out, data, text)
    return 0
