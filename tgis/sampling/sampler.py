"""The batch sampler: per-row processor state mirrored on the running batch, one vectorised step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import WatermarkLogitsProcessor

from tgis.sampling import draws
from tgis.sampling import processors as proc
from tgis.sampling.bad_words import BadWordRows
from tgis.sampling.config import SamplingConfig, StepSample
from tgis.sampling.context import OutputCounts, PresenceMask
from tgis.sampling.details import token_details
from tgis.sampling.guide import GuideRows
from tgis.sampling.plan import BatchPlan, build_plan
from tgis.types import TokenDetail


class BatchSampler:
    """Chooses next tokens for the running batch; rows mirror its order through add/keep."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device) -> None:
        self._vocab_size = vocab_size
        self._device = device
        self._eos_ids = sorted({i for i in eos_token_ids if 0 <= i < vocab_size})
        self._eos = torch.tensor(self._eos_ids, dtype=torch.long, device=device)
        self._configs: list[SamplingConfig] = []
        self._draws: list[int] = []  # each row's draws so far: its next uniform is (seed, this)
        self._generated: list[int] = []  # each row's tokens so far (min_new_tokens, length penalty)
        self._last = torch.zeros(0, dtype=torch.long, device=device)  # each row's latest token id
        self._watermarks: dict[tuple[float, float], WatermarkLogitsProcessor] = {}
        self._context = PresenceMask(vocab_size, device)
        self._counts = OutputCounts(vocab_size, device)
        self._guides = GuideRows(vocab_size, device)
        self._bad_words = BadWordRows()
        self._plan: BatchPlan = build_plan([], vocab_size, device)

    @property
    def num_rows(self) -> int:
        return len(self._configs)

    def add_rows(self, configs: Sequence[SamplingConfig], context_ids: Sequence[Sequence[int]]) -> None:
        """Append rows in order; context_ids are the ids that count for the repetition penalty.

        What can fail (a grammar that is not compiled) fails before any row is added, so a
        rejected row leaves the sampler as it was."""
        if len(configs) != len(context_ids):
            raise ValueError(f"{len(configs)} configs but {len(context_ids)} contexts")
        matchers = self._guides.matchers_for([c.guide for c in configs])
        pairs = zip(configs, context_ids, strict=True)
        self._context.append([ids if c.repetition_penalty != 1.0 else None for c, ids in pairs])
        self._counts.append(len(configs), any(c.counts_output for c in configs))
        self._guides.append_matchers(matchers)
        self._bad_words.append([c.bad_words for c in configs], context_ids)
        self._configs += configs
        self._draws += [0] * len(configs)
        self._generated += [0] * len(configs)
        last = [ids[-1] if len(ids) else 0 for ids in context_ids]
        self._last = torch.cat([self._last, torch.tensor(last, dtype=torch.long, device=self._device)])
        self._replan()

    def extend(self, other: BatchSampler) -> None:
        """Append `other`'s rows, with their generators, counts and contexts, after these rows."""
        if other._vocab_size != self._vocab_size:
            raise ValueError(f"vocab sizes differ: {self._vocab_size} != {other._vocab_size}")
        self._context.extend(other._context)
        self._counts.extend(other._counts)
        self._guides.extend(other._guides)
        self._bad_words.extend(other._bad_words)
        self._configs += other._configs
        self._draws += other._draws
        self._generated += other._generated
        self._last = torch.cat([self._last, other._last])
        self._replan()

    def keep_rows(self, indices: Sequence[int]) -> None:
        """Keep only these row positions, in this order (prune finished rows, or reorder)."""
        if any(not 0 <= i < self.num_rows for i in indices):
            raise IndexError(f"row index out of range for {self.num_rows} rows: {list(indices)}")
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate row indices: {list(indices)}")  # rows own their draw counts
        index = torch.tensor(list(indices), dtype=torch.long, device=self._device)
        self._configs = [self._configs[i] for i in indices]
        self._draws = [self._draws[i] for i in indices]
        self._generated = [self._generated[i] for i in indices]
        self._last = self._last.index_select(0, index)
        self._context.keep(index, any(c.repetition_penalty != 1.0 for c in self._configs))
        self._counts.keep(index, any(c.counts_output for c in self._configs))
        self._guides.keep(indices)
        self._bad_words.keep(indices)
        self._replan()

    def sample(self, logits: torch.Tensor, active: Sequence[int] | None = None) -> StepSample:
        """Apply the SPEC §2.2 pipeline to logits [B, V], choose, and advance the rows by one token.

        `active` (default: every row) names the rows that take a token now; the others keep their
        state (their draw counts included) and their entries in the result mean nothing. Verifying proposed
        tokens samples one position at a time over the rows still accepting."""
        if active is None and self.chooses_ahead:
            plain = self._sample_plain_greedy(logits)
            if plain is not None:
                return plain
        chosen = None if active is None else frozenset(active)
        scores = self.process(logits)
        tokens = self._choose(scores, chosen)
        details = self._details(scores, tokens, chosen)
        self._advance(tokens, chosen)
        token_ids = tokens.tolist()
        self._bad_words.advance(token_ids, chosen)
        finished = self._guides.advance(token_ids, chosen) if self._guides.active else []
        return StepSample(token_ids=token_ids, details=details, guide_finished=tuple(finished))

    def _sample_plain_greedy(self, logits: torch.Tensor) -> StepSample | None:
        """`sample` while every row is greedy and only min_new_tokens may change its scores
        (`chooses_ahead`): each row's argmax of the logits as they are, the same state advanced. None,
        changing nothing, when a row still short of its min_new_tokens chose an id the pipeline would
        suppress (an EOS id or one of its stop ids): the pipeline chooses then. Without the pipeline's
        float32 copy and its steps that change nothing, a one-stream int4 decode step's sampling took
        0.074 ms in the server instead of 0.142 (medians of 16 runs beside each other, benchmark model,
        2-core Zen 4): a forward streams the weights through the caches, so every tensor call after it
        is slow."""
        tokens = self._checked(logits).argmax(dim=-1)
        token_ids = tokens.tolist()
        for row, token in enumerate(token_ids):
            config = self._configs[row]
            if self._generated[row] < config.min_new_tokens and (
                token in self._eos_ids or token in config.stop_token_ids
            ):
                return None
        self._last = tokens
        self._generated = [count + 1 for count in self._generated]
        return StepSample(token_ids=token_ids, details=[None] * len(token_ids), guide_finished=())

    @property
    def chooses_ahead(self) -> bool:
        """Whether `greedy_ahead` can choose: every row is greedy, and only its count of tokens so far
        changes its scores (min_new_tokens), not the tokens themselves (penalties, bias, watermark,
        grammar, bad words); no row asks for details."""
        plan = self._plan
        processors = (plan.length_penalty, plan.repetition, plan.penalties, plan.logit_bias, plan.details)
        warpers = (plan.temperature, plan.top_k, plan.top_p, plan.min_p, plan.typical_p)
        return not (
            any(part is not None for part in (*processors, *warpers))
            or plan.sampling is not None
            or plan.watermarks
            or self._guides.active
            or self._bad_words.active
            or self._context.table is not None
            or self._counts.table is not None
        )

    def greedy_ahead(self, logits: torch.Tensor, rows: Sequence[int], ahead: Sequence[int]) -> list[int]:
        """What `sample` would choose for every logits row [N, V] at once, where `logits[i]` is row
        `rows[i]`'s, `ahead[i]` tokens past its newest; only while `chooses_ahead`. Changes no state
        (`advance_rows` records what is kept).

        Verifying a draft chooses its positions one after another only because a later position's
        scores may depend on the earlier tokens; when none do, one call chooses them all."""
        if not self.chooses_ahead:
            raise ValueError("a row's scores depend on its earlier tokens: sample position by position")
        plan = self._plan
        if logits.shape[-1] != self._vocab_size:
            raise ValueError(f"logits vocab {logits.shape[-1]} != {self._vocab_size}")
        scores = logits
        if plan.min_new_tokens is not None:
            index = torch.tensor(rows, dtype=torch.long, device=self._device)
            counts = [self._generated[row] + past for row, past in zip(rows, ahead, strict=True)]
            generated = torch.tensor(counts, dtype=torch.long, device=self._device)
            short = generated < plan.min_new_tokens.index_select(0, index)
            scores = proc.suppress_eos_(logits.clone(), self._eos_ids, short)
            if plan.stop_tokens is not None:  # row i of `logits` is batch row rows[i]
                scores = self._suppress_stop_tokens(scores, short, index)
        return scores.argmax(dim=-1).tolist()

    def advance_rows(self, new_tokens: Sequence[Sequence[int]]) -> None:
        """Record each row's new tokens (at least one per row, rows in order), as `greedy_ahead`
        chose them; only after it answered, so nothing but the counts and latest tokens change."""
        pairs = zip(self._generated, new_tokens, strict=True)
        self._generated = [count + len(tokens) for count, tokens in pairs]
        self._last = torch.tensor(
            [tokens[-1] for tokens in new_tokens], dtype=torch.long, device=self._device
        )

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The final float32 scores of steps 1-4 for logits [B, V]; changes no state.

        Guided rows first lose every token their grammar forbids (-inf), so every later step works
        on what the grammar allows.
        """
        scores = self._guides.mask(self._checked(logits).to(torch.float32, copy=True))
        return self._warp(self._penalise(scores))

    def _replan(self) -> None:
        self._plan = build_plan(self._configs, self._vocab_size, self._device)

    def _generated_tensor(self) -> torch.Tensor:
        return torch.tensor(self._generated, dtype=torch.long, device=self._device)

    def _checked(self, logits: torch.Tensor) -> torch.Tensor:
        expected = (self.num_rows, self._vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits shape {tuple(logits.shape)} != (rows, vocab) {expected}")
        return logits

    def _penalise(self, scores: torch.Tensor) -> torch.Tensor:
        """Steps 1-3 (then the HTTP APIs' presence/frequency penalties and logit bias), on every row."""
        scores = self._min_tokens(scores)
        if len(self._eos):
            scores = self._length_penalty(scores)
        rep = self._plan.repetition
        if rep is not None and self._context.mask is not None:
            seen = rep.rows.take(self._context.mask)
            scores = rep.rows.put(scores, proc.repetition_penalty(rep.rows.take(scores), seen, rep.value))
        pen = self._plan.penalties
        if pen is not None and self._counts.counts is not None:
            counts = pen.rows.take(self._counts.counts)
            penalised = proc.output_penalties(pen.rows.take(scores), counts, pen.presence, pen.frequency)
            scores = pen.rows.put(scores, penalised)
        bias = self._plan.logit_bias
        if bias is not None:
            scores = proc.logit_bias(scores, bias.rows, bias.ids, bias.bias)
        for row, gamma_delta in self._plan.watermarks:  # rare (TGI's `watermark`): row by row
            previous = self._last[row : row + 1, None]
            scores[row : row + 1] = self._watermark(gamma_delta)(previous, scores[row : row + 1])
        return self._bad_words.mask(scores)

    def _watermark(self, gamma_delta: tuple[float, float]) -> WatermarkLogitsProcessor:
        """transformers' green-list watermark, seeded by the previous token (TGI's scheme)."""
        if gamma_delta not in self._watermarks:
            gamma, delta = gamma_delta
            self._watermarks[gamma_delta] = WatermarkLogitsProcessor(
                self._vocab_size, self._device, greenlist_ratio=gamma, bias=delta
            )
        return self._watermarks[gamma_delta]

    def _min_tokens(self, scores: torch.Tensor) -> torch.Tensor:
        minimum = self._plan.min_new_tokens
        if minimum is None:
            return scores
        short = self._generated_tensor() < minimum
        scores = proc.suppress_eos_(scores, self._eos_ids, short)
        return self._suppress_stop_tokens(scores, short)

    def _suppress_stop_tokens(
        self, scores: torch.Tensor, short: torch.Tensor, batch_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Each short row's own stop ids become -inf: one scatter over the flat (row, id) pairs.
        `batch_rows[i]` is the batch row of scores' row i, a row possibly several times (None: scores
        are the batch, in order)."""
        stops = self._plan.stop_tokens
        if stops is None:
            return scores
        if batch_rows is None:
            where, ids = stops.rows, stops.ids
        else:  # every (position, pair) whose batch rows match
            position, pair = (batch_rows.unsqueeze(1) == stops.rows.unsqueeze(0)).nonzero(as_tuple=True)
            where, ids = position, stops.ids.index_select(0, pair)
        values = torch.where(short.index_select(0, where), float("-inf"), scores[where, ids])
        return scores.index_put_((where, ids), values)

    def _length_penalty(self, scores: torch.Tensor) -> torch.Tensor:
        p = self._plan.length_penalty
        if p is None:
            return scores
        generated = p.rows.take(self._generated_tensor())
        eos = self._eos_columns(scores, p.rows.index)
        boosted = proc.length_penalty(eos, generated, p.start, p.decay)
        return self._put_eos(scores, p.rows.index, boosted)

    def _eos_columns(self, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return scores[rows.unsqueeze(1), self._eos.unsqueeze(0)]

    def _put_eos(self, scores: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        scores[rows.unsqueeze(1), self._eos.unsqueeze(0)] = values
        return scores

    def _warp(self, scores: torch.Tensor) -> torch.Tensor:
        """Step 4, sampling rows only, each warper on the rows that set it."""
        plan = self._plan
        if plan.temperature is not None:
            rows = plan.temperature.rows
            scores = rows.put(scores, proc.temperature(rows.take(scores), plan.temperature.value))
        if plan.top_k is not None:
            rows = plan.top_k.rows
            scores = rows.put(scores, proc.top_k(rows.take(scores), plan.top_k.k, plan.top_k.k_max))
        if plan.top_p is not None:
            rows = plan.top_p.rows
            scores = rows.put(scores, proc.top_p(rows.take(scores), plan.top_p.value))
        if plan.min_p is not None:
            rows = plan.min_p.rows
            scores = rows.put(scores, proc.min_p(rows.take(scores), plan.min_p.value))
        if plan.typical_p is not None:
            rows = plan.typical_p.rows
            scores = rows.put(scores, proc.typical_p(rows.take(scores), plan.typical_p.value))
        return scores

    def _choose(self, scores: torch.Tensor, active: frozenset[int] | None) -> torch.Tensor:
        """Step 5: argmax (first maximum = lowest id) for greedy rows, seeded draws for the rest
        (only the active ones draw: a draw advances the row's count)."""
        tokens = scores.argmax(dim=-1)
        rows = None if self._plan.sampling is None else self._plan.sampling.within(active)
        if rows is None:
            return tokens
        probs = torch.softmax(rows.take(scores), dim=-1)
        return rows.put(tokens, self._draw(probs, rows.positions))

    def _draw(self, probs: torch.Tensor, positions: tuple[int, ...]) -> torch.Tensor:
        """Every sampling row's token in one call, each from its own seed and draw count only
        (tgis/sampling/draws.py), so a seed gives the same tokens in any batch."""
        uniforms = []
        for position in positions:
            uniforms.append(draws.uniform(self._configs[position].seed, self._draws[position]))
            self._draws[position] += 1
        return draws.categorical(probs, uniforms)

    def _details(
        self, scores: torch.Tensor, tokens: torch.Tensor, active: frozenset[int] | None
    ) -> list[TokenDetail | None]:
        """Step 6: details from the log-softmax of the final scores, for rows that asked."""
        out: list[TokenDetail | None] = [None] * self.num_rows
        p = self._plan.details
        rows = None if p is None else p.rows.within(active)
        if p is None or rows is None:
            return out
        requests = [p.requests[p.rows.positions.index(position)] for position in rows.positions]
        logprobs = torch.log_softmax(rows.take(scores), dim=-1)
        found = token_details(logprobs, rows.take(tokens), requests)
        for position, detail in zip(rows.positions, found, strict=True):
            out[position] = detail
        return out

    def _advance(self, tokens: torch.Tensor, active: frozenset[int] | None) -> None:
        tokens = tokens.to(torch.long)
        rep = self._plan.repetition
        rep_rows = None if rep is None else rep.rows.within(active)
        if rep_rows is not None:
            self._context.add_tokens(rep_rows.index, rep_rows.take(tokens))
        if active is None:
            self._counts.add_tokens(tokens)
            self._last = tokens
            self._generated = [count + 1 for count in self._generated]
            return
        index = torch.tensor(sorted(active), dtype=torch.long, device=tokens.device)
        self._counts.add_tokens(tokens, index)
        self._last = self._last.index_copy(0, index, tokens.index_select(0, index))
        self._generated = [count + (row in active) for row, count in enumerate(self._generated)]
