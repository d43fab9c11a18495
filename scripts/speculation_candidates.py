"""Would verifying several candidate draft chains per sequence and step pay on the paged CPU engine?

IBM TGIS (SPECULATOR_N_CANDIDATES > 1, server/text_generation_server/utils/paged.py) asks the MLP
speculator for a tree of drafts: head i keeps its top `top_k_tokens_per_head[i]` tokens for every branch
so far, each leaf chain is scored by the sum of its heads' log-probabilities, and the best
`n_candidates` chains are verified, each as a sequence of its own of n_predict + 1 positions (the newest
token and the chain). The chain with the most leading tokens equal to the model's own picks is kept
(ties: the better scored). When the candidates' shared prefixes shrink the step to under 75 % of its
positions, TGIS lays the tree out flat: every distinct prefix once.

This server verifies one greedy chain. This script measures, on this machine:

1. acceptance: the mean draft tokens accepted per step when the best of k candidates is kept, teacher-
   forced on the demo model's own greedy continuations of held-out prompts (as
   engines/speculative/train.py's `measure_acceptance` does for one chain); k = 1 with every head's top
   1 reproduces that single greedy chain;
2. cost: the paged engine's step (`PagedHFEngine.step`, the CPU path the server runs) at 1, 4 and 16
   decoding sequences, each verifying k chains of n_predict + 1 positions, or the flattened tree, built
   as paged_runner builds a step with draft chunks; configurations interleaved round by round;
3. both together: tokens per second against k = 1, (1 + a_k) / T_k ÷ (1 + a_1) / T_1, per round.

Run with `.venv/bin/python scripts/speculation_candidates.py` (about 10 minutes on 2 cores; `--quick`
for a smoke run). It prints a markdown report; `--json` also saves the raw numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engines.common import cpu_has_native_bf16, fixed_threads  # noqa: E402
from engines.speculative import load_mlp_speculator  # noqa: E402
from engines.speculative.mlp import MLPSpeculator  # noqa: E402
from engines.speculative.train import Acceptance, greedy_transcripts  # noqa: E402
from engines.step import SequenceChunk, StepBatch  # noqa: E402
from tgis import demo_model, demo_speculator  # noqa: E402
from tgis_bench.machine import machine_info  # noqa: E402

KS = (1, 2, 3, 5)
CONCURRENCIES = (1, 4, 16)
BLOCK_SIZE = 16  # KV_BLOCK_SIZE's default
FLATTEN_BELOW = 0.75  # TGIS flattens a step when the tree keeps under this share of its positions


# ---- the machine ------------------------------------------------------------------------------------


def cpu_counters() -> tuple[int, int, int]:
    """(busy, total) jiffies of the whole machine and this process's own jiffies, from /proc."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        own = int(mine[11]) + int(mine[12])  # utime, stime
    except (OSError, ValueError, IndexError):
        return 0, 0, 0
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields), own


def others_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """The share of the machine's CPU time that other processes used between two `cpu_counters`."""
    total = after[1] - before[1]
    return max(0.0, (after[0] - before[0]) - (after[2] - before[2])) / total if total else 0.0


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# ---- candidate trees (TGIS's rule, our code) ---------------------------------------------------------


@torch.inference_mode()
def candidate_tree(
    speculator: MLPSpeculator, hidden: torch.Tensor, last: torch.Tensor, top_k: tuple[int, ...], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The best `n` chains [S, n, heads] of the tree in which head i extends every branch by its top
    `top_k[i]` tokens, ranked by summed log-probability (best first), and their scores [S, n].

    Each head's state follows the token its branch took, exactly as `MLPSpeculator.propose` follows
    the argmax; with every top_k 1 and n = 1 the one chain is `propose`'s."""
    rows = hidden.shape[0]
    state = speculator.input_state(hidden)
    tokens = last.long().reshape(rows, 1)
    chains = tokens.new_empty((rows, 1, 0))
    scores = torch.zeros(rows, 1)
    for head, k in enumerate(top_k):
        width = tokens.shape[1]
        state = speculator.advance(head, state.reshape(rows * width, -1), tokens.reshape(-1))
        log_probs = torch.log_softmax(speculator.head[head](state).float(), dim=-1)
        best, picked = log_probs.topk(k, dim=-1)  # [S*width, k]
        chains = torch.cat(
            [chains.unsqueeze(2).expand(rows, width, k, head), picked.view(rows, width, k, 1)], dim=-1
        ).reshape(rows, width * k, head + 1)
        scores = (scores.unsqueeze(2) + best.view(rows, width, k)).reshape(rows, width * k)
        state = state.view(rows, width, 1, -1).expand(rows, width, k, -1)
        tokens = picked.view(rows, width * k)
    order = scores.topk(n, dim=1).indices  # sorted: best first
    return chains.gather(1, order.unsqueeze(2).expand(-1, -1, len(top_k))), scores.gather(1, order)


def batched_tree(speculator, hidden, last, top_k, n, batch=512):
    parts = [
        candidate_tree(speculator, hidden[i : i + batch], last[i : i + batch], top_k, n)[0]
        for i in range(0, hidden.shape[0], batch)
    ]
    return torch.cat(parts)


def accepted_counts(candidates: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """[S, c] leading draft tokens of each candidate [S, c, h] equal to the target's [S, h]."""
    return (candidates == truth.unsqueeze(1)).int().cumprod(dim=-1).sum(dim=-1)


def shared_depths(candidates: torch.Tensor) -> torch.Tensor:
    """[S, c]: how many leading draft tokens candidate j shares with an earlier one (0 for the first);
    a flattened tree holds candidate j's remaining h - depth tokens only."""
    rows, count, _ = candidates.shape
    depths = torch.zeros(rows, count, dtype=torch.long)
    for j in range(1, count):
        common = (candidates[:, j : j + 1] == candidates[:, :j]).long().cumprod(dim=-1).sum(dim=-1)
        depths[:, j] = common.max(dim=1).values
    return depths


def with_greedy_first(greedy: torch.Tensor, tree: torch.Tensor, count: int) -> torch.Tensor:
    """The greedy chain, then the tree's best chains that differ from it: [S, count, h]."""
    out = [greedy.unsqueeze(1)]
    keep = (tree != greedy.unsqueeze(1)).any(dim=-1)  # [S, c]
    # Stable: push the tree's copy of the greedy chain (if any) to the end.
    order = torch.sort((~keep).int(), dim=1, stable=True).indices
    others = tree.gather(1, order.unsqueeze(2).expand(-1, -1, tree.shape[2]))
    out.append(others[:, : count - 1])
    return torch.cat(out, dim=1)


@dataclass
class Interval:
    mean: float
    low: float
    high: float

    def text(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def cluster_bootstrap(values: torch.Tensor, groups: int, draws: int = 2000, seed: int = 0) -> Interval:
    """The mean of `values` [groups * per_group] with a 95 % interval from resampling whole groups
    (prompts): a prompt's steps are not independent of one another."""
    per_group = values.view(groups, -1).double().mean(dim=1)
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, groups, (draws, groups), generator=generator)
    means = per_group[picks].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return Interval(per_group.mean().item(), low, high)


def measure_acceptance(args, speculator: MLPSpeculator, model_dir: Path) -> dict:
    """Every variant's per-step accepted counts and flattened sizes over the held-out steps."""
    n_predict = speculator.config.n_predict
    held_out = demo_speculator.corpus_ids(model_dir, held_out=True)
    prompt_tokens = demo_speculator.PLAN.prompt_tokens
    stride = max(1, (len(held_out) - prompt_tokens) // args.prompts)
    windows = demo_speculator.token_windows(held_out, prompt_tokens, stride)[: args.prompts]
    prompts = windows.shape[0]
    started = time.perf_counter()
    with fixed_threads(demo_model.PLAN.threads), demo_model.quiet_transformers():
        target = demo_speculator.load_target(model_dir)
        transcript = greedy_transcripts(target, windows, args.new_tokens)
    # As measure_acceptance: step t proposes from h_t and the token h_t produced, tokens[t+1].
    first, last = transcript.prompt_length - 1, transcript.hidden.shape[1] - n_predict
    hidden = transcript.hidden[:, first:last].reshape(-1, transcript.hidden.shape[-1])
    last_tokens = transcript.tokens[:, first + 1 : last + 1].reshape(-1)
    truth = torch.stack(
        [transcript.tokens[:, first + 2 + i : last + 2 + i] for i in range(n_predict)], dim=-1
    ).reshape(-1, n_predict)
    steps = hidden.shape[0]

    greedy = speculator.propose(hidden, last_tokens, n_predict)
    existing = Acceptance.from_matches(greedy == truth)  # the project's own measurement
    own_greedy = batched_tree(speculator, hidden, last_tokens, (1,) * n_predict, 1)[:, 0]
    result: dict[str, Any] = {
        "prompts": prompts,
        "steps": steps,
        "steps_per_prompt": steps // prompts,
        "n_predict": n_predict,
        "existing_mean_accepted": existing.mean_accepted,
        "existing_per_position": existing.per_position,
        "greedy_reproduced": bool(torch.equal(own_greedy, greedy)),
        "variants": {},
    }
    greedy_accepted = accepted_counts(greedy.unsqueeze(1), truth)[:, 0]
    for top_k in args.top_k:
        tree = batched_tree(speculator, hidden, last_tokens, top_k, max(KS) + 1)
        for name, candidates in (
            (f"tgis {','.join(map(str, top_k))}", tree[:, : max(KS)]),
            (f"greedy+tree {','.join(map(str, top_k))}", with_greedy_first(greedy, tree, max(KS))),
        ):
            accepted = accepted_counts(candidates, truth)
            depths = shared_depths(candidates)
            per_k: dict[int, dict] = {}
            for k in KS:
                best = accepted[:, :k].max(dim=1).values
                flat_rows = (n_predict + 1) + (n_predict - depths[:, 1:k]).sum(dim=1)
                gain = best - greedy_accepted
                rows = k * (n_predict + 1)
                per_k[k] = {
                    "accepted": cluster_bootstrap(best.float(), prompts).__dict__,
                    "accepted_std": best.float().std().item(),
                    "gain_vs_greedy": cluster_bootstrap(gain.float(), prompts, seed=1).__dict__,
                    "rows": rows,
                    "flat_rows_mean": flat_rows.float().mean().item(),
                    "flat_rows_median": int(flat_rows.median().item()),
                    "tgis_flattens_share": (flat_rows < FLATTEN_BELOW * rows).float().mean().item(),
                    "chain0_is_greedy": (candidates[:, 0] == greedy).all(dim=-1).float().mean().item(),
                }
                # A tree of the median flattened size, for timing: candidate j's shared depths.
                median = per_k[k]["flat_rows_median"]
                index = int(torch.nonzero(flat_rows.eq(median))[0, 0])
                per_k[k]["median_tree_depths"] = depths[index, :k].tolist()
            result["variants"][name] = per_k
    result["seconds"] = time.perf_counter() - started
    return result


# ---- the paged step ----------------------------------------------------------------------------------


@dataclass
class Bench:
    """A paged engine with `sequences` sequences of `context` positions cached, and for every sequence
    max(KS) - 1 private copies of its last, partly filled block (a candidate's own tail, as TGIS gives
    each child sequence)."""

    engine: Any  # engines.paged's PagedHFEngine
    context: int
    tables: list[list[tuple[int, ...]]]  # [sequence][candidate] block table
    last_tokens: list[int]


def load_bench(dtype: str, model_dir: Path, ids: torch.Tensor, context: int, n_predict: int) -> Bench:
    from engines.base import EngineConfig
    from engines.registry import load_engine

    with demo_model.quiet_transformers():
        engine: Any = load_engine(
            "hf_transformers", EngineConfig(model_path=model_dir, dtype=dtype, paged=True)
        )
    assert engine.spec.paged, "the demo model should serve with the paged step"
    sequences, candidates = max(CONCURRENCIES), max(KS)
    blocks_per_sequence = -(-(context + n_predict + 1) // BLOCK_SIZE)
    tail = context // BLOCK_SIZE  # the block that holds the newest token and the drafts
    engine.allocate(sequences * (blocks_per_sequence + candidates - 1), BLOCK_SIZE)
    tables, last_tokens, free = [], [], 0
    for s in range(sequences):
        own = tuple(range(free, free + blocks_per_sequence))
        free += blocks_per_sequence
        prompt = ids[s * (context + 1) : s * (context + 1) + context + 1].tolist()
        engine.step(StepBatch(prefill=(SequenceChunk(tuple(prompt[:context]), 0, own, sample=True),)))
        candidate_tables = [own]
        for _ in range(candidates - 1):
            copy = free
            free += 1
            for cache in (*engine._key_caches, *engine._value_caches):
                cache[copy].copy_(cache[own[tail]])
            candidate_tables.append((*own[:tail], copy, *own[tail + 1 :]))
        tables.append(candidate_tables)
        last_tokens.append(prompt[context])
    return Bench(engine, context, tables, last_tokens)


def gpt2_small_twin(directory: Path) -> Path:
    """GPT-2 small's shape (12 layers, width 768, 12 heads) with the demo tokenizer's 2048-token
    vocabulary and random weights, as the project's `gpt2-small` benchmark model: a step bound by
    reading its weights, as a real model's is. Saved once to `directory`."""
    if (directory / "config.json").exists():
        return directory
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=2048, n_positions=1024, n_embd=768, n_layer=12, n_head=12, bos_token_id=0, eos_token_id=0
    )
    with demo_model.quiet_transformers():
        GPT2LMHeadModel(config).eval().save_pretrained(directory)
    return directory


def step_batch(bench: Bench, sequences: int, k: int, n_predict: int, depths: list[int] | None) -> StepBatch:
    """A decode step as paged_runner builds it: `k` = 0 is speculation off (one token a sequence);
    otherwise each sequence verifies k chains of its newest token and n_predict draft tokens, each a
    chunk over its own block table, or, with `depths` (candidate j's shared draft prefix), the flattened
    tree: candidate 0 whole, every later one from its first token of its own."""
    decode, prefill = [], []
    for s in range(sequences):
        token = bench.last_tokens[s]
        if k == 0:
            decode.append(SequenceChunk((token,), bench.context, bench.tables[s][0], sample=True))
            continue
        for j in range(k):
            draft = tuple((token + 7 * (j + 1) + i) % 1000 + 1 for i in range(n_predict))
            skip = 0 if depths is None or j == 0 else 1 + depths[j]
            chunk_tokens = (token, *draft)[skip:]
            prefill.append(
                SequenceChunk(chunk_tokens, bench.context + skip, bench.tables[s][j], all_logits=True)
            )
    return StepBatch(decode=tuple(decode), prefill=tuple(prefill), hidden=True)


def check_candidate_tables(bench: Bench, n_predict: int) -> float:
    """Every candidate's first row (the newest token over the sequence's history) must give the same
    logits whichever copy of the tail block it reads: the largest deviation."""
    out = bench.engine.step(step_batch(bench, max(CONCURRENCIES), max(KS), n_predict, None))
    first_rows = out.logits[[rows.start for rows in out.chunk_rows]].view(max(CONCURRENCIES), max(KS), -1)
    return float((first_rows - first_rows[:, :1]).abs().max())


def measure_cost(args, acceptance: dict, model_dir: Path, speculator_dir: Path) -> dict:
    """Interleaved rounds over every (model, dtype, sequences, config); returns each round's medians."""
    n_predict = acceptance["n_predict"]
    ids = demo_speculator.corpus_ids(model_dir, held_out=True)
    ids = ids.repeat(-(-max(CONCURRENCIES) * (max(args.context, args.bench_context) + 1) // len(ids)))
    trees = {k: acceptance["variants"][args.variant_name][k]["median_tree_depths"] for k in KS}
    targets = [("demo", model_dir, args.dtypes, args.context, args.reps)]
    if args.bench:
        bench_dir = gpt2_small_twin(args.bench_dir)
        targets.append(("gpt2-small", bench_dir, ["bfloat16"], args.bench_context, args.bench_reps))
    configs = []  # (key (model, dtype, sequences, label), rows per sequence, reps, fn)
    checks = {}
    for model, directory, dtypes, context, reps in targets:
        for dtype in dtypes:
            bench = load_bench(dtype, directory, ids, context, n_predict)
            checks[f"{model} {dtype}"] = check_candidate_tables(bench, n_predict)
            engine = bench.engine
            for sequences in CONCURRENCIES:

                def add(label, rows, batch, reps=reps, e=engine, key=(model, dtype, sequences)):
                    configs.append(((*key, label), rows, reps, lambda: e.step(batch)))

                add("off", 1, step_batch(bench, sequences, 0, n_predict, None))
                for k in KS:
                    add(f"k{k}", k * (n_predict + 1), step_batch(bench, sequences, k, n_predict, None))
                    if k > 1:
                        depths = trees[k]
                        rows = (n_predict + 1) + sum(n_predict - d for d in depths[1:])
                        add(f"k{k} flat", rows, step_batch(bench, sequences, k, n_predict, depths))
                if model != "demo":
                    continue  # the demo speculator reads the demo model's states only
                speculator = load_mlp_speculator(speculator_dir, dtype=getattr(torch, dtype))
                states = torch.randn(sequences, speculator.config.emb_dim).to(getattr(torch, dtype))
                last = torch.tensor(bench.last_tokens[:sequences])
                key = (model, dtype, sequences)
                propose = functools.partial(speculator.propose, states, last, n_predict)
                tree = functools.partial(candidate_tree, speculator, states, last, args.top_k[0], max(KS))
                configs.append(((*key, "propose greedy"), 0, reps, propose))
                configs.append(((*key, "propose tree"), 0, reps, tree))
    # Configurations compared with one another (same model, dtype and sequence count) alternate step by
    # step, in a fresh shuffled order each pass, so that a ratio compares steps milliseconds apart: the
    # machine's drift and other processes' load fall on all of them alike.
    groups: dict[tuple, list] = {}
    for config in configs:
        groups.setdefault(config[0][:3], []).append(config)
    rng = random.Random(0)
    rounds: list[dict] = []
    loads = [load_average()]
    others: list[float] = []  # per round: the most CPU other processes took during one of its groups
    retried = 0
    started = time.perf_counter()

    def run_group(members) -> dict:
        samples: dict[tuple, list[float]] = {key: [] for key, _, _, _ in members}
        for repeat in range(members[0][2] + 1):  # the first pass warms up
            for key, _, _, fn in rng.sample(members, len(members)):
                begun = time.perf_counter()
                fn()
                if repeat:
                    samples[key].append(time.perf_counter() - begun)
        return {key: statistics.median(values) for key, values in samples.items()}

    def wait_for_quiet(deadline: float) -> None:
        """Sleep until other processes used under --max-others of the CPUs over one second."""
        while time.perf_counter() < deadline:
            counters = cpu_counters()
            time.sleep(1.0)
            if others_share(counters, cpu_counters()) <= args.max_others:
                return

    deadline = started + args.time_limit
    with torch.inference_mode():
        for number in range(args.rounds):
            if time.perf_counter() > deadline:
                print(f"time limit: {number} rounds", file=sys.stderr, flush=True)
                break
            timings, worst = {}, 0.0
            for group_key in rng.sample(list(groups), len(groups)):
                # On a 2-core machine shared with test runs, a group during which other processes took
                # more than --max-others of the CPUs is noise: wait for a quiet second and run it again.
                for attempt in range(args.retries + 1):
                    wait_for_quiet(deadline)
                    counters = cpu_counters()
                    measured = run_group(groups[group_key])
                    share = others_share(counters, cpu_counters())
                    if share <= args.max_others or attempt == args.retries or time.perf_counter() > deadline:
                        break
                    retried += 1
                timings.update(measured)
                worst = max(worst, share)
            rounds.append(timings)
            loads.append(load_average())
            others.append(worst)
            print(
                f"round {number + 1}/{args.rounds}: {time.perf_counter() - started:.0f} s, load {loads[-1]}, "
                f"other processes at most {worst:.0%} of the CPUs during a group, {retried} groups rerun",
                file=sys.stderr,
                flush=True,
            )
    return {
        "rounds": rounds,
        "rows": {key: rows for key, rows, _, _ in configs},
        "models": [(model, dtypes) for model, _, dtypes, _, _ in targets],
        "contexts": {model: context for model, _, _, context, _ in targets},
        "checks": checks,
        "loads": loads,
        "others": others,
        "retried": retried,
        "seconds": time.perf_counter() - started,
        "trees": trees,
    }


# ---- the report --------------------------------------------------------------------------------------


def spread(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    values = sorted(v * scale for v in values)
    return f"{statistics.median(values):.{digits}f} ({values[0]:.{digits}f}–{values[-1]:.{digits}f})"


def report(args, acceptance: dict, cost: dict | None) -> str:
    machine = machine_info()
    n_predict = acceptance["n_predict"]
    lines = [
        "# Several candidate draft chains per sequence: acceptance, step cost, tokens/s",
        "",
        f"Machine: {machine.cpu}, {os.cpu_count()} CPUs (flags: {machine.cpu_flags or 'none listed'}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"native bf16 (avx512_bf16/AMX): {'yes' if cpu_has_native_bf16() else 'no'}.",
        "",
        "## Acceptance (teacher-forced, greedy verification, demo model in float32)",
        "",
        f"{acceptance['prompts']} held-out prompts × {acceptance['steps_per_prompt']} decode steps = "
        f"{acceptance['steps']} steps; n_predict = {n_predict}. Accepted = draft tokens accepted per step "
        "(mean, 95 % interval from resampling prompts); gain = the same per step minus the greedy chain's "
        "(paired). The project's own measurement (`Acceptance.from_matches` on `MLPSpeculator.propose`): "
        f"{acceptance['existing_mean_accepted']:.3f}; the tree code with every head's top 1 reproduces "
        f"that chain: {'yes' if acceptance['greedy_reproduced'] else 'NO'}. 'tgis' keeps the k best-scored "
        "chains of the tree (TGIS's rule); 'greedy+tree' (not TGIS's) keeps the greedy chain first and "
        "the tree's best others after it. Chain 0 = greedy: share of steps whose first candidate is the "
        "greedy chain. TGIS flattens a step whose flattened/unflattened positions fall under "
        f"{FLATTEN_BELOW}.",
        "",
        "| candidates | k | accepted/step | gain vs greedy k=1 | chain 0 = greedy | rows k·(n+1) "
        "| rows flattened (mean) | flattened/unflattened |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, per_k in acceptance["variants"].items():
        for k in KS:
            v = per_k[k]
            accepted = Interval(**v["accepted"])
            gain = Interval(**v["gain_vs_greedy"])
            lines.append(
                f"| {name} | {k} | {accepted.text()} | {gain.text()} | {v['chain0_is_greedy']:.0%} | "
                f"{v['rows']} | {v['flat_rows_mean']:.1f} | {v['flat_rows_mean'] / v['rows']:.2f} |"
            )
    if cost is None:
        return "\n".join(lines)
    primary = acceptance["variants"][args.variant_name]
    greedy_accepted = acceptance["existing_mean_accepted"]
    quiet = [i for i, share in enumerate(cost["others"]) if share <= args.max_others]
    kept = quiet if len(quiet) >= 3 else list(range(len(cost["rounds"])))
    rounds = [cost["rounds"][i] for i in kept]
    contexts = ", ".join(f"{model} {context}" for model, context in cost["contexts"].items())
    lines += [
        "",
        "## Step cost and predicted tokens/s against k = 1",
        "",
        f"`PagedHFEngine.step` (loaded as the server loads it, paged=True), {len(rounds)} rounds kept of "
        f"{len(cost['rounds'])} ({'those' if kept == quiet else 'all, too few'} whose every group ran with "
        f"other processes under {args.max_others:.0%} of the CPUs); in each round, configurations compared "
        "with one another (same model, dtype and sequence count) alternate step by step in a shuffled "
        f"order: a warm-up pass, then {args.reps} timed steps each (gpt2-small: "
        f"{args.bench_reps}), median kept. Positions cached per sequence: {contexts}. "
        "A candidate is a chunk of n_predict + 1 positions over a block table whose last block is its "
        "private copy (TGIS's child sequences). Flattened: candidate 0 whole and every later candidate "
        "from its first token of its own, for a tree of the median flattened size "
        f"({args.variant_name}: shared draft prefixes {cost['trees']}). Cells: median over rounds "
        "(min–max). Time ratio and tokens/s ratio are per round against k = 1 (greedy chain) in the same "
        "round; tokens/s ratio = (1 + a_k)/T_k ÷ (1 + a_1)/T_1 with a_1 the greedy chain's acceptance "
        f"({greedy_accepted:.3f}) and a_k the best of k ({args.variant_name}); 'off' is no draft at all "
        "(1 token a step). '+ proposal' adds the demo speculator's time (its greedy chain for k = 1 and "
        "the tree for k > 1; nothing for off). gpt2-small is the benchmark model (GPT-2 "
        "small's shape, random weights, bound by its weights as real models are): its tokens/s ratio "
        "borrows the demo speculator's acceptance, a what-if.",
        "",
        f"Load average after each round: {', '.join(cost['loads'])}. Groups (one model, dtype and "
        f"sequence count) start after a second in which other processes took at most {args.max_others:.0%} "
        f"of the CPUs, and run again (up to {args.retries} times) when they took more while it ran "
        f"({cost.get('retried', 0)} reruns); "
        f"the most other processes took during a kept group, per round: "
        f"{', '.join(f'{x:.0%}' for x in cost['others'])}. "
        "Candidate-table check (max logit deviation between the candidates' first rows, which read the "
        "same history through different tail blocks): "
        + ", ".join(f"{d} {v:.2g}" for d, v in cost["checks"].items()),
        "",
        "| model | dtype | seqs | config | rows/seq | step ms | time ×k=1 | tokens/s ×k=1 | + proposal |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for model, dtypes in cost["models"]:
        for dtype in dtypes:
            for sequences in CONCURRENCIES:
                key = (model, dtype, sequences)
                base = [r[(*key, "k1")] for r in rounds]
                has_proposal = (*key, "propose greedy") in rounds[0]
                labels = ["off", *(f"k{k}{flat}" for k in KS for flat in ("", " flat")[: 1 + (k > 1)])]
                for label in labels:
                    times = [r[(*key, label)] for r in rounds]
                    ratio = [t / b for t, b in zip(times, base, strict=True)]
                    if label == "off":
                        gained, extra = 0.0, [0.0] * len(rounds)
                    else:
                        k = int(label.split()[0][1:])
                        gained = primary[k]["accepted"]["mean"] if k > 1 else greedy_accepted
                        name = "propose tree" if k > 1 else "propose greedy"
                        extra = [r[(*key, name)] for r in rounds] if has_proposal else [0.0] * len(rounds)
                    tokens = [
                        ((1 + gained) / t) / ((1 + greedy_accepted) / b)
                        for t, b in zip(times, base, strict=True)
                    ]
                    cell = "–"
                    if has_proposal:
                        greedy_prop = [r[(*key, "propose greedy")] for r in rounds]
                        with_prop = [
                            ((1 + gained) / (t + e)) / ((1 + greedy_accepted) / (b + p))
                            for t, b, e, p in zip(times, base, extra, greedy_prop, strict=True)
                        ]
                        cell = spread(with_prop)
                    lines.append(
                        f"| {model} | {dtype} | {sequences} | {label} | {cost['rows'][(*key, label)]} | "
                        f"{spread(times, 1000)} | {spread(ratio)} | {spread(tokens)} | {cell} |"
                    )
                if has_proposal:
                    greedy_prop = [r[(*key, "propose greedy")] for r in rounds]
                    tree_prop = [r[(*key, "propose tree")] for r in rounds]
                    lines.append(
                        f"| {model} | {dtype} | {sequences} | proposal ms, greedy / tree | | "
                        f"{spread(greedy_prop, 1000)} / {spread(tree_prop, 1000)} | | | |"
                    )
    lines += ["", f"Timing took {cost['seconds']:.0f} s, acceptance {acceptance['seconds']:.0f} s."]
    return "\n".join(lines)


def text_key(key: tuple) -> str:
    """A timing key (model, dtype, sequences, label) as a JSON object key: its parts joined by '|'."""
    return "|".join(map(str, key))


SAVED_PARAMS = ("rounds", "reps", "bench_reps", "max_others", "retries", "variant_name", "dtypes")


def report_from_json(args, path: Path) -> str:
    """The report of a saved run (keys back to tuples and ints); the machine line is this machine's."""
    raw = json.loads(path.read_text())
    for name, value in raw.get("params", {}).items():
        setattr(args, name, value)
    acceptance = raw["acceptance"]
    for name, per_k in acceptance["variants"].items():
        acceptance["variants"][name] = {int(k): v for k, v in per_k.items()}
    cost = raw.get("cost")
    if cost is not None:

        def key(text: str) -> tuple:
            model, dtype, sequences, label = text.split("|")
            return model, dtype, int(sequences), label

        cost["rounds"] = [{key(k): v for k, v in r.items()} for r in cost["rounds"]]
        cost["rows"] = {key(k): v for k, v in cost["rows"].items()}
    return report(args, acceptance, cost)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--prompts",
        type=int,
        default=62,
        help="held-out prompts (acceptance); the held-out text has about 2000 tokens: 62 prompts of 32 "
        "tokens do not overlap",
    )
    parser.add_argument(
        "--new-tokens", type=int, default=96, help="greedy tokens after each prompt (32 + 96 = the context)"
    )
    parser.add_argument(
        "--top-k",
        default="5,3,2,2;4,3,2,2",
        help="top_k_tokens_per_head sets, ';'-separated; the first is timed and combined",
    )
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--reps", type=int, default=15, help="timed steps per configuration and round")
    parser.add_argument("--context", type=int, default=70, help="positions cached per sequence")
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--max-others", type=float, default=0.10, help="rerun a group above this CPU share")
    parser.add_argument("--retries", type=int, default=6)
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds of timing at most")
    parser.add_argument(
        "--bench", action="store_true", help="also time the gpt2-small benchmark model (bf16)"
    )
    parser.add_argument("--bench-reps", type=int, default=5)
    parser.add_argument(
        "--bench-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "tgis-gpt2-small-twin"
    )
    parser.add_argument("--bench-context", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="smoke run: few prompts, rounds and reps")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    parser.add_argument("--from-json", type=Path, help="only print the report of a saved --json run")
    args = parser.parse_args()
    args.top_k = [tuple(int(x) for x in group.split(",")) for group in args.top_k.split(";")]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if "bfloat16" in args.dtypes and not cpu_has_native_bf16():
        print("no native bf16 on this CPU: timing float32 only", file=sys.stderr)
        args.dtypes = [d for d in args.dtypes if d != "bfloat16"] or ["float32"]
    if args.quick:
        args.prompts, args.rounds, args.reps, args.bench_reps = 16, 2, 3, 1
    args.variant_name = f"tgis {','.join(map(str, args.top_k[0]))}"
    if args.from_json:
        print(report_from_json(args, args.from_json))
        return

    model_dir = demo_model.ensure_demo_model()
    speculator_dir = demo_speculator.ensure_demo_speculator()
    speculator = load_mlp_speculator(speculator_dir)
    for top_k in args.top_k:
        if len(top_k) != speculator.config.n_predict:
            parser.error(f"--top-k {top_k}: one count per head ({speculator.config.n_predict} heads)")
    acceptance = measure_acceptance(args, speculator, model_dir)
    cost = None if args.no_timing else measure_cost(args, acceptance, model_dir, speculator_dir)
    print(report(args, acceptance, cost))
    if args.json:
        raw = {"acceptance": acceptance, "params": {name: getattr(args, name) for name in SAVED_PARAMS}}
        if cost is not None:
            raw["cost"] = {
                "rounds": [{text_key(key): value for key, value in r.items()} for r in cost["rounds"]],
                "rows": {text_key(key): value for key, value in cost["rows"].items()},
                "checks": cost["checks"],
                "models": cost["models"],
                "contexts": cost["contexts"],
                "seconds": cost["seconds"],
                "loads": cost["loads"],
                "others": cost["others"],
                "retried": cost["retried"],
                "trees": cost["trees"],
            }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(raw, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
