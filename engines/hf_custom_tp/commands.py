"""Step commands rank 0 broadcasts to the other ranks, encoded as int64 tensors (no pickling)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum

import torch
import torch.distributed as dist

from engines.base import PrefillRow
from engines.hf_custom_tp.layers import Group, wait


class Op(IntEnum):
    PREFILL = 1
    DECODE = 2
    KEEP_ROWS = 3
    CLEAR = 4
    STOP = 5


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


Command = Prefill | Decode | KeepRows | Clear | Stop

HEADER_SIZE = 2  # op, payload length
# The PrefillRow fields a Prefill command carries; a row using any other field cannot be sent yet.
SENT_ROW_FIELDS = frozenset({"input_ids", "want_prompt_logits"})


def _check_sendable(row: PrefillRow) -> None:
    for spec in fields(row):
        if spec.name not in SENT_ROW_FIELDS and getattr(row, spec.name) != spec.default:
            raise ValueError(f"hf_custom_tp cannot send PrefillRow.{spec.name} to its shards")


def encode(command: Command) -> tuple[Op, list[int]]:
    """The op and its int64 payload."""
    if isinstance(command, Prefill):
        rows = command.rows
        for row in rows:
            _check_sendable(row)
        # [n, len_0..len_{n-1}, flag_0..flag_{n-1}, ids of row 0, ids of row 1, ...]
        payload = [len(rows)] + [len(row.input_ids) for row in rows]
        payload += [int(row.want_prompt_logits) for row in rows]
        for row in rows:
            payload += list(row.input_ids)
        return Op.PREFILL, payload
    if isinstance(command, Decode):
        return Op.DECODE, list(command.token_ids)
    if isinstance(command, KeepRows):
        return Op.KEEP_ROWS, list(command.indices)
    return (Op.CLEAR if isinstance(command, Clear) else Op.STOP), []


def decode(op: Op, payload: Sequence[int]) -> Command:
    if op == Op.PREFILL:
        n = payload[0]
        lengths, flags = payload[1 : 1 + n], payload[1 + n : 1 + 2 * n]
        rows, offset = [], 1 + 2 * n
        for length, flag in zip(lengths, flags, strict=True):
            rows.append(PrefillRow(tuple(payload[offset : offset + length]), want_prompt_logits=bool(flag)))
            offset += length
        return Prefill(tuple(rows))
    if op == Op.DECODE:
        return Decode(tuple(payload))
    if op == Op.KEEP_ROWS:
        return KeepRows(tuple(payload))
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
        op, payload = encode(command)
        self._broadcast(torch.tensor([int(op), len(payload)], dtype=torch.long))
        if payload:
            self._broadcast(torch.tensor(payload, dtype=torch.long))

    def receive(self) -> Command:
        header = torch.zeros(HEADER_SIZE, dtype=torch.long)
        self._broadcast(header)
        op, size = Op(int(header[0])), int(header[1])
        payload = torch.zeros(size, dtype=torch.long)
        if size:
            self._broadcast(payload)
        return decode(op, payload.tolist())
