"""Rank 0 of a tensor-parallel model: spawns and watches the other ranks, broadcasts every step."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from engines.base import (
    EngineConfig,
    EngineFatalError,
    EngineSpec,
    LoraAdapter,
    PrefillResult,
    PrefillRow,
    PrefixEmbeddings,
)
from engines.common import (
    auto_model_class,
    avoid_per_shape_attention_builds,
    checkpoint_dtype,
    compiled_if_asked,
    config_eos_token_ids,
    paged_engine_if_possible,
    resolve_dtype,
)
from engines.fused_activations import fuse_activations
from engines.hf_custom_tp.commands import (
    Allocate,
    Clear,
    Command,
    CommandChannel,
    CopyBlocks,
    Decode,
    KeepRows,
    Prefill,
    Step,
    Stop,
)
from engines.hf_custom_tp.group import make_groups, master_store
from engines.hf_custom_tp.layers import CollectiveError, Shard
from engines.hf_custom_tp.plans import plan_for
from engines.hf_custom_tp.processes import STOP_GRACE_SECONDS, ShardProcesses, exit_process
from engines.hf_custom_tp.shard import shard_model
from engines.hf_custom_tp.weights import CheckpointReader, safetensors_files
from engines.hf_transformers import HFTransformersEngine
from engines.lora import LoraLoadError
from engines.paged.engine import PagedHFEngine
from engines.quantized import quantize_model, release_dense_weights
from engines.step import KVCacheShape, SequenceChunk, StepBatch, StepOutput

logger = logging.getLogger(__name__)

T = TypeVar("T")


def shard_device(config: EngineConfig, rank: int) -> torch.device:
    """One device per rank: cuda:<rank> when CUDA is used, else the CPU."""
    kind = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = kind.split(":")[0]
    return torch.device(f"cuda:{rank}") if kind == "cuda" else torch.device("cpu")


def load_shard(
    config: EngineConfig, shard: Shard, device: torch.device
) -> HFTransformersEngine | PagedHFEngine:
    """This rank's shard of the model, wrapped in the same engine as hf_transformers would use: the
    paged step where the model supports it (every rank decides alike: the self-test's forwards run
    on all of them), else the padded running batch."""
    avoid_per_shape_attention_builds(device)
    dtype = resolve_dtype(config.dtype, device, cpu_bf16=config.cpu_bf16)
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    model = _sharded_model(config, model_config, shard, dtype)
    nn.Module.to(model, device)  # PreTrainedModel.to is wrapped in a way mypy misreads
    if config.quantize is not None:  # each rank its own shard: a row-split layer's scales are its rank's
        quantized = quantize_model(model, config.quantize, config.quantize_group_size)
        release_dense_weights(model, device)
        logger.info(f"shard {shard.rank}: {quantized.summary(config.quantize)}")
    fuse_activations(model)
    spec = _shard_spec(model, model_config, device, dtype, config.model_path)
    paged = paged_engine_if_possible(model, spec, config)
    if paged is not None:
        return paged
    return HFTransformersEngine(model, compiled_if_asked(model, spec, config))


def _sharded_model(
    config: EngineConfig, model_config: PretrainedConfig, shard: Shard, dtype: torch.dtype
) -> PreTrainedModel:
    """The model with this rank's part of every sharded weight, read from the safetensors checkpoint."""
    plan = plan_for(model_config, shard.world_size)
    with CheckpointReader(safetensors_files(config.model_path), shard) as reader:
        return shard_model(
            auto_model_class(model_config),
            model_config,
            plan,
            reader,
            shard,
            dtype,
            config.attn_implementation,
        )


def _shard_spec(
    model: PreTrainedModel,
    model_config: PretrainedConfig,
    device: torch.device,
    dtype: torch.dtype,
    model_path: Path,
) -> EngineSpec:
    eos_ids = config_eos_token_ids(model_config, model_path)
    pad = model_config.pad_token_id
    if pad is None:
        pad = eos_ids[0] if eos_ids else 0
    head = model.get_output_embeddings()
    return EngineSpec(
        is_encoder_decoder=bool(model_config.is_encoder_decoder),
        vocab_size=int(getattr(head, "vocab_size", model_config.vocab_size)),
        eos_token_ids=eos_ids,
        pad_token_id=int(pad),
        device=device,
        dtype=dtype,
        model_config=json.loads(model_config.to_json_string()),
        supports_lora=False,
        engine_name="hf_custom_tp",
    )


def _on_shard(row: PrefillRow, spec: EngineSpec) -> PrefillRow:
    """A received row with its prefix in this shard's dtype and on its device (rows arrive as float32)."""
    if row.prefix is None:
        return row

    def cast(part: torch.Tensor | None) -> torch.Tensor | None:
        return None if part is None else part.to(device=spec.device, dtype=spec.dtype)

    prefix = PrefixEmbeddings(cast(row.prefix.decoder), cast(row.prefix.encoder))
    return dataclasses.replace(row, prefix=prefix)


def _step_on_shard(batch: StepBatch, spec: EngineSpec) -> StepBatch:
    """A received paged step with its prefixes in this shard's dtype and on its device."""

    def moved(chunk: SequenceChunk) -> SequenceChunk:
        if chunk.prefix is None or chunk.prefix.decoder is None:
            return chunk
        decoder = chunk.prefix.decoder.to(device=spec.device, dtype=spec.dtype)
        return dataclasses.replace(chunk, prefix=PrefixEmbeddings(decoder=decoder))

    return StepBatch(tuple(map(moved, batch.decode)), tuple(map(moved, batch.prefill)))


def apply(engine: HFTransformersEngine | PagedHFEngine, command: Command) -> Any:
    """Run one step command on a rank's local engine."""
    if isinstance(engine, PagedHFEngine):
        if isinstance(command, Step):
            return engine.step(_step_on_shard(command.batch, engine.spec))
        if isinstance(command, Allocate):
            return engine.allocate(command.num_blocks, command.block_size)
        if isinstance(command, CopyBlocks):
            return engine.copy_blocks(command.pairs)
        raise ValueError(f"{command} is not a paged step")
    if isinstance(command, Prefill):
        return engine.prefill([_on_shard(row, engine.spec) for row in command.rows])
    if isinstance(command, Decode):
        return engine.decode(command.token_ids)
    if isinstance(command, KeepRows):
        return engine.keep_rows(command.indices)
    if isinstance(command, Clear):
        return engine.clear()
    raise ValueError(f"{command} is not a step")


class _Broadcast:
    """Rank 0's side of the ranks: each call is broadcast, then run on rank 0's own shard."""

    def __init__(
        self,
        channel: CommandChannel | None = None,
        workers: ShardProcesses | None = None,
        resources: tuple[object, ...] = (),
    ) -> None:
        self._channel = channel
        self._workers = workers
        self._resources = resources  # the store and groups must outlive every step
        self._lock = threading.Lock()
        self._closed = False

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1, in rank order."""
        return [] if self._workers is None else [worker.process.pid for worker in self._workers.workers]

    def unload_lora(self, adapter_id: str) -> None:
        """Nothing to free: LoRA is not served under tensor parallelism (spec.supports_lora is False)."""

    def _step(self, command: Command, run: Callable[[], T]) -> T:
        with self._lock:
            if self._closed:
                raise EngineFatalError("hf_custom_tp engine is closed")
            if self._workers is not None:
                self._workers.check()
            try:
                if self._channel is not None:
                    self._channel.send(command)
                return run()
            except CollectiveError:
                if self._workers is not None:
                    # Usually a peer died: name it rather than the socket error it caused.
                    self._workers.check(grace=5.0)
                raise

    def close(self) -> None:
        """Stop the other ranks (idempotent); the engine serves no further step."""
        locked = self._lock.acquire(timeout=STOP_GRACE_SECONDS)
        try:
            if self._closed:
                return
            self._closed = True
            if self._workers is None:
                return
            self._workers.stop_watching()
            if locked and self._channel is not None and self._workers.first_death() is None:
                try:
                    self._channel.send(Stop())
                except CollectiveError:
                    logger.warning("hf_custom_tp: could not tell the shards to stop; killing them")
            self._workers.join(STOP_GRACE_SECONDS)
        finally:
            if locked:
                self._lock.release()


class TensorParallelEngine(_Broadcast):
    """The padded Engine rank 0 serves with.

    Every rank holds the same running batch (same rows, same cache layout over its own heads), so
    the left-padded merge/prune logic of hf_transformers applies unchanged on each of them.
    """

    def __init__(self, local: HFTransformersEngine, *args: Any) -> None:
        super().__init__(*args)
        self.spec: EngineSpec = local.spec
        self._local = local

    @property
    def num_rows(self) -> int:
        return self._local.num_rows

    def prefill(self, rows: Sequence[PrefillRow]) -> PrefillResult:
        command = Prefill(tuple(rows))
        return self._step(command, lambda: self._local.prefill(command.rows))

    def decode(self, token_ids: Sequence[int]) -> torch.Tensor:
        command = Decode(tuple(int(token) for token in token_ids))
        return self._step(command, lambda: self._local.decode(command.token_ids))

    def keep_rows(self, indices: Sequence[int]) -> None:
        command = KeepRows(tuple(int(index) for index in indices))
        self._step(command, lambda: self._local.keep_rows(command.indices))

    def clear(self) -> None:
        self._step(Clear(), self._local.clear)


class TensorParallelPagedEngine(_Broadcast):
    """The paged engine rank 0 serves with: every rank holds the same block ids over its own heads,
    so the service's one block pool addresses all of them."""

    def __init__(self, local: PagedHFEngine, *args: Any) -> None:
        super().__init__(*args)
        self.spec: EngineSpec = local.spec
        self.kv_shape: KVCacheShape = local.kv_shape  # per rank: its share of the kv heads
        self._local = local

    @property
    def preferred_block_size(self) -> int:
        return self._local.preferred_block_size

    @property
    def attention_path(self) -> str:
        return self._local.attention_path

    @property
    def attention_fallback(self) -> str | None:
        return self._local.attention_fallback

    def workspace_bytes(self, positions: int) -> int:
        return self._local.workspace_bytes(positions)

    @property
    def graphs_captured(self) -> int:
        return 0  # capture_decode_graphs: not across ranks

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self._step(Allocate(num_blocks, block_size), lambda: self._local.allocate(num_blocks, block_size))

    def step(self, batch: StepBatch) -> StepOutput:
        return self._step(Step(batch), lambda: self._local.step(batch))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        if pairs:
            self._step(CopyBlocks(tuple(pairs)), lambda: self._local.copy_blocks(pairs))

    def load_lora(self, adapter: LoraAdapter) -> None:
        raise LoraLoadError(adapter.adapter_id, "LoRA adapters are not supported with hf_custom_tp")

    def capture_decode_graphs(self, max_positions: int, max_batch: int) -> str | None:
        return "decode graphs are not captured across tensor-parallel ranks"

    def export_fused_steps(self) -> str | None:
        return "the fused step is not exported across tensor-parallel ranks"


def _engine(
    local: HFTransformersEngine | PagedHFEngine, *args: Any
) -> TensorParallelEngine | TensorParallelPagedEngine:
    if isinstance(local, PagedHFEngine):
        return TensorParallelPagedEngine(local, *args)
    return TensorParallelEngine(local, *args)


def load(
    config: EngineConfig, on_shard_death: Callable[[str], None] = exit_process
) -> TensorParallelEngine | TensorParallelPagedEngine:
    """Validate, spawn ranks 1..N-1, load rank 0's shard, and return rank 0's engine."""
    world_size = config.num_shards
    # Every rank must run the dtype rank 0 picks: resolve the default once and hand it down.
    device0 = shard_device(config, 0)
    if world_size < 1:
        raise ValueError(f"hf_custom_tp needs at least one shard, got {world_size}")
    model_config = AutoConfig.from_pretrained(
        config.model_path, trust_remote_code=config.trust_remote_code, local_files_only=True
    )
    saved = checkpoint_dtype(model_config)
    resolved = resolve_dtype(config.dtype, device0, cpu_bf16=config.cpu_bf16, checkpoint=saved)
    config = replace(config, dtype=str(resolved).removeprefix("torch."))
    # Configuration errors surface here, before any process is started.
    auto_model_class(model_config)
    plan_for(model_config, world_size)
    safetensors_files(config.model_path)
    device = shard_device(config, 0)
    if world_size == 1:
        return _engine(load_shard(config, Shard(0, 1), device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = master_store(config.master_addr, config.master_port, world_size)
    workers = ShardProcesses.spawn(config, store.port)
    try:
        workers.wait_for(store, "ready")
        groups = make_groups(store, 0, world_size, config.master_addr, device)
        local = load_shard(config, Shard(0, world_size, groups.compute), device)
        workers.wait_for(store, "loaded")
    except BaseException:
        workers.join(0.0)
        raise
    workers.watch(on_shard_death)
    engine = _engine(local, CommandChannel(groups.commands), workers, (store, groups))
    atexit.register(engine.close)
    logger.info(f"hf_custom_tp: {world_size} shards of {model_config.model_type} ready on {device.type}")
    return engine
