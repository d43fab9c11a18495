"""The paged step's attention paths side by side on this device: one layer's attention for decode steps
and a mixed step, per path, against the kernel's torch stand-in (engines/paged/varlen.py).

Paths: varlen_paged (keys read in place, at the block sizes this torch's kernel takes), varlen_gathered
(one gather per layer, then the packed kernel), per_sequence (torch alone), and flex: FlexAttention
decoding compiled by torch.compile, with the pool as one key sequence and a block mask of each
sequence's full blocks plus its last, partial one (decode steps only; a candidate, not a served path).
On CUDA the times are the kernels' (CUDA events, the median of --runs), decode steps also with the
causal window (-1, 0) the engine passed before (it keeps FlashAttention from packing grouped-query
heads when every query is alone); on a CPU there is no varlen
kernel, so it times what runs there (the gather, the per-sequence path, flex compiled for the CPU) and
each path's host time to lay out a step (step_context.build), which a GPU pays too.

    python scripts/attention_paths.py                 # a CPU: small shapes
    python scripts/attention_paths.py --full          # the GPU shapes: 1-128 sequences, 256-2048 positions
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import torch

from engines.paged import paths, ragged, step_context, varlen
from engines.paged.staging import Staging
from engines.paged.step_context import AttentionPath
from engines.step import SequenceChunk, StepBatch

HEADS, KV_HEADS, DIM = 32, 8, 128  # a llama-3-8B layer


def batch(sequences: int, context: int, block_size: int, prompt: int = 0) -> StepBatch:
    """`sequences` decode tokens at `context` positions each (own blocks), and a prompt chunk."""
    per = -(-(context + 1) // block_size)
    decode = tuple(
        SequenceChunk((1,), context, tuple(range(i * per, (i + 1) * per)), sample=True)
        for i in range(sequences)
    )
    if not prompt:
        return StepBatch(decode=decode)
    start = sequences * per
    blocks = tuple(range(start, start + -(-prompt // block_size)))
    return StepBatch(decode=decode, prefill=(SequenceChunk(tuple(range(prompt)), 0, blocks, sample=True),))


def pool(step: StepBatch, block_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    blocks = max(max(c.block_table) for c in step.chunks) + 2
    return torch.randn(blocks, block_size, KV_HEADS, DIM, dtype=dtype, device=device)


def timed(run: Callable[[], torch.Tensor], runs: int, device: torch.device) -> float:
    """Milliseconds of one call, the median of `runs` after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def layout(path: AttentionPath, step: StepBatch, keys: torch.Tensor, kernel: varlen.Kernel):
    builder = step_context.StepBuilder(
        path,
        keys.shape[1],
        [keys],
        [keys],
        Staging(keys.device),
        kernel,
        lambda positions: ragged.Workspace.empty(positions, keys),
    )
    return step_context.build(step, builder).context


def flex_decode(
    step: StepBatch, keys: torch.Tensor, values: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """FlexAttention over the pool in place for a decode-only step: query [N, H, D] -> [N, H, D]."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    size, pages = keys.shape[1], keys.shape[0]
    count, device = len(step.decode), keys.device
    full = torch.zeros(count, 1, 1, pages, dtype=torch.int32)
    last = torch.zeros(count, 1, 1, pages, dtype=torch.int32)
    full_count = torch.zeros(count, 1, 1, dtype=torch.int32)
    last_length = torch.zeros(count, dtype=torch.int32)
    for i, chunk in enumerate(step.decode):
        used = -(-chunk.end // size)
        full[i, 0, 0, : used - 1] = torch.tensor(chunk.block_table[: used - 1], dtype=torch.int32)
        last[i, 0, 0, 0] = chunk.block_table[used - 1]
        full_count[i] = used - 1
        last_length[i] = chunk.end - (used - 1) * size
    last_length = last_length.to(device)

    def partial(b, h, q_idx, kv_idx):
        return kv_idx % size < last_length[b]

    mask = BlockMask.from_kv_blocks(
        torch.ones(count, 1, 1, dtype=torch.int32, device=device),
        last.to(device),
        full_count.to(device),
        full.to(device),
        BLOCK_SIZE=(1, size),
        mask_mod=partial,
        seq_lengths=(1, pages * size),
        compute_q_blocks=False,
    )
    pooled_keys = keys.view(1, pages * size, KV_HEADS, DIM).transpose(1, 2)
    pooled_values = values.view(1, pages * size, KV_HEADS, DIM).transpose(1, 2)
    compiled = torch.compile(flex_attention)

    def attend(query: torch.Tensor) -> torch.Tensor:
        out = compiled(query[:, :, None, :], pooled_keys, pooled_values, block_mask=mask, enable_gqa=True)
        return out[:, :, 0, :]

    return attend


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-6))


def measure(
    step: StepBatch, block_size: int, device: torch.device, dtype: torch.dtype, runs: int
) -> list[str]:
    keys, values = pool(step, block_size, dtype, device), pool(step, block_size, dtype, device)
    query = torch.randn(step.num_tokens, HEADS, DIM, dtype=dtype, device=device)
    scale = DIM**-0.5
    on_cuda = device.type == "cuda"
    offer = varlen.offer(device)
    reference_layout = layout(AttentionPath.VARLEN_PAGED, step, keys, varlen.reference_varlen).ragged
    assert reference_layout is not None
    want = ragged.attention(query, keys, values, reference_layout, scale)
    rows = []
    candidates = [AttentionPath.VARLEN_GATHERED, AttentionPath.PER_SEQUENCE]
    if offer.paged:
        candidates.insert(0, AttentionPath.VARLEN_PAGED)
    for path in candidates:
        kernel = varlen.flash_varlen if on_cuda else varlen.reference_varlen
        if path.varlen and on_cuda:
            why = paths.probe(path, block_size, paths.Geometry(HEADS, KV_HEADS, DIM, dtype, False), device)
            if why is not None:
                rows.append(f"| {path} | {block_size} | refused: {why[:60]} | | |")
                continue
        context = layout(path, step, keys, kernel)
        host = _host_ms(functools.partial(layout, path, step, keys, kernel), runs)
        run = _runner(context, query, keys, values, scale, on_cuda)
        if run is None:
            rows.append(f"| {path} | {block_size} | no kernel on {device.type} | {host:.3f} | |")
            continue
        got = run()
        check = f"{relative(got, want):.1e}" if got.shape == want.shape else "the gather alone"
        rows.append(f"| {path} | {block_size} | {timed(run, runs, device):.3f} | {host:.3f} | {check} |")
        if on_cuda and context.ragged is not None and not step.prefill:  # window (-1, 0), as before
            causal = dataclasses.replace(context.ragged, causal=True)
            ms = timed(functools.partial(ragged.attention, query, keys, values, causal, scale), runs, device)
            rows.append(f"| {path}, causal window (-1, 0) | {block_size} | {ms:.3f} | | |")
    if not step.prefill:
        try:
            attend = flex_decode(step, keys, values)
            got = attend(query)
            ms = timed(lambda: attend(query), runs, device)
        except Exception as exc:  # inductor's flex templates fail to compile for some shapes
            rows.append(f"| flex (compiled) | {block_size} | failed: {str(exc).splitlines()[0][:70]} | | |")
        else:
            rows.append(f"| flex (compiled) | {block_size} | {ms:.3f} | | {relative(got, want):.1e} |")
    return rows


def _host_ms(build: Callable[[], object], runs: int) -> float:
    """Milliseconds of host time to lay a step out, the median of `runs` after one warm-up."""
    build()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        build()
        times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _runner(context, query, keys, values, scale, on_cuda: bool) -> Callable[[], torch.Tensor] | None:
    """One layer's attention as the step runs it; on a CPU the varlen paths' gather alone."""
    step_layout = context.ragged
    if step_layout is None:
        return _per_sequence(context, query, keys, values, scale)
    if on_cuda:
        return lambda: ragged.attention(query, keys, values, step_layout, scale)
    if step_layout.gather is None or step_layout.workspace is None:
        return None
    gather, space = step_layout.gather, step_layout.workspace
    flat = keys.view(-1, KV_HEADS, DIM)
    return lambda: torch.index_select(flat, 0, gather, out=space.keys[: len(gather)])


def _per_sequence(context, query, keys, values, scale) -> Callable[[], torch.Tensor]:
    """The per-sequence path over caches that already hold the keys (no write)."""
    from engines.paged import forward

    def run() -> torch.Tensor:
        decode = context.num_decode
        out = torch.empty_like(query)
        if decode:
            out[:decode] = forward._attend_decode_tokens(context, query[:decode], keys, values, scale, None)
        if decode < query.shape[0]:
            out[decode:] = forward._attend_prompt_chunks(context, query[decode:], keys, values, scale, None)
        return out

    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="the GPU shapes (slow on a CPU)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads (1: a shared machine's thread wake-ups stay out)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    offer = varlen.offer(device)
    sizes = [16] + ([256] if offer.paged else [])
    shapes = [(1, 256, 0), (16, 256, 0), (16, 2048, 0), (64, 2048, 0), (128, 2048, 0), (32, 512, 512)]
    if not args.full:
        shapes = [(1, 256, 0), (8, 256, 0), (8, 512, 128)]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(
        f"torch {torch.__version__} on {device} ({name}), {dtype}, {HEADS} heads, {KV_HEADS} key/value "
        f"heads, head size {DIM}; kernel offer: {offer}"
    )
    for sequences, context, prompt in shapes:
        for size in sizes:
            step = batch(sequences, context, size, prompt)
            print(
                f"\n{sequences} decode tokens at {context} positions"
                + (f" + a {prompt}-token prompt" if prompt else "")
            )
            print("| path | block | ms per layer | host ms (layout) | deviation |\n|---|---:|---:|---:|---:|")
            print("\n".join(measure(step, size, device, dtype, args.runs)))


if __name__ == "__main__":
    main()
