"""A benchmark's results as one record: machine, model shape, workload, runs, baselines, ratios; JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tgis_bench.baselines.bound import DecodeBound, bound_json
from tgis_bench.baselines.common import BaselineResult
from tgis_bench.baselines.decode_floor import DecodeFloorResult
from tgis_bench.load.stats import RunSummary
from tgis_bench.load.workload import BenchRequest, WorkloadSpec, fingerprint
from tgis_bench.machine import MachineInfo


@dataclass(frozen=True)
class ModelShape:
    name: str  # the directory's name, never its path
    model_type: str
    layers: int | None
    hidden: int | None
    heads: int | None
    vocab: int | None
    positions: int | None
    parameters: int | None
    dtype: str
    kv_heads: int | None = None
    intermediate: int | None = None


@dataclass(frozen=True)
class WorkloadInfo:
    requests: int
    prompt_tokens: str
    new_tokens: str
    seed: int
    stream: bool
    prompt_token_total: int
    new_token_total: int
    fingerprint: str
    shared_prefix_tokens: int = 0
    requests_per_client: int | None = None  # a level of c clients sent the first requests_per_client × c
    long_prompt_every: int = 0
    long_prompt_words: int = 0
    long_prompt_tokens: str = ""  # the long prompts' token counts, LOW:HIGH
    prompt_source: str = ""  # the text file prompts were cut from; empty: the seeded filler
    grounded: bool = False  # each prompt a window then its first fifth again (input-grounded)
    # Levels after the first (and the warmup) sent prompts of their own (workload.Sweep); runs made
    # before that sent every level the same prompts, which a prefix cache could keep from level to level.
    fresh_levels: bool = False


@dataclass(frozen=True)
class PeerResult:
    """Another server measured in the same run: the same requests, streamed, after the tgis runs."""

    name: str  # short, for table headings: "vLLM", "llama.cpp Q8_0"
    version: str  # e.g. "vLLM 0.32.0"
    settings: str  # how it served, in words
    runs: list[RunSummary] = field(default_factory=list)


@dataclass(frozen=True)
class BenchmarkResults:
    created: str
    machine: MachineInfo
    model: ModelShape
    workload: WorkloadInfo
    runs: list[RunSummary]
    baselines: list[BaselineResult] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)  # what ModelInfo reported
    peers: list[PeerResult] = field(default_factory=list)
    bound: DecodeBound | None = None  # the weights-bandwidth bound measured in this run
    decode_floor: list[DecodeFloorResult] = field(default_factory=list)
    baseline_failures: list[str] = field(default_factory=list)  # one line per baseline that could not run
    regenerate: str = "make benchmark-report"  # the command that makes this report again

    @property
    def headline(self) -> RunSummary:
        """The run the ratios use: the highest concurrency of the sweep."""
        return max(self.runs, key=lambda run: run.concurrency)

    def peer_ratios(self, peer_result: PeerResult) -> list[tuple[int, float, float | None, float | None]]:
        """Per concurrency both ran: tgis/peer throughput, then tgis/peer TTFT p50 and ITL p99."""
        mine = {run.concurrency: run for run in self.runs}
        rows = []
        for peer in sorted(peer_result.runs, key=lambda r: r.concurrency):
            run = mine.get(peer.concurrency)
            if run is None:
                continue
            ttft = run.ttft.p50 / peer.ttft.p50 if run.ttft and peer.ttft and peer.ttft.p50 else None
            itl = (
                run.inter_token.p99 / peer.inter_token.p99
                if run.inter_token and peer.inter_token and peer.inter_token.p99
                else None
            )
            rows.append((peer.concurrency, run.tokens_per_second / peer.tokens_per_second, ttft, itl))
        return rows

    def ratios(self) -> dict[str, float]:
        """Server throughput at the headline concurrency over each baseline's."""
        server = self.headline.tokens_per_second
        return {baseline.name: server / baseline.tokens_per_second for baseline in self.baselines}


def model_shape(model_dir: Path, dtype: str) -> ModelShape:
    """The shape from config.json (GPT-2 and Llama-style key names), the size from safetensors headers."""
    config = json.loads((model_dir / "config.json").read_text())

    def first(*keys: str) -> int | None:
        return next((int(config[key]) for key in keys if config.get(key) is not None), None)

    return ModelShape(
        name=model_dir.name,
        model_type=str(config.get("model_type", "?")),
        layers=first("n_layer", "num_hidden_layers", "num_layers"),
        hidden=first("n_embd", "hidden_size", "d_model"),
        heads=first("n_head", "num_attention_heads", "num_heads"),
        vocab=first("vocab_size"),
        positions=first("n_positions", "max_position_embeddings"),
        parameters=_parameter_count(model_dir),
        dtype=dtype,
        kv_heads=first("num_key_value_heads"),
        intermediate=first("intermediate_size", "n_inner"),
    )


def _parameter_count(model_dir: Path) -> int | None:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (safe_open is not a mapping)
                count = 1
                for size in weights.get_slice(name).get_shape():
                    count *= size
                total += count
    return total


def workload_info(
    spec: WorkloadSpec,
    requests: Sequence[BenchRequest],
    *,
    stream: bool,
    per_client: int | None = None,
    timed: Sequence[BenchRequest] | None = None,
) -> WorkloadInfo:
    """The workload's description; its fingerprint covers the `timed` requests (every level's, where
    levels send prompts of their own), or `requests`."""
    long_lengths = [len(r.input_ids) for r in requests if spec.is_long(r.index)]
    return WorkloadInfo(
        requests=len(requests),
        prompt_tokens=str(spec.prompt_tokens),
        new_tokens=str(spec.new_tokens),
        seed=spec.seed,
        shared_prefix_tokens=spec.shared_prefix_tokens,
        stream=stream,
        prompt_token_total=sum(len(r.input_ids) for r in requests),
        new_token_total=sum(r.max_new_tokens for r in requests),
        fingerprint=fingerprint(requests if timed is None else timed),
        fresh_levels=timed is not None,
        requests_per_client=per_client,
        long_prompt_every=spec.long_prompt_every,
        long_prompt_words=spec.long_prompt_words if spec.long_prompt_every else 0,
        long_prompt_tokens=f"{min(long_lengths)}:{max(long_lengths)}" if long_lengths else "",
        prompt_source=spec.prompt_source,
        grounded=spec.grounded,
    )


def to_json(results: BenchmarkResults) -> dict[str, Any]:
    """Every field, plus the derived figures (throughputs, shares, ratios) so readers need no code."""
    data = asdict(results)
    for run, summary in zip(data["runs"], results.runs, strict=True):
        for method, share in summary.steps.items():
            run["steps"][method]["tokproc_share"] = share.tokproc_share
        if summary.speculation is not None:
            run["speculation"]["acceptance"] = summary.speculation.acceptance
            run["speculation"]["tokens_per_step"] = summary.speculation.tokens_per_step
    for baseline, result in zip(data["baselines"], results.baselines, strict=True):
        baseline["tokens_per_second"] = result.tokens_per_second
    data["headline_concurrency"] = results.headline.concurrency
    data["ratios"] = results.ratios()
    for peer, peer_result in zip(data["peers"], results.peers, strict=True):
        peer["ratios"] = [
            {"concurrency": c, "throughput": t, "ttft_p50": ttft, "itl_p99": itl}
            for c, t, ttft, itl in results.peer_ratios(peer_result)
        ]
    for floor, measured in zip(data["decode_floor"], results.decode_floor, strict=True):
        floor["tokens_per_second"] = measured.tokens_per_second
    if results.bound is not None:
        data["bound"] |= bound_json(results.bound, results.runs)
    return data
