"""Reads what a GGUF file says its weights are (`general.file_type`) from its header, with no llama.cpp."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

MAGIC = b"GGUF"
FILE_TYPE_KEY = "general.file_type"

# llama.cpp's llama_ftype values for the types a benchmark is likely to name; others print as numbers.
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    15: "Q4_K_M",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}

# GGUF metadata value types: fixed-size scalars by struct format, then string (8) and array (9).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def _read(stream: BinaryIO, fmt: str) -> int | float | bool:
    size = struct.calcsize("<" + fmt)
    data = stream.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    value: int | float | bool = struct.unpack("<" + fmt, data)[0]
    return value


def _string(stream: BinaryIO) -> bytes:
    length = int(_read(stream, "Q"))
    data = stream.read(length)
    if len(data) != length:
        raise ValueError("truncated GGUF header")
    return data


def _value(stream: BinaryIO, kind: int) -> object:
    if kind in _SCALARS:
        return _read(stream, _SCALARS[kind])
    if kind == _STRING:
        return _string(stream)
    if kind == _ARRAY:
        item, count = int(_read(stream, "I")), int(_read(stream, "Q"))
        if item in _SCALARS:  # skipped whole: only the file type is wanted
            stream.seek(struct.calcsize("<" + _SCALARS[item]) * count, 1)
            return None
        for _ in range(count):
            _value(stream, item)
        return None
    raise ValueError(f"unknown GGUF value type {kind}")


def file_type_id(path: Path) -> int | None:
    """`general.file_type` as stored (llama_ftype), or None when the header has no such key."""
    with path.open("rb") as stream:
        if stream.read(4) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = int(_read(stream, "I"))
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (counts were 32-bit)")
        _read(stream, "Q")  # tensor count
        for _ in range(int(_read(stream, "Q"))):
            key = _string(stream).decode()
            value = _value(stream, int(_read(stream, "I")))
            if key == FILE_TYPE_KEY:
                return int(value) if isinstance(value, int) else None
    return None


def file_type(path: Path) -> str:
    """`F32`, `BF16`, `Q8_0`...: what llama.cpp will run this file's weights in."""
    ident = file_type_id(path)
    if ident is None:
        return "unknown type"
    return FILE_TYPES.get(ident, f"file type {ident}")
