"""`tgis-bench quality`: what a quantization (or any served configuration) costs in quality, measured
through each server teacher-forced.

Every window of text goes to each server as a prompt with input token details (`input_tokens`,
`token_logprobs`, `top_n_tokens=1`) and one new token: each position's logprob of the text's own next
token gives the perplexity, and each position's top token, compared with the first (baseline) server's
at the same position, the top-1 agreement. The text defaults to the demo model's own training corpus
(the Python documentation's prose), where the trained demo model's perplexity means something; on
unseen text a model that small is too close to guessing for a quantization's damage to show.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from transformers import AutoTokenizer

from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc
from tgis_bench.reports.files import write_report_files


@dataclass(frozen=True)
class Scored:
    """One server's answer for one window: each position's logprob and top token (from the second)."""

    logprobs: list[float]
    top: list[str]


@dataclass(frozen=True)
class Quality:
    name: str
    positions: int
    perplexity: float
    perplexity_ratio: float  # to the baseline's
    top1_agreement: float  # with the baseline's top token, position by position


def corpus_windows(model_dir: Path, length: int, count: int, text_file: Path | None) -> list[str]:
    """`count` texts of `length` tokens each, cut in order from the corpus (decoded from token ids, so
    every server tokenizes them back the same way)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if text_file is not None:
        documents = [text_file.read_text()]
    else:
        from tgis.demo_model import training_documents

        documents = training_documents()
    windows: list[str] = []
    for document in documents:
        ids = tokenizer(document, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids) - length + 1, length):
            windows.append(str(tokenizer.decode(ids[start : start + length])))
            if len(windows) == count:
                return windows
    return windows


def score(target: str, text: str) -> Scored:
    params = pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=1),
        response=pb.ResponseOptions(input_tokens=True, token_logprobs=True, top_n_tokens=1),
    )
    request = pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=text)], params=params)
    with grpc.insecure_channel(target) as channel:
        reply = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=300).responses[0]
    tokens = reply.input_tokens[1:]  # the first position has no context to be predicted from
    return Scored([t.logprob for t in tokens], [t.top_tokens[0].text if t.top_tokens else "" for t in tokens])


def measure(servers: Sequence[tuple[str, str]], windows: Sequence[str]) -> list[Quality]:
    scored = {name: [score(target, text) for text in windows] for name, target in servers}
    baseline = scored[servers[0][0]]
    results = []
    for name, _ in servers:
        answers = scored[name]
        logprobs = [lp for window in answers for lp in window.logprobs]
        agree = sum(
            a == b
            for mine, theirs in zip(answers, baseline, strict=True)
            for a, b in zip(mine.top, theirs.top, strict=False)
        )
        results.append(
            Quality(name, len(logprobs), math.exp(-sum(logprobs) / len(logprobs)), 0.0, agree / len(logprobs))
        )
    base = results[0].perplexity
    return [
        Quality(q.name, q.positions, q.perplexity, q.perplexity / base, q.top1_agreement) for q in results
    ]


def table(results: Sequence[Quality]) -> str:
    lines = [
        "| configuration | perplexity | ÷ baseline | top-1 agreement with baseline | positions |",
        "|---|---:|---:|---:|---:|",
    ]
    for q in results:
        ratios = f"{q.perplexity_ratio:.4f} | {q.top1_agreement:.4f}"
        lines.append(f"| {q.name} | {q.perplexity:.2f} | {ratios} | {q.positions} |")
    return "\n".join(lines)


def _server(text: str) -> tuple[str, str]:
    name, sep, target = text.partition("=")
    if not sep or not name or not target:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, got {text!r}")
    return name, target


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="tgis-bench quality", description=__doc__)
    p.add_argument(
        "--server", type=_server, action="append", required=True,
        help="NAME=HOST:PORT of a served configuration (gRPC), repeatable; the first is the baseline",
    )  # fmt: skip
    p.add_argument(
        "--model-dir", type=Path, required=True, help="the served model (its tokenizer cuts the text)"
    )
    p.add_argument("--window", type=int, default=120, help="tokens per prompt (default 120)")
    p.add_argument("--windows", type=int, default=64, help="prompts (default 64)")
    p.add_argument("--text", type=Path, default=None, help="a text file instead of the demo model's corpus")
    p.add_argument("--out", type=Path, default=None, help="write quality.json and QUALITY.md here")
    args = p.parse_args(argv)
    windows = corpus_windows(args.model_dir, args.window, args.windows, args.text)
    if not windows:
        p.error("the text is shorter than one window")
    results = measure(args.server, windows)
    report = table(results)
    print(report)
    if args.out is not None:
        data = [asdict(q) for q in results]
        write_report_files(
            args.out, data, report + "\n", json_name="quality.json", markdown_name="QUALITY.md"
        )
    return 0
