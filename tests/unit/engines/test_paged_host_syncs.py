"""A paged step reads nothing back from its tensors and sends its inputs in one copy.

On CUDA, a tensor's value read on the host (`.tolist()`, `.item()`, `int(t)`, `bool(t)`, `.cpu()`) waits
for every kernel queued before it: one in a layer stalls the host once per layer, and the GPU idles
while the host catches up. A TorchFunctionMode sees every such call; here it counts them over whole
steps on the CPU, through the code CUDA runs (the varlen paths with the kernel's torch stand-in, whose
own operators are not counted, and the per-sequence torch path), and there must be none. The step's
integer inputs must reach the device in one staged copy (engines/paged/staging.py)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engines.base import EngineSpec
from engines.paged import cpu_kernel, paths, varlen
from engines.paged.engine import build
from engines.paged.step_context import AttentionPath
from engines.step import SequenceChunk, StepBatch
from tests.fixtures.tiny import make_model

BLOCK = 4
HOST_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
}


class HostReads(TorchFunctionMode):
    """Records every call that reads a tensor's values back to the host, outside `paused` stretches."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and not self.paused:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def counted_kernel(mode: HostReads):
    """The kernel's torch stand-in, whose own operators stand for a CUDA kernel's and are not counted."""

    def kernel(*args, **kwargs):
        mode.paused = True
        try:
            return varlen.reference_varlen(*args, **kwargs)
        finally:
            mode.paused = False

    return kernel


def steps() -> list[StepBatch]:
    """Two prompts over several blocks, then decode beside a third prompt, then decode alone."""
    first = (
        SequenceChunk(tuple(range(3, 14)), 0, (0, 1, 2), sample=True),
        SequenceChunk(tuple(range(30, 36)), 0, (4, 5), sample=True),
    )
    decode = (SequenceChunk((7,), 11, (0, 1, 2), sample=True), SequenceChunk((8,), 6, (4, 5), sample=True))
    third = SequenceChunk(tuple(range(40, 47)), 0, (8, 9), all_logits=True)
    return [StepBatch(prefill=first), StepBatch(decode=decode, prefill=(third,)), StepBatch(decode=decode)]


@pytest.mark.parametrize("path", [*AttentionPath])
def test_no_step_reads_a_tensor_back_and_each_sends_its_inputs_once(monkeypatch, path) -> None:
    if path is AttentionPath.PER_SEQUENCE:  # the torch path CUDA falls back to, not the CPU's kernel
        monkeypatch.setattr(cpu_kernel, "decode_kernel", lambda: None)
    elif path is AttentionPath.CPU_KERNEL and cpu_kernel.decode_layer_kernel() is None:
        pytest.fail("the CPU kernel must build on the test machine")
    model = make_model("llama").eval()
    spec = EngineSpec(False, model.config.vocab_size, (), 0, torch.device("cpu"), torch.float32, paged=True)
    engine = build(model, spec, BLOCK)
    mode = HostReads()
    engine.use_attention(paths.AttentionChoice(path, BLOCK, counted_kernel(mode)))
    engine.allocate(16, BLOCK)
    staging = engine._staging
    for batch in steps():
        before = staging.uploads
        with mode:
            engine.step(batch)
        assert mode.calls == [], (path, batch)
        assert staging.uploads == before + 1


def test_the_mode_sees_a_host_read() -> None:
    """The check itself: the calls it must catch are caught."""
    mode = HostReads()
    with mode:
        values = torch.arange(3)
        values.tolist()
        int(values[0])
        bool(values[1] > 0)
    assert {"tolist", "__int__", "__bool__"} <= set(mode.calls)
