"""Tensor-parallel engine: an unmodified transformers model sharded over torch.distributed ranks."""

from engines.hf_custom_tp.engine import TensorParallelEngine, TensorParallelPagedEngine, load

__all__ = ["TensorParallelEngine", "TensorParallelPagedEngine", "load"]
