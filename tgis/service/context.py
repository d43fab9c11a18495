"""The service core both front doors use: permits, adapters, guides, tokenization, validation, submission.

gRPC and HTTP each turn their wire format into GenerationParams and prompts, then call `start`, which
runs the service steps in one order (SPEC §3.1, TGIS's router):

1. permits: one per input, or `Model is overloaded` (RESOURCE_EXHAUSTED / 429);
2. parameters: the call's GenerationParams against the server's limits;
3. adapter: the prompt prefix or LoRA adapter the call names, loaded off the event loop;
4. guide: the guided-decoding grammar, compiled off the event loop;
5. validation: each prompt tokenized, truncated and checked against the sequence length, and seeded;
6. submit: every input handed to the engine loop.

Steps 2-5 are the call's validation (its log line's validation_time, its trace's validation span). A
failure at any step releases the permits taken. What a door converts from its wire format (GenerationParams,
a guided-decoding Constraint) it converts before calling `start`, so its conversion errors come first.
A request behaves alike whichever door it came in by. Nothing here knows protobuf or HTTP.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace

from engines.base import EngineSpec, LoraAdapter, PrefixEmbeddings
from tgis.adapters.store import AdapterLoadError, AdapterStore
from tgis.config import ServingLimits
from tgis.engine_loop.core import EngineLoop
from tgis.engine_loop.tasks import Adapter, GenerationTask, ValidatedInput
from tgis.errors import Msg, OverloadedError, ValidationError
from tgis.guided import Constraint, GrammarCache
from tgis.metrics import Metrics
from tgis.openmp import run_torch_work
from tgis.service.calls import Finished, RequestCall
from tgis.service.delivery import EventDelivery
from tgis.service.events import Submitted
from tgis.service.health import DrainGate
from tgis.service.permits import Permits
from tgis.service.started import Started
from tgis.service.validation import validate_input, validate_params
from tgis.tokenization.tokenizer import Encoding, Tokenizer
from tgis.tracing import Tracing
from tgis.types import GenerationEvent, GenerationParams, ModelKind, StopReason

Prompt = str | Sequence[int]  # a text, or token ids given directly (the HTTP APIs accept both)


class AdapterLookupError(ValidationError):
    """The named adapter could not be loaded (SPEC §3.1 #13); the HTTP APIs answer 404 for it."""


@dataclass
class ServiceContext:
    """Everything the front doors use; built once at startup by the composition root."""

    engine_loop: EngineLoop
    spec: EngineSpec
    tokenizer: Tokenizer
    metrics: Metrics
    limits: ServingLimits
    permits: Permits
    tokenization_executor: Executor
    default_include_stop_seqs: bool = True
    add_special_tokens: bool = True  # ADD_SPECIAL_TOKENS: prompts get the tokenizer's BOS and the like
    prompt_logprobs: bool = True  # false under DISABLE_PROMPT_LOGPROBS: input token details are tokens only
    compiled: bool = False  # PT2_COMPILE
    adapters: AdapterStore | None = None  # PREFIX_STORE_PATH (SPEC §8); None: ids are refused
    drain: DrainGate = field(default_factory=DrainGate)
    tracing: Tracing = field(default_factory=Tracing)
    grammars: GrammarCache | None = None  # guided decoding; None: constraints are refused
    rng: random.Random = field(default_factory=random.Random)  # seeds for sampling requests without one
    _delivery: EventDelivery | None = field(default=None, init=False, repr=False)

    @property
    def model_kind(self) -> ModelKind:
        return ModelKind.ENCODER_DECODER if self.spec.is_encoder_decoder else ModelKind.DECODER_ONLY

    # ---- the one entry point of both doors ----------------------------------------------------------

    async def start(
        self,
        call: RequestCall,
        prompts: Sequence[Prompt],
        params: GenerationParams,
        *,
        arrival: float,
        streamed: bool,
        adapter_id: str | None = None,
        constraint: Constraint | None = None,
        special_tokens: bool | None = None,
    ) -> Started:
        """Run the service steps in the module's order and return the submitted inputs with their
        permits (close the Started, or leave its `async with`, to release them). `streamed`: events
        arrive as they come, else once each input is done (for a caller that folds them)."""
        held = self._hold_permits(len(prompts))
        try:
            call.record.params = params
            with call.validating():
                self._check_params(params)
                adapter = await self.adapter(adapter_id) if adapter_id else None
                guide = await self._compiled_guide(constraint)
                validated = await self._validate(
                    prompts,
                    params,
                    adapter=adapter,
                    adapter_id=adapter_id,
                    guide=guide,
                    special_tokens=special_tokens,
                )
        except BaseException:
            held.release()
            raise
        return Started(self._submit(validated, arrival, streamed=streamed), held)

    # ---- admission and parameters -------------------------------------------------------------------

    def _hold_permits(self, count: int) -> Permits.Held:
        """`count` concurrency permits, or Model is overloaded (counted as a conc_limit failure)."""
        held = self.permits.try_hold(count)
        if held is None:
            self.metrics.request_failure.labels(err="conc_limit").inc()
            raise OverloadedError(Msg.OVERLOADED)
        return held

    def _check_params(self, params: GenerationParams) -> None:
        """SPEC §3.1's checks of the call's parameters, against this server's MAX_NEW_TOKENS."""
        validate_params(params, max_new_tokens_limit=self.limits.max_new_tokens)

    # ---- adapters and guides ------------------------------------------------------------------------

    async def adapter(self, adapter_id: str) -> Adapter:
        """SPEC §3.1 #13: the prefix or LoRA adapter, loaded off the event loop, that the engine serves."""
        store = self.adapters
        if store is None:
            raise AdapterLookupError(Msg.ADAPTER_STORE_MISSING)
        try:
            adapter = await run_torch_work(lambda: store.get(adapter_id), name="adapter-load")
        except AdapterLoadError as exc:
            raise AdapterLookupError(Msg.PREFIX_LOOKUP.format(id=adapter_id, reason=exc.reason)) from exc
        return self._supported(adapter, adapter_id)

    def _supported(self, adapter: Adapter, adapter_id: str) -> Adapter:
        """The loaded adapter, if the engine can serve its kind (else the lookup error naming why)."""
        spec = self.spec
        if isinstance(adapter, LoraAdapter) and not spec.supports_lora:
            reason = (
                Msg.LORA_UNSUPPORTED_COMPILED
                if self.compiled
                else Msg.LORA_UNSUPPORTED_BY_ENGINE.format(engine=spec.engine_name)
            )
        elif isinstance(adapter, PrefixEmbeddings) and not spec.supports_prefixes:
            reason = Msg.PREFIX_UNSUPPORTED_BY_ENGINE.format(engine=spec.engine_name)
        else:
            return adapter
        raise ValidationError(Msg.PREFIX_LOOKUP.format(id=adapter_id, reason=reason))

    async def _compiled_guide(self, constraint: Constraint | None) -> object:
        """The compiled grammar of a guided-decoding constraint (None without one), off the loop."""
        if constraint is None:
            return None
        if self.grammars is None:
            raise ValidationError(Msg.GUIDED_INVALID.format(field=constraint.kind, error="not enabled"))
        return await self.grammars.compile(constraint)

    # ---- tokenization and validation ----------------------------------------------------------------

    async def encode(
        self, text: str, *, with_offsets: bool = False, special_tokens: bool | None = None
    ) -> Encoding:
        """Tokenize on the tokenization workers (special tokens: as ADD_SPECIAL_TOKENS says, unless the
        caller's protocol decides)."""
        aio_loop = asyncio.get_running_loop()
        if special_tokens is None:
            special_tokens = self.add_special_tokens
        return await aio_loop.run_in_executor(
            self.tokenization_executor,
            lambda: self.tokenizer.encode(text, with_offsets=with_offsets, special_tokens=special_tokens),
        )

    async def _validate(
        self,
        prompts: Sequence[Prompt],
        params: GenerationParams,
        *,
        adapter: Adapter | None = None,
        adapter_id: str | None = None,
        guide: object = None,
        special_tokens: bool | None = None,
    ) -> list[ValidatedInput]:
        """SPEC §3.1 #14–#16 per prompt: tokenized (token-id prompts are checked against the vocabulary
        instead), truncated, checked, seeded; then the validation metrics."""
        started = time.monotonic()
        if not self.prompt_logprobs and params.response.input_scores:
            params = replace(params, response=replace(params.response, input_scores=False))
        try:
            encodings = await asyncio.gather(
                *(self.encode(p, special_tokens=special_tokens) for p in prompts if isinstance(p, str))
            )
        except Exception as exc:
            raise ValidationError(Msg.TOKENIZER.format(error=exc)) from exc
        texts = iter(encodings)
        validated = []
        for prompt in prompts:
            text, ids = (prompt, next(texts).ids) if isinstance(prompt, str) else self._token_prompt(prompt)
            self.metrics.request_raw_input_length.observe(len(ids))
            validated.append(self._validated_input(text, ids, params, adapter, adapter_id, guide))
            problem = self.engine_loop.too_large(validated[-1])
            if problem is not None:  # only a beam search can be wider than the batch may grow
                raise ValidationError(
                    f"this request could never be scheduled: {problem}; ask for fewer beams or fewer tokens"
                )
        # As TGIS's router records them: per input, the requested max_new_tokens (before it is clamped
        # to the sequence length); per call, the validation time.
        for v in validated:
            self.metrics.request_input_length.observe(len(v.input_ids))
            self.metrics.request_max_new_tokens.observe(params.stopping.max_new_tokens)
        self.metrics.request_validation_duration.observe(time.monotonic() - started)
        return validated

    def _token_prompt(self, ids: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        vocab = self.spec.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ValidationError(f"token ids must be in [0, {vocab})")
        return self.tokenizer.decode(ids), tuple(ids)

    def _validated_input(
        self,
        text: str,
        ids: Sequence[int],
        params: GenerationParams,
        adapter: Adapter | None,
        adapter_id: str | None,
        guide: object,
    ) -> ValidatedInput:
        """SPEC §3.1 #15–#16 for one input, after TRUNCATE_INPUT_TOKENS."""
        encoder_decoder = self.spec.is_encoder_decoder
        return validate_input(
            text,
            self.tokenizer.truncate(ids, params.truncate_input_tokens),
            params,
            adapter=adapter,
            adapter_id=adapter_id,
            prefix_length=adapter.length(encoder_decoder) if isinstance(adapter, PrefixEmbeddings) else 0,
            max_sequence_length=self.limits.max_sequence_length,
            rng=self.rng,
            guide=guide,
        )

    # ---- the engine loop ----------------------------------------------------------------------------

    def _submit(self, inputs: Sequence[ValidatedInput], arrival: float, *, streamed: bool) -> list[Submitted]:
        """Hand the inputs to the engine loop; each one's events arrive on its own asyncio queue, as they
        come if `streamed`, else all at once when the input is done (for a caller that folds them)."""
        aio_loop = asyncio.get_running_loop()
        if self._delivery is None or self._delivery.loop is not aio_loop:
            self._delivery = EventDelivery(aio_loop)
        submitted = []
        for validated in inputs:
            events: asyncio.Queue[GenerationEvent] = asyncio.Queue()
            task = GenerationTask(validated, arrival, self._delivery.sink(events), streamed=streamed)
            submitted.append(Submitted(task, events))
        self.engine_loop.submit([s.task for s in submitted])
        return submitted

    def record_success(self, kind: str, finals: Sequence[Finished], arrival: float) -> None:
        """Per input, as TGIS's router records them: its success, and the call's time up to its end."""
        duration = time.monotonic() - arrival
        for final in finals:
            reason = StopReason(final.stop_reason)
            self.metrics.request_success.labels(stop_reason=reason.name, kind=kind).inc()
            self.metrics.request_duration.observe(duration)
