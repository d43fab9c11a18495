"""The paged step planner: which tokens of which sequences the next forward computes, in which KV blocks.

Pure Python. Every step holds the next token of every decoding sequence, then prompt chunks of
sequences still being prefilled, in admission order, up to the step's token budget (chunked prefill:
a long prompt is spread over several steps instead of stalling the running streams). Admission
follows SPEC §6.3 with weights counted in KV blocks (`BlockWeights`), reserving each sequence's
worst case, so the pool can never run dry mid-generation and no sequence is ever preempted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tgis.batching.admission import SequenceShape, exceeds
from tgis.batching.blocks import BlockHash, BlockPool, full_block_hashes


@dataclass(frozen=True)
class BlockWeights:
    """SPEC §6.4's weights in KV blocks: a sequence of n positions holds ⌈n / block_size⌉ blocks.

    Prefill weight and padding are 0: a prompt is computed in chunks within the step budget, so its
    activations never depend on its length, and nothing is padded.
    """

    block_size: int
    max_weight: float  # blocks admission may reserve
    max_prefill_padding: float = 1.0

    def blocks(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def worst(self, batch: Sequence[SequenceShape]) -> float:
        return sum(self.blocks(s.input_length + s.remaining_new_tokens) for s in batch)

    def initial(self, batch: Sequence[SequenceShape]) -> float:
        return sum(self.blocks(s.input_length) for s in batch)

    def prefill(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def padding(self, group: Sequence[SequenceShape]) -> float:
        return 0.0

    def granular_fits(self, batch: Sequence[SequenceShape], candidate: SequenceShape) -> bool:
        """Walk the sequences by remaining output, longest first: when the i-th of them finishes, the
        i + 1 still running each hold their input plus that many more positions."""
        shapes = sorted((*batch, candidate), key=lambda s: s.remaining_new_tokens, reverse=True)
        for i, shape in enumerate(shapes):
            out = shape.remaining_new_tokens
            if out <= candidate.remaining_new_tokens:
                held = sum(self.blocks(s.input_length + out) for s in shapes[: i + 1])
                if exceeds(held, self.max_weight):
                    return False
        return True


@dataclass
class PagedSequence:
    """One admitted sequence as the planner sees it: its known tokens and the blocks that hold them.

    `token_ids` are the cache positions: prompt-tuning prefix slots (the pad id; the engine writes the
    prefix embeddings there), the input ids, then generated tokens, the newest of which is not yet
    computed. `computed` positions have their keys and values in `blocks`.
    """

    seq_id: int
    token_ids: list[int]
    prompt_length: int
    max_new_tokens: int
    cache_key: str | None = None  # adapter the keys and values depend on
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)  # of the leading full, computed blocks

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt_length

    @property
    def pending(self) -> int:
        """Positions known but not computed yet."""
        return len(self.token_ids) - self.computed

    def shape(self) -> SequenceShape:
        generated = len(self.token_ids) - self.prompt_length
        return SequenceShape(len(self.token_ids), self.max_new_tokens - generated)


@dataclass(frozen=True)
class Chunk:
    """Positions `start .. start + length - 1` of one sequence, computed in this step."""

    seq_id: int
    start: int
    length: int
    samples: bool  # the chunk reaches the sequence's newest token: its logits pick the next one
    block_table: tuple[int, ...]
    draft: tuple[int, ...] = ()  # proposed tokens after the newest, verified in this step
    decoding: bool = False  # a decoding sequence's newest token (and draft), not prompt positions


@dataclass(frozen=True)
class StepPlan:
    """One step: decode chunks first (in `decode_order`), then prefill chunks."""

    chunks: tuple[Chunk, ...]

    @property
    def tokens(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    @property
    def sampling(self) -> tuple[Chunk, ...]:
        return tuple(chunk for chunk in self.chunks if chunk.samples)


@dataclass(frozen=True)
class CacheLookup:
    """What admission found in the prefix cache for one prompt (for the hit-rate metrics)."""

    queried_tokens: int
    hit_tokens: int


class PagedPlanner:
    """Owns the running sequences' block bookkeeping and plans each step."""

    def __init__(self, pool: BlockPool, max_step_tokens: int) -> None:
        self.pool = pool
        self.max_step_tokens = max_step_tokens
        self._sequences: dict[int, PagedSequence] = {}
        # Decoding sequences in the order their logits rows come (the sampler mirrors it).
        self.decode_order: list[int] = []
        self._prefilling: list[int] = []  # admission order

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def prefilling(self) -> int:
        """Sequences whose prompt is not computed yet."""
        return len(self._prefilling)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._sequences

    def sequence(self, seq_id: int) -> PagedSequence:
        return self._sequences[seq_id]

    def sequences(self) -> list[PagedSequence]:
        return list(self._sequences.values())

    def shapes(self) -> list[SequenceShape]:
        return [seq.shape() for seq in self._sequences.values()]

    def add(self, seq: PagedSequence, *, use_cached: bool = True) -> CacheLookup:
        """Admit a sequence; its longest cached prefix of full blocks is taken instead of computed.

        At least the last prompt position is always computed, since its logits choose the first
        token, so a prompt is never served from the cache whole.
        """
        if seq.seq_id in self._sequences:
            raise ValueError(f"sequence {seq.seq_id} is already running")
        hits: list[int] = []
        if use_cached and self.pool.prefix_caching:
            cacheable = seq.token_ids[: seq.prompt_length - 1]
            hashes = full_block_hashes(cacheable, self.block_size, seq.cache_key)
            hits = self.pool.cached_prefix(hashes)
            self.pool.take(hits)
            seq.hashes = hashes[: len(hits)]
        seq.blocks = list(hits)
        seq.computed = len(hits) * self.block_size
        self._sequences[seq.seq_id] = seq
        self._prefilling.append(seq.seq_id)
        return CacheLookup(queried_tokens=seq.prompt_length, hit_tokens=seq.computed)

    def plan(
        self, prompt_cap: int | None = None, drafts: Mapping[int, Sequence[int]] | None = None
    ) -> StepPlan:
        """Every decoding sequence's newest token (with its `drafts`, proposed tokens to verify), then
        prompt chunks within the token budget and `prompt_cap` (the prompt tokens a step may add to
        the decodes' time: `PromptBudget`). A draft never reaches past the positions admission
        reserved for the sequence."""
        drafts = drafts or {}
        chunks = [self._decode_chunk(self._sequences[i], drafts.get(i, ())) for i in self.decode_order]
        decode_tokens = sum(chunk.length for chunk in chunks)
        room = max(self.max_step_tokens - decode_tokens, 1)  # prompts always advance, however many decode
        if prompt_cap is not None:
            room = min(room, prompt_cap)
        for seq_id in self._prefilling:
            if room <= 0:
                break
            seq = self._sequences[seq_id]
            length = min(seq.pending, room)
            chunks.append(self._chunk(seq, length))
            room -= length
        return StepPlan(tuple(chunks))

    def _chunk(self, seq: PagedSequence, length: int) -> Chunk:
        end = seq.computed + length
        self._cover(seq, end)
        return Chunk(seq.seq_id, seq.computed, length, end == len(seq.token_ids), tuple(seq.blocks))

    def _decode_chunk(self, seq: PagedSequence, draft: Sequence[int]) -> Chunk:
        draft = tuple(draft[: max(seq.shape().remaining_new_tokens - 1, 0)])
        length = seq.pending + len(draft)
        self._cover(seq, seq.computed + length)
        return Chunk(seq.seq_id, seq.computed, length, True, tuple(seq.blocks), draft, decoding=True)

    def _cover(self, seq: PagedSequence, end: int) -> None:
        """Blocks for every position before `end`."""
        missing = -(-end // self.block_size) - len(seq.blocks)
        if missing > 0:
            seq.blocks.extend(self.pool.allocate(missing))

    def computed(self, plan: StepPlan) -> list[int]:
        """Record that the plan ran: advance each sequence and publish its newly full blocks to the
        prefix cache. Returns the sequences whose prompt is now complete, in plan order (they start
        decoding, after the current decode order)."""
        started = []
        for chunk in plan.chunks:
            seq = self._sequences.get(chunk.seq_id)
            if seq is None:
                continue  # finished or cancelled in the meantime
            was_prefilling = seq.prefilling
            seq.computed = chunk.start + chunk.length - len(chunk.draft)  # drafts count once accepted
            self._publish_full_blocks(seq)
            if was_prefilling and not seq.prefilling:
                self._prefilling.remove(seq.seq_id)
                self.decode_order.append(seq.seq_id)
                started.append(seq.seq_id)
        return started

    def append_tokens(self, seq_id: int, token_ids: Sequence[int], accepted_drafts: int) -> None:
        """A verified step's tokens: the first `accepted_drafts` were the draft, whose keys and values
        this step wrote; the last is new and is computed in the next step. The keys and values of the
        rejected draft positions are simply overwritten later; blocks that only they used go back."""
        seq = self._sequences[seq_id]
        seq.computed += accepted_drafts
        seq.token_ids.extend(token_ids)
        self._publish_full_blocks(seq)
        needed = -(-len(seq.token_ids) // self.block_size)
        if len(seq.blocks) > needed:
            spare, seq.blocks = seq.blocks[needed:], seq.blocks[:needed]
            self.pool.free(spare)

    def fork(self, parent_id: int, child_id: int) -> tuple[int, int] | None:
        """A new decoding sequence `child_id` that shares every computed position of `parent_id` (a beam
        branching off another): it references the parent's full blocks instead of copying them, and
        gets a fresh copy of the parent's last, partly filled block, which both will write their next
        positions into. Returns (source block, copy) for the engine to copy, None when the computed
        positions end on a block boundary. Only a decoding sequence whose positions are all computed
        forks."""
        parent = self._sequences[parent_id]
        if child_id in self._sequences:
            raise ValueError(f"sequence {child_id} is already running")
        if parent.prefilling or parent.pending:
            raise ValueError(f"sequence {parent_id} has positions not computed yet: it cannot fork")
        full = parent.computed // self.block_size
        shared = parent.blocks[:full]
        partial = parent.blocks[full : -(-parent.computed // self.block_size)]
        copy = self.pool.allocate(len(partial))  # first: nothing changes if the pool is out of blocks
        self.pool.take(shared)
        child = PagedSequence(
            seq_id=child_id,
            token_ids=list(parent.token_ids),
            prompt_length=parent.prompt_length,
            max_new_tokens=parent.max_new_tokens,
            cache_key=parent.cache_key,
            computed=parent.computed,
            blocks=[*shared, *copy],
            hashes=list(parent.hashes),
        )
        self._sequences[child_id] = child
        self.decode_order.append(child_id)
        return (partial[0], copy[0]) if partial else None

    def finish(self, seq_id: int) -> None:
        """Drop a sequence (finished, cancelled or failed) and release its blocks."""
        seq = self._sequences.pop(seq_id, None)
        if seq is None:
            return
        if seq_id in self.decode_order:
            self.decode_order.remove(seq_id)
        else:
            self._prefilling.remove(seq_id)
        self.pool.free(seq.blocks)

    def _publish_full_blocks(self, seq: PagedSequence) -> None:
        full, known = seq.computed // self.block_size, len(seq.hashes)
        if full <= known or not self.pool.prefix_caching:
            return
        prefix = seq.token_ids[: full * self.block_size]
        seq.hashes = full_block_hashes(prefix, self.block_size, seq.cache_key, seq.hashes)
        for index in range(known, full):
            self.pool.register(seq.blocks[index], seq.hashes[index])
