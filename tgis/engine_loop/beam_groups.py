"""The paged runner's beam-search requests: each one's running beams as planner sequences sharing KV blocks.

A beam request is admitted as one sequence, keyed by its task id, and prefilled like any other. From
its first sampled step on, each running beam is a decoding sequence of its own in the planner: a
beam that continues its parent takes over the parent's sequence; a second continuation of the same
parent forks it (`PagedPlanner.fork`), sharing every full block and copying only the last, partly
filled one; a parent nobody continues is finished, and its blocks go back. So k beams hold the prompt
once, and their own blocks only from where they diverge.

The beams' sequences get ids of their own (negative, so they never meet a task id); `owner` maps
them back to their request.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engines.base import EngineSpec
from engines.step import PagedEngine
from tgis.batching.admission import SequenceShape
from tgis.batching.paged import PagedPlanner
from tgis.engine_loop.beam_search import BeamSearch, FinishedBeam, for_task
from tgis.engine_loop.tasks import GenerationTask, ValidatedInput


@dataclass
class _Group:
    search: BeamSearch
    sequences: list[int]  # the planner sequence of each running beam, in the search's order
    prompt_positions: int


class BeamGroups:
    def __init__(self, planner: PagedPlanner, engine: PagedEngine, eos_token_ids: Sequence[int]) -> None:
        self.planner = planner
        self.engine = engine
        self._eos = frozenset(eos_token_ids)
        self._groups: dict[int, _Group] = {}
        self._owner: dict[int, int] = {}  # beam sequence id → task id
        self._new_ids = itertools.count(-1, -1)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._groups

    def owns(self, seq_id: int) -> bool:
        return seq_id in self._owner

    def owner(self, seq_id: int) -> int:
        """The task a sequence belongs to (a task's own sequence is keyed by its id)."""
        return self._owner.get(seq_id, seq_id)

    def start(self, task: GenerationTask, spec: EngineSpec, positions: int) -> None:
        """Track an admitted beam request whose prompt is planner sequence `task.id`."""
        search = for_task(task, self._eos, spec.is_encoder_decoder)
        self._groups[task.id] = _Group(search, [task.id], positions)
        self._owner[task.id] = task.id

    def worst_shape(self, validated: ValidatedInput) -> SequenceShape:
        """Admission's worst case of an input, as one sequence's shape. For a beam request: the prompt
        and one beam's tokens, then for each further beam its own blocks (its new tokens, the copied
        block, one more while a step forks before it frees), in whole blocks."""
        plain, beam = validated.shape(), validated.params.beam
        if beam is None:
            return plain
        return self._beam_shape(plain.input_length, plain.remaining_new_tokens, beam.width)

    def running_shapes(self) -> list[SequenceShape]:
        """Every running request's shape now; a beam request counts once, for all its beams (as
        `worst_shape` counts it)."""
        if not self._groups:
            return self.planner.shapes()
        shapes = [seq.shape() for seq in self.planner.sequences() if seq.seq_id not in self._owner]
        for group in self._groups.values():
            search = group.search
            left = search.max_new_tokens - search.generated
            shapes.append(self._beam_shape(group.prompt_positions + search.generated, left, search.width))
        return shapes

    def _beam_shape(self, held: int, left: int, width: int) -> SequenceShape:
        """`width` beams that hold `held` positions in common and may each add `left` more."""
        return SequenceShape(held, left + (width - 1) * (left + 3 * self.planner.block_size))

    def advance(self, logits: torch.Tensor, rows_of: Mapping[int, range]) -> dict[int, list[FinishedBeam]]:
        """Take every beam request's step from its beams' logits rows (`rows_of`, by sequence id); move
        their sequences as the searches say. Returns the requests whose search ended, with their beams."""
        copies: list[tuple[int, int]] = []
        ended: dict[int, list[FinishedBeam]] = {}
        for task_id in dict.fromkeys(self._owner[seq_id] for seq_id in rows_of):
            group = self._groups[task_id]
            rows = [rows_of[seq_id][-1] for seq_id in group.sequences]
            continuations = group.search.advance(logits[rows])
            if group.search.done:
                ended[task_id] = group.search.best(group.search.width)
                continue
            copies += self._move(task_id, group, [(c.parent, c.token_id) for c in continuations])
        self.engine.copy_blocks(copies)
        return ended

    def _move(
        self, task_id: int, group: _Group, continuations: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The next running beams' sequences: forks first (their parents are still where they
        branch), then the parents nobody continues go, then every beam gets its token."""
        copies = []
        sequences, continued = [], set()
        for parent, _ in continuations:
            parent_seq = group.sequences[parent]
            if parent not in continued:
                continued.add(parent)
                sequences.append(parent_seq)
                continue
            child = next(self._new_ids)
            copy = self.planner.fork(parent_seq, child)
            self._owner[child] = task_id
            sequences.append(child)
            if copy is not None:
                copies.append(copy)
        for index, seq_id in enumerate(group.sequences):
            if index not in continued:
                self._drop(seq_id)
        for seq_id, (_, token) in zip(sequences, continuations, strict=True):
            self.planner.append_tokens(seq_id, [token], 0)
        group.sequences = sequences
        return copies

    def release(self, task_ids: Iterable[int]) -> None:
        """Forget these requests (unknown ids are ignored) and free their beams' blocks."""
        for task_id in task_ids:
            group = self._groups.pop(task_id, None)
            if group is not None:
                for seq_id in group.sequences:
                    self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self.planner.finish(seq_id)
        del self._owner[seq_id]
