"""The padded runner's beam-search requests (encoder-decoder models run there): each running beam is a row.

A beam request is prefilled as one row, keyed by its task id. After each step that gave its rows
logits, its search continues some beams: the batch is laid out again, each continuation a copy of
its parent's row (the engine copies the row's cache, and an encoder-decoder row's encoder states),
parents nobody continues dropped. A beam that continues its parent keeps the parent's row key;
a further one gets a key of its own (negative, so it never meets a task id).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engines.base import EngineSpec
from tgis.engine_loop.beam_search import BeamSearch, FinishedBeam, for_task
from tgis.engine_loop.tasks import GenerationTask


@dataclass
class Relayout:
    """How the batch's rows change after a step: `rows[i]` is the current row the new i-th row copies,
    `keys[i]` its key, `next_tokens` each new beam row's next input; `ended`: searches that ended."""

    rows: list[int]
    keys: list[int]
    next_tokens: dict[int, int] = field(default_factory=dict)
    ended: dict[int, list[FinishedBeam]] = field(default_factory=dict)

    @property
    def changes(self) -> bool:
        return self.rows != list(range(len(self.rows))) or bool(self.ended)


class PaddedBeams:
    def __init__(self, spec: EngineSpec, eos_token_ids: Sequence[int]) -> None:
        self._spec = spec
        self._eos = frozenset(eos_token_ids)
        self._searches: dict[int, BeamSearch] = {}
        self._keys: dict[int, list[int]] = {}  # each search's row keys, in its running order
        self._owner: dict[int, int] = {}  # row key → task id
        self._new_keys = itertools.count(-1, -1)

    def __len__(self) -> int:
        return len(self._searches)

    def start(self, task: GenerationTask) -> None:
        self._searches[task.id] = for_task(task, self._eos, self._spec.is_encoder_decoder)
        self._keys[task.id] = [task.id]
        self._owner[task.id] = task.id

    def owner(self, key: int) -> int:
        return self._owner.get(key, key)

    def owns(self, key: int) -> bool:
        return key in self._owner

    def advance(self, logits: torch.Tensor, row_of: Mapping[int, int], keys: Sequence[int]) -> Relayout:
        """Step every search whose rows all have logits (`row_of`: row key → logits row) and lay out
        the batch (`keys`: its row keys in order) as they continue."""
        position = {key: i for i, key in enumerate(keys)}
        moved: dict[int, list[tuple[int, int, int]]] = {}  # task → (current row, new key, token)
        ended: dict[int, list[FinishedBeam]] = {}
        for task_id, search in self._searches.items():
            beam_keys = self._keys[task_id]
            if not all(key in row_of for key in beam_keys):
                continue
            continuations = search.advance(logits[[row_of[key] for key in beam_keys]])
            if search.done:
                ended[task_id] = search.best(search.width)
                moved[task_id] = []
                continue
            rows, seen = [], set()
            for c in continuations:
                key = beam_keys[c.parent] if c.parent not in seen else next(self._new_keys)
                seen.add(c.parent)
                rows.append((position[beam_keys[c.parent]], key, c.token_id))
            moved[task_id] = rows
        layout = Relayout([], [], ended=ended)
        for i, key in enumerate(keys):
            owner = self._owner.get(key)
            if owner is None or owner not in moved:
                layout.rows.append(i)
                layout.keys.append(key)
            elif key == self._keys[owner][0]:  # a moved search's rows go where its first row was
                for row, new_key, token in moved[owner]:
                    layout.rows.append(row)
                    layout.keys.append(new_key)
                    layout.next_tokens[new_key] = token
        for task_id, rows in moved.items():
            self._rekey(task_id, [new_key for _, new_key, _ in rows])
        return layout

    def _rekey(self, task_id: int, keys: list[int]) -> None:
        for key in self._keys[task_id]:
            del self._owner[key]
        self._keys[task_id] = keys
        for key in keys:
            self._owner[key] = task_id

    def release(self, task_id: int) -> None:
        self._searches.pop(task_id, None)
        for key in self._keys.pop(task_id, []):
            del self._owner[key]

    def generated(self, task_id: int) -> int:
        return self._searches[task_id].generated
