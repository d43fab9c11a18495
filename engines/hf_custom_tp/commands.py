"""Step commands rank 0 broadcasts to the other ranks, encoded as tensors (no pickling).

A command is an int64 header and payload; a prefill (or paged step) whose rows carry prompt-tuning
prefixes is followed by one float32 tensor holding every prefix row (float32 holds fp16/bf16 values
exactly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum

import torch
import torch.distributed as dist

from engines.base import PrefillRow, PrefixEmbeddings
from engines.hf_custom_tp.layers import Group, wait
from engines.step import SequenceChunk, StepBatch


class Op(IntEnum):
    PREFILL = 1
    DECODE = 2
    KEEP_ROWS = 3
    CLEAR = 4
    STOP = 5
    ALLOCATE = 6
    STEP = 7
    COPY_BLOCKS = 8


@dataclass(frozen=True)
class Prefill:
    rows: tuple[PrefillRow, ...]


@dataclass(frozen=True)
class Decode:
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class KeepRows:
    indices: tuple[int, ...]


@dataclass(frozen=True)
class Clear:
    pass


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Allocate:
    """Create every rank's KV blocks (the paged step)."""

    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class Step:
    """One paged step; every rank runs it over its own heads' KV blocks."""

    batch: StepBatch


@dataclass(frozen=True)
class CopyBlocks:
    """Copy KV blocks on every rank (a beam branching off another): (source, target) pairs."""

    pairs: tuple[tuple[int, int], ...]


Command = Prefill | Decode | KeepRows | Clear | Stop | Allocate | Step | CopyBlocks

HEADER_SIZE = 2  # op, payload length
# The PrefillRow fields a Prefill command carries; a row using any other field cannot be sent.
SENT_ROW_FIELDS = frozenset({"input_ids", "want_prompt_logits", "prefix"})


def _check_sendable(row: PrefillRow) -> None:
    for spec in fields(row):
        if spec.name not in SENT_ROW_FIELDS and getattr(row, spec.name) != spec.default:
            raise ValueError(f"hf_custom_tp cannot send PrefillRow.{spec.name} to its shards")


def _prefix_parts(row: PrefillRow) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if row.prefix is None else (row.prefix.decoder, row.prefix.encoder)


def _rows_of(part: torch.Tensor | None) -> int:
    return 0 if part is None else int(part.shape[0])


def encode(command: Command) -> tuple[Op, list[int], torch.Tensor | None]:
    """The op, its int64 payload, and the float32 prefix rows of a prefill (None when it has none)."""
    if isinstance(command, Prefill):
        rows = command.rows
        for row in rows:
            _check_sendable(row)
        parts = [_prefix_parts(row) for row in rows]
        # [n, len_i.., flag_i.., decoder_prefix_rows_i.., encoder_prefix_rows_i.., hidden, ids of each row]
        payload = [len(rows)] + [len(row.input_ids) for row in rows]
        payload += [int(row.want_prompt_logits) for row in rows]
        payload += [_rows_of(decoder) for decoder, _ in parts]
        payload += [_rows_of(encoder) for _, encoder in parts]
        present = [part for pair in parts for part in pair if part is not None]
        payload.append(int(present[0].shape[1]) if present else 0)
        for row in rows:
            payload += list(row.input_ids)
        floats = torch.cat([part.detach().cpu().float() for part in present]) if present else None
        return Op.PREFILL, payload, floats
    if isinstance(command, Step):
        return _encode_step(command.batch)
    if isinstance(command, Allocate):
        return Op.ALLOCATE, [command.num_blocks, command.block_size], None
    if isinstance(command, Decode):
        return Op.DECODE, list(command.token_ids), None
    if isinstance(command, KeepRows):
        return Op.KEEP_ROWS, list(command.indices), None
    if isinstance(command, CopyBlocks):
        return Op.COPY_BLOCKS, [block for pair in command.pairs for block in pair], None
    return (Op.CLEAR if isinstance(command, Clear) else Op.STOP), [], None


# Per chunk of a paged step: token count, start, block count, flags (sample, all_logits), prefix rows.
STEP_CHUNK_FIELDS = 5


def _encode_step(batch: StepBatch) -> tuple[Op, list[int], torch.Tensor | None]:
    """[decode chunks, chunks, hidden, fields of each chunk.., token ids.., block tables..]"""
    chunks = batch.chunks
    prefixes = [None if chunk.prefix is None else chunk.prefix.decoder for chunk in chunks]
    if any(chunk.lora is not None for chunk in chunks):
        raise ValueError("hf_custom_tp cannot send LoRA adapters to its shards")
    present = [prefix for prefix in prefixes if prefix is not None]
    payload = [len(batch.decode), len(chunks), int(present[0].shape[1]) if present else 0]
    for chunk, prefix in zip(chunks, prefixes, strict=True):
        flags = int(chunk.sample) | int(chunk.all_logits) << 1
        payload += [len(chunk.token_ids), chunk.start, len(chunk.block_table), flags, _rows_of(prefix)]
    for chunk in chunks:
        payload += chunk.token_ids
    for chunk in chunks:
        payload += chunk.block_table
    floats = torch.cat([prefix.detach().cpu().float() for prefix in present]) if present else None
    return Op.STEP, payload, floats


def _decode_step(payload: Sequence[int], floats: torch.Tensor | None) -> Step:
    decode_count, count, _ = payload[0], payload[1], payload[2]
    fields_of = [payload[3 + STEP_CHUNK_FIELDS * i : 3 + STEP_CHUNK_FIELDS * (i + 1)] for i in range(count)]
    ids_at = 3 + STEP_CHUNK_FIELDS * count
    tables_at = ids_at + sum(f[0] for f in fields_of)
    chunks, float_offset = [], 0
    for length, start, blocks, flags, prefix_rows in fields_of:
        prefix = None
        if prefix_rows:
            assert floats is not None
            prefix = PrefixEmbeddings(decoder=floats[float_offset : float_offset + prefix_rows])
            float_offset += prefix_rows
        ids, ids_at = tuple(payload[ids_at : ids_at + length]), ids_at + length
        table, tables_at = tuple(payload[tables_at : tables_at + blocks]), tables_at + blocks
        chunks.append(SequenceChunk(ids, start, table, bool(flags & 1), bool(flags & 2), prefix))
    return Step(StepBatch(tuple(chunks[:decode_count]), tuple(chunks[decode_count:])))


def prefix_shape(op: Op, payload: Sequence[int]) -> tuple[int, int] | None:
    """The [rows, hidden] float32 tensor that follows this payload, if any."""
    if op == Op.STEP:
        count = payload[1]
        total = sum(payload[3 + STEP_CHUNK_FIELDS * i + 4] for i in range(count))
        return (total, payload[2]) if total else None
    if op != Op.PREFILL:
        return None
    n = payload[0]
    total = sum(payload[1 + 2 * n : 1 + 4 * n])
    return (total, payload[1 + 4 * n]) if total else None


def decode(op: Op, payload: Sequence[int], floats: torch.Tensor | None = None) -> Command:
    """Rebuild a command; prefix rows come back as float32 CPU tensors (the shard casts and moves them)."""
    if op == Op.PREFILL:
        n = payload[0]
        lengths, flags = payload[1 : 1 + n], payload[1 + n : 1 + 2 * n]
        decoder_rows, encoder_rows = payload[1 + 2 * n : 1 + 3 * n], payload[1 + 3 * n : 1 + 4 * n]
        rows, offset, float_offset = [], 2 + 4 * n, 0

        def take(count: int) -> torch.Tensor | None:
            nonlocal float_offset
            if not count:
                return None
            assert floats is not None
            float_offset += count
            return floats[float_offset - count : float_offset]

        for length, flag, n_dec, n_enc in zip(lengths, flags, decoder_rows, encoder_rows, strict=True):
            decoder, encoder = take(n_dec), take(n_enc)
            prefix = PrefixEmbeddings(decoder, encoder) if n_dec or n_enc else None
            ids = tuple(payload[offset : offset + length])
            rows.append(PrefillRow(ids, want_prompt_logits=bool(flag), prefix=prefix))
            offset += length
        return Prefill(tuple(rows))
    if op == Op.STEP:
        return _decode_step(payload, floats)
    if op == Op.ALLOCATE:
        return Allocate(payload[0], payload[1])
    if op == Op.DECODE:
        return Decode(tuple(payload))
    if op == Op.KEEP_ROWS:
        return KeepRows(tuple(payload))
    if op == Op.COPY_BLOCKS:
        return CopyBlocks(tuple(zip(payload[0::2], payload[1::2], strict=True)))
    return Clear() if op == Op.CLEAR else Stop()


class CommandChannel:
    """Broadcasts commands from rank 0 over a gloo group; every other rank receives them in order."""

    def __init__(self, group: Group) -> None:
        self.group = group

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        wait(self.group.broadcast([tensor], options), "step command broadcast")

    def send(self, command: Command) -> None:
        op, payload, floats = encode(command)
        self._broadcast(torch.tensor([int(op), len(payload)], dtype=torch.long))
        if payload:
            self._broadcast(torch.tensor(payload, dtype=torch.long))
        if floats is not None:
            self._broadcast(floats.contiguous())

    def receive(self) -> Command:
        header = torch.zeros(HEADER_SIZE, dtype=torch.long)
        self._broadcast(header)
        op, size = Op(int(header[0])), int(header[1])
        payload = torch.zeros(size, dtype=torch.long)
        if size:
            self._broadcast(payload)
        values = payload.tolist()
        shape = prefix_shape(op, values)
        floats = None
        if shape is not None:
            floats = torch.zeros(shape, dtype=torch.float32)
            self._broadcast(floats)
        return decode(op, values, floats)
