"""Paged attention ops against a naive reference: one sequence at a time, keys laid out contiguously."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import cpp_extension

from engines.paged import attention, cpu_kernel


def naive(query, keys, values, context, scale, window):
    """query [q, H, D] at positions context.., keys/values [k, Hkv, D]: explicit softmax(QK^T)V."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).float(), values.repeat_interleave(group, 1).float()
    out = torch.empty(query.shape)
    for i in range(query.shape[0]):
        position = context + i
        visible = [k for k in range(position + 1) if window is None or k > position - window]
        scores = torch.einsum("hd,khd->hk", query[i].float(), keys[visible]) * scale
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[visible])
    return out


def paged_cache(sequences, block_size, kv_heads, dim, dtype, generator):
    """Random keys/values per sequence, scattered over shuffled blocks; (caches, tables, contiguous)."""
    lengths = [len(s) for s in sequences]
    blocks_needed = [math.ceil(n / block_size) for n in lengths]
    total = sum(blocks_needed) + 3
    order = torch.randperm(total, generator=generator).tolist()
    key_cache = torch.zeros(total, block_size, kv_heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    tables, contiguous = [], []
    for length, needed in zip(lengths, blocks_needed, strict=True):
        table = [order.pop() for _ in range(needed)]
        keys = torch.randn(length, kv_heads, dim, generator=generator).to(dtype)
        values = torch.randn(length, kv_heads, dim, generator=generator).to(dtype)
        for p in range(length):
            key_cache[table[p // block_size], p % block_size] = keys[p]
            value_cache[table[p // block_size], p % block_size] = values[p]
        tables.append(table)
        contiguous.append((keys, values))
    width = max(blocks_needed)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return key_cache, value_cache, padded, contiguous


CASES = [  # heads, kv heads, sliding window
    (4, 4, None),
    (8, 2, None),
    (6, 1, 5),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), CASES)
@pytest.mark.parametrize("sequences", [1, 5])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_decode_attention_matches_the_naive_reference(
    monkeypatch, dtype, heads, kv_heads, window, sequences, path
):
    if path == "torch":
        monkeypatch.setattr(cpu_kernel, "decode_kernel", lambda: None)
    elif cpu_kernel.decode_kernel() is None:
        pytest.fail(
            "the CPU kernel must build on the test machine (compiler and ninja are test requirements)"
        )
    generator = torch.Generator().manual_seed(sequences * 100 + heads)
    lengths = [1, 7, 16, 33, 50][:sequences]
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(n) for n in lengths], 4, kv_heads, 16, dtype, generator
    )
    query = torch.randn(len(lengths), heads, 16, generator=generator).to(dtype)
    got = attention.decode_attention(
        query, key_cache, value_cache, tables, torch.tensor(lengths), 0.25, window
    )
    for i, (keys, values) in enumerate(contiguous):
        expected = naive(query[i : i + 1], keys, values, lengths[i] - 1, 0.25, window)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[i : i + 1].float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (8, 2, None), (4, 2, 90)])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_long_sequences_split_over_threads_match_the_naive_reference(dtype, heads, kv_heads, window, threads):
    """Fewer sequences than threads: each sequence's positions are cut into parts attended apart and
    merged (parts of 32 positions or more, some sequences too short to split, one empty of any); one
    thread is the unsplit case."""
    if cpu_kernel.decode_kernel() is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(heads * 10 + threads)
    lengths = [300, 129, 1] if threads == 4 else [300]  # 4 threads: up to 2 parts each; 2: a lone one in 2
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(n) for n in lengths], 16, kv_heads, 16, dtype, generator
    )
    query = torch.randn(len(lengths), heads, 16, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attention.decode_attention(
            query, key_cache, value_cache, tables, torch.tensor(lengths), 0.25, window
        )
    finally:
        torch.set_num_threads(previous)
    for i, (keys, values) in enumerate(contiguous):
        expected = naive(query[i : i + 1], keys, values, lengths[i] - 1, 0.25, window)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[i : i + 1].float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 4, None), (8, 2, None), (4, 2, 40)])
@pytest.mark.parametrize("threads", [1, 2])
def test_heads_of_64_and_128_match_the_naive_reference(dtype, head_dim, heads, kv_heads, window, threads):
    """Head sizes that are a multiple of 64 (GPT-2's 64, Llama's 128): in bfloat16 on a CPU with
    AVX512_BF16 the kernel attends them head by head (bfloat16 dot products, each head's sums kept in
    registers), elsewhere as every other size. Batched sequences of 1 to 100 positions, and a lone
    sequence of 100 cut into two parts on two threads; grouped query heads and a sliding window."""
    if cpu_kernel.decode_kernel() is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(head_dim + heads + threads)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for lengths in ([1, 7, 33, 100], [100]):
            key_cache, value_cache, tables, contiguous = paged_cache(
                [range(n) for n in lengths], 16, kv_heads, head_dim, dtype, generator
            )
            query = torch.randn(len(lengths), heads, head_dim, generator=generator).to(dtype)
            got = attention.decode_attention(
                query, key_cache, value_cache, tables, torch.tensor(lengths), 0.125, window
            )
            for i, (keys, values) in enumerate(contiguous):
                expected = naive(query[i : i + 1], keys, values, lengths[i] - 1, 0.125, window)
                torch.testing.assert_close(got[i : i + 1].float(), expected, atol=tolerance, rtol=tolerance)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [4, 20, 40, 80])
def test_head_sizes_off_the_vector_width_match_the_naive_reference(dtype, head_dim):
    """The kernel's vector loops (8 floats wide on AVX2, 16 on AVX512) leave a tail of a head's
    dimensions, and of a head's scores: 7 positions, 1, and 75 (a lone sequence on two threads, cut
    into parts of 38 and 37)."""
    if cpu_kernel.decode_kernel() is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(head_dim)
    lengths = [7, 75, 1]
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(n) for n in lengths], 16, 2, head_dim, dtype, generator
    )
    query = torch.randn(len(lengths), 6, head_dim, generator=generator).to(dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for i, (keys, values) in enumerate(contiguous):
            got = attention.decode_attention(
                query[i : i + 1],
                key_cache,
                value_cache,
                tables[i : i + 1],
                torch.tensor(lengths[i : i + 1]),
                0.25,
            )
            expected = naive(query[i : i + 1], keys, values, lengths[i] - 1, 0.25, None)
            torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), CASES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dim", [16, 64])
def test_the_fused_decode_layer_stores_the_new_keys_and_attends_like_the_reference(
    dtype, heads, kv_heads, window, threads, dim
):
    """decode_layer takes transformers' [1, heads, tokens, dim] views (transposed, not contiguous),
    stores every token's key and value at its slot, and attends each over its sequence's positions,
    the new one included: the same caches and outputs as write_kv followed by the naive reference.
    Heads of 64 take the bfloat16 head-by-head path on a CPU with AVX512_BF16."""
    kernel = cpu_kernel.decode_layer_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(heads * 10 + threads)
    lengths = [1, 7, 16, 70, 33]
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(n) for n in lengths], 4, kv_heads, dim, dtype, generator
    )
    tokens = len(lengths)

    def as_transformers_gives(heads: int) -> torch.Tensor:  # [1, heads, tokens, dim], a transposed view
        return torch.randn(1, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)

    query, key, value = (
        as_transformers_gives(heads),
        as_transformers_gives(kv_heads),
        as_transformers_gives(kv_heads),
    )
    slots = torch.tensor([tables[i, (n - 1) // 4].item() * 4 + (n - 1) % 4 for i, n in enumerate(lengths)])
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(
            query, key, value, key_cache, value_cache, slots, tables, torch.tensor(lengths), 0.25, window or 0
        )
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (tokens, heads, dim) and got.is_contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (keys, values) in enumerate(contiguous):
        slot = slots[i].item()
        assert torch.equal(key_cache.view(-1, kv_heads, dim)[slot], key[0, :, i])
        assert torch.equal(value_cache.view(-1, kv_heads, dim)[slot], value[0, :, i])
        keys, values = keys.clone(), values.clone()
        keys[-1], values[-1] = key[0, :, i], value[0, :, i]
        expected = naive(query[0, :, i][None], keys, values, lengths[i] - 1, 0.25, window)
        torch.testing.assert_close(got[i : i + 1].float(), expected, atol=tolerance, rtol=tolerance)


# What would reach outside the cache, as (changes to the valid call, the error it raises).
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "a slot": ({"slots": [8]}, "slot 8 is outside the cache"),
    "a block": ({"tables": [[2]]}, "block 2 is outside the cache"),
    "a negative block": ({"tables": [[-1]]}, "block -1 is outside the cache"),
    "a length": ({"lengths": [5]}, "length 5 does not fit its block table"),
    "a value cache": ({"value_blocks": 1}, "key and value caches must both be"),
    "the heads": ({"heads": 3, "kv_heads": 2}, "query heads must be a multiple of the cache's kv heads"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_fused_decode_layer_refuses_what_would_reach_outside_the_cache(case):
    """A slot, block or length past the cache, caches of different shapes, or query heads that do not
    group over the kv heads: refused with the reason, before anything is written."""
    kernel = cpu_kernel.decode_layer_kernel()
    if kernel is None:
        pytest.fail("the CPU kernel must build on the test machine")
    changes, message = REFUSED[case]
    kv_heads = changes.get("kv_heads", 1)
    key_cache = torch.zeros(2, 4, kv_heads, 8)
    value_cache = torch.zeros(changes.get("value_blocks", 2), 4, kv_heads, 8)
    query = torch.randn(1, changes.get("heads", 1), 1, 8)
    key = torch.randn(1, kv_heads, 1, 8)
    with pytest.raises(RuntimeError, match=message):
        kernel(
            query,
            key,
            key,
            key_cache,
            value_cache,
            torch.tensor(changes.get("slots", [1])),
            torch.tensor(changes.get("tables", [[0]])),
            torch.tensor(changes.get("lengths", [2])),
            1.0,
            0,
        )
    assert key_cache.abs().sum() == 0 and value_cache.abs().sum() == 0


@pytest.fixture
def fresh_kernel() -> Iterator[None]:
    """The kernels are built once per process (`kernels`): forget the build (or its failure) before
    and after."""
    cpu_kernel.kernels.cache_clear()
    yield
    cpu_kernel.kernels.cache_clear()


@pytest.mark.parametrize(("heads", "kv_heads", "window"), CASES)
def test_a_kernel_that_cannot_build_leaves_decode_to_torch(
    monkeypatch, caplog, fresh_kernel, heads, kv_heads, window
):
    """The build failing (no compiler, a compiler that cannot target this CPU): the warning says so and
    decode attention still matches the reference, through the torch path."""

    def failing_build(**kwargs: object) -> None:
        raise RuntimeError(f"Error building extension '{kwargs['name']}'")

    monkeypatch.setattr(cpp_extension, "load_inline", failing_build)
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert cpu_kernel.decode_kernel() is None
    assert "CPU paged-attention kernel unavailable" in caplog.text and "Error building" in caplog.text
    generator = torch.Generator().manual_seed(heads)
    lengths = [1, 7, 16, 33, 50]
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(n) for n in lengths], 4, kv_heads, 16, torch.bfloat16, generator
    )
    query = torch.randn(len(lengths), heads, 16, generator=generator).to(torch.bfloat16)
    got = attention.decode_attention(
        query, key_cache, value_cache, tables, torch.tensor(lengths), 0.25, window
    )
    for i, (keys, values) in enumerate(contiguous):
        expected = naive(query[i : i + 1], keys, values, lengths[i] - 1, 0.25, window)
        torch.testing.assert_close(got[i : i + 1].float(), expected, atol=2e-2, rtol=2e-2)


def test_a_kernel_build_is_named_for_the_cpus_extensions(monkeypatch, fresh_kernel):
    """Built with -march=native, a build found in a shared extension cache is reused only on a CPU with
    the same extensions: two AVX512 CPUs, one with AMX, get builds of their own."""
    names = []

    def recording_build(**kwargs: object) -> None:
        names.append(kwargs["name"])
        raise RuntimeError("not built in this test")

    monkeypatch.setattr(cpp_extension, "load_inline", recording_build)
    for extensions in ("avx2 avx512f avx512bw", "avx2 avx512f avx512bw amx_tile", "avx2 avx512f avx512bw"):
        monkeypatch.setattr(cpu_kernel, "cpu_extensions", lambda extensions=extensions: extensions)
        cpu_kernel.kernels.cache_clear()
        assert cpu_kernel.decode_kernel() is None
    assert names[0] != names[1] and names[0] == names[2]


def test_the_cpus_extensions_are_read_from_this_machine():
    extensions = cpu_kernel.cpu_extensions()
    assert extensions.strip()
    linux_x86 = Path("/proc/cpuinfo").exists() and torch.backends.cpu.get_cpu_capability().startswith("AVX")
    if linux_x86:  # torch found AVX2 or more: cpuinfo's flags name it
        assert "avx2" in extensions.split()


@pytest.mark.parametrize(("heads", "kv_heads", "window"), CASES)
def test_prefill_chunks_attend_their_cached_context_causally(heads, kv_heads, window):
    generator = torch.Generator().manual_seed(heads)
    lengths, contexts = [9, 20], [0, 12]  # the second chunk continues a sequence with 12 cached positions
    key_cache, value_cache, tables, contiguous = paged_cache(
        [range(c + n) for c, n in zip(contexts, lengths, strict=True)],
        4,
        kv_heads,
        8,
        torch.float32,
        generator,
    )
    query = torch.randn(sum(lengths), heads, 8, generator=generator)
    got = attention.prefill_attention(
        query,
        key_cache,
        value_cache,
        tables,
        [0, lengths[0]],
        lengths,
        contexts,
        0.5,
        window,
    )
    start = 0
    for (keys, values), length, context in zip(contiguous, lengths, contexts, strict=True):
        expected = naive(query[start : start + length], keys, values, context, 0.5, window)
        torch.testing.assert_close(got[start : start + length], expected, atol=1e-5, rtol=1e-5)
        start += length


def test_write_kv_stores_each_token_at_its_slot():
    key_cache = torch.zeros(3, 2, 1, 4)
    value_cache = torch.zeros_like(key_cache)
    keys = torch.arange(12.0).view(3, 1, 4)
    attention.write_kv(key_cache, value_cache, keys, -keys, torch.tensor([5, 0, 3]))  # block 2/1, 0/0, 1/1
    assert torch.equal(key_cache[2, 1, 0], keys[0, 0]) and torch.equal(value_cache[2, 1, 0], -keys[0, 0])
    assert torch.equal(key_cache[0, 0, 0], keys[1, 0]) and torch.equal(key_cache[1, 1, 0], keys[2, 0])
    assert key_cache[1, 0].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("dim", [16, 64])
def test_decode_over_a_shared_prefix_matches_the_naive_reference(dtype, heads, kv_heads, dim):
    """Sequences whose tables start with the same blocks (a cached prompt prefix) attend them in one
    batched pass, the rest through the kernel; merged, that is attention over every position. Heads
    of 64 take the bfloat16 head-by-head path (its parts starting after the prefix) where it exists."""
    if cpu_kernel.decode_kernel() is None:
        pytest.fail("the CPU kernel must build on the test machine")
    generator = torch.Generator().manual_seed(heads)
    block, prefix_blocks = 4, 3
    lengths = [13, 15, 20, 12 + 1]  # every sequence has its own positions after the 12 shared ones
    prefix = [torch.randn(prefix_blocks * block, kv_heads, dim, generator=generator) for _ in range(2)]
    own = [
        [torch.randn(n - prefix_blocks * block, kv_heads, dim, generator=generator) for _ in range(2)]
        for n in lengths
    ]
    total = prefix_blocks + sum(math.ceil(k.shape[0] / block) for k, _ in own) + 1
    order = torch.randperm(total, generator=generator).tolist()
    key_cache = torch.zeros(total, block, kv_heads, dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    shared_table = [order.pop() for _ in range(prefix_blocks)]

    def store(table, keys, values):
        for p in range(keys.shape[0]):
            key_cache[table[p // block], p % block] = keys[p].to(dtype)
            value_cache[table[p // block], p % block] = values[p].to(dtype)

    store(shared_table, *prefix)
    tables = []
    for keys, values in own:
        table = [order.pop() for _ in range(math.ceil(keys.shape[0] / block))]
        store(table, keys, values)
        tables.append(shared_table + table)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    query = torch.randn(len(lengths), heads, dim, generator=generator).to(dtype)
    args = (query, key_cache, value_cache, padded, torch.tensor(lengths), 0.25, None)
    split = attention.decode_attention(*args, shared_blocks=prefix_blocks)
    whole = attention.decode_attention(*args)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for i, (keys, values) in enumerate(own):
        contiguous_keys = torch.cat([prefix[0], keys]).to(dtype)
        contiguous_values = torch.cat([prefix[1], values]).to(dtype)
        expected = naive(query[i : i + 1], contiguous_keys, contiguous_values, lengths[i] - 1, 0.25, None)
        torch.testing.assert_close(split[i : i + 1].float(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(split.float(), whole.float(), atol=tolerance, rtol=tolerance)
