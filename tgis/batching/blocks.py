"""The KV block pool: free blocks in eviction order, reference counts and the prefix-cache index; pure Python.

The engine owns the tensors behind the blocks; this module only decides which block ids hold what.
A block that no sequence references any more stays in the pool with its content hash, so a later
request whose prompt starts with the same tokens (under the same adapter) can take it instead of
recomputing it, until the block is evicted (least recently freed first) to make room.

Every operation costs what it touches (its blocks), never the size of the pool: usage is a pair of
counters kept as blocks change hands, so a pool of a million blocks (a large GPU) costs a step
what a pool of a thousand does.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes


class OutOfBlocksError(RuntimeError):
    """More blocks were asked for than the pool has free (admission should have prevented it)."""


def chain_start(cache_key: str | None) -> BlockHash:
    """The hash a sequence's first block is chained to: blocks computed under a different prompt-tuning
    prefix or LoRA adapter hold different keys and values for the same token ids, so they never match."""
    return hashlib.sha256(b"tgis-kv\0" + (cache_key or "").encode()).digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The content hash of a full block: its tokens, chained to every block before it.

    sha256 rather than Python's hash: a collision would hand one request another's keys and values.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def full_block_hashes(
    token_ids: Sequence[int], block_size: int, cache_key: str | None, known: Sequence[BlockHash] = ()
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, reusing the `known` leading ones."""
    hashes = list(known)
    parent = hashes[-1] if hashes else chain_start(cache_key)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class PoolUsage:
    total: int
    used: int  # referenced by at least one sequence
    cached: int  # unreferenced but holding a reusable prefix


class BlockPool:
    """`num_blocks` blocks of `block_size` token positions each."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a block pool needs blocks and positions: {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        # Unreferenced blocks, the next one to hand out first: never-used blocks, then cached ones from
        # the least recently freed on.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free = 0  # blocks in `_free` that hold a registered prefix

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (cached ones are evicted on demand)."""
        return len(self._free)

    def usage(self) -> PoolUsage:
        return PoolUsage(self.num_blocks, self.num_blocks - len(self._free), self._cached_free)

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, each referenced once; evicts cached content to make room."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            if self._hashes[block] is not None:
                self._cached_free -= 1
            self._forget(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A sequence's blocks are released last-first, so that its
        tail, which other prompts are least likely to share, is evicted before its head."""
        for block in reversed(blocks):
            refs = self._refs[block]
            if refs <= 0:
                raise ValueError(f"KV block {block} freed more often than it was taken")
            self._refs[block] = refs - 1
            if refs == 1:
                self._free[block] = None
                if self._hashes[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing worth keeping: reuse it first
                else:
                    self._cached_free += 1

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks holding the longest run of `hashes` from the start (not yet referenced)."""
        if not self.prefix_caching:
            return []
        blocks = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take(self, blocks: Sequence[int]) -> None:
        """Reference cached blocks found by `cached_prefix` (removing them from eviction)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
                self._cached_free -= 1  # only registered blocks are found by `cached_prefix`
            self._refs[block] += 1

    def register(self, block: int, digest: BlockHash) -> None:
        """Record that `block` is full and holds the content `digest` names."""
        if not self.prefix_caching or self._hashes[block] is not None or digest in self._by_hash:
            return  # a block computed twice in one step stays private; the first copy is the cached one
        self._hashes[block] = digest
        self._by_hash[digest] = block
        if self._refs[block] == 0:
            self._cached_free += 1

    def refs(self, block: int) -> int:
        return self._refs[block]

    def _forget(self, block: int) -> None:
        digest = self._hashes[block]
        if digest is not None:
            del self._by_hash[digest]
            self._hashes[block] = None
