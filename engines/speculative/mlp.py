"""The MLP speculator of IBM's `*-accelerator` checkpoints: its config, module and greedy proposals (its
files: engines/speculative/checkpoint.py).

Each head i turns a state into the next: the state is projected, the (scaled) embedding of the token the
chain last produced is added, then an RMS "layer norm" (no mean subtracted; learned scale and shift) and
GELU give the new state, from which head i's vocabulary projection picks token i. Head 0's state is the
target model's final hidden state (the LM head's input) at the position that produced the last token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, cast

import torch
from torch import nn

MODEL_TYPE = "mlp_speculator"
ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
# The public checkpoints were saved from a transformers wrapper holding the module as `speculator`.
CHECKPOINT_PREFIX = "speculator."
NORM_EPS = 1e-6


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class MLPSpeculatorConfig:
    """The fields of an `mlp_speculator` config.json; `top_k_tokens_per_head` and `n_candidates` only
    shape candidate trees, which a greedy chain does not build, but they are kept for round trips."""

    vocab_size: int
    emb_dim: int
    inner_dim: int = 0  # 0 means emb_dim, as in the public configs
    n_predict: int = 3
    top_k_tokens_per_head: tuple[int, ...] = field(default=())  # empty: 1 per head (a greedy chain)
    n_candidates: int = 5
    tie_weights: bool = False
    scale_input: bool = False

    def __post_init__(self) -> None:
        top_k = tuple(self.top_k_tokens_per_head) or (1,) * (self.n_predict if _is_int(self.n_predict) else 0)
        object.__setattr__(self, "top_k_tokens_per_head", top_k)
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "emb_dim", "n_predict", "n_candidates"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"mlp_speculator config: {name} must be a positive integer, not {value!r}")
        if not _is_int(self.inner_dim) or self.inner_dim < 0:
            raise ValueError(
                f"mlp_speculator config: inner_dim must be an integer >= 0, not {self.inner_dim!r}"
            )
        for name in ("tie_weights", "scale_input"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"mlp_speculator config: {name} must be true or false")
        top_k = self.top_k_tokens_per_head
        if len(top_k) != self.n_predict or not all(_is_int(k) and k >= 1 for k in top_k):
            raise ValueError(
                f"mlp_speculator config: top_k_tokens_per_head must be {self.n_predict} positive "
                f"integers (one per head), not {list(top_k)}"
            )
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("mlp_speculator config: tie_weights needs n_predict >= 2 (heads to tie)")

    @property
    def resolved_inner_dim(self) -> int:
        return self.inner_dim or self.emb_dim

    @property
    def token_scale(self) -> float:
        """How much more the token embedding weighs than the projected state before each norm.

        The state is meant to weigh `state_weight` and the embedding `emb_weight`; the norm that follows
        removes a common factor, so only their ratio matters. The weights make the base model's state
        keep half its share of the magnitude by the last head.
        """
        state_weight = 0.5 ** (0.5 / self.n_predict)
        emb_weight = math.sqrt((1 - state_weight**2) * (self.resolved_inner_dim / 2))
        return emb_weight / state_weight

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> MLPSpeculatorConfig:
        """From a parsed config.json; keys that are not fields (architectures, torch_dtype) are ignored."""
        model_type = raw.get("model_type")
        if model_type != MODEL_TYPE:
            raise ValueError(f"config model_type is {model_type!r}, expected {MODEL_TYPE!r}")
        missing = [name for name in ("vocab_size", "emb_dim") if name not in raw]
        if missing:
            raise ValueError(f"mlp_speculator config lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        values = {name: value for name, value in raw.items() if name in known}
        if isinstance(values.get("top_k_tokens_per_head"), list):
            values["top_k_tokens_per_head"] = tuple(values["top_k_tokens_per_head"])
        elif "top_k_tokens_per_head" in values:
            raise ValueError("mlp_speculator config: top_k_tokens_per_head must be a list")
        return cls(**values)

    def to_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """The config.json content, with the keys the public checkpoints carry besides the fields."""
        content: dict[str, Any] = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE}
        for f in fields(self):
            content[f.name] = getattr(self, f.name)
        content["top_k_tokens_per_head"] = list(self.top_k_tokens_per_head)
        if dtype is not None:
            content["torch_dtype"] = str(dtype).removeprefix("torch.")
        return content

    def architecture(self) -> tuple[int, int, int, int, bool, bool]:
        """What decides the parameter shapes and the math (unlike the tree-search fields)."""
        return (
            self.vocab_size,
            self.emb_dim,
            self.resolved_inner_dim,
            self.n_predict,
            self.tie_weights,
            self.scale_input,
        )


class StateNorm(nn.Module):
    """The speculator's "layer norm": divide by the root mean square (no mean is subtracted), then an
    optional elementwise scale and shift. Computed in float32 so half-precision states do not overflow."""

    def __init__(
        self,
        dim: int,
        *,
        affine: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
            self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm accumulates half-precision inputs in float32, and returns the input's dtype.
        normed = nn.functional.rms_norm(x, (x.shape[-1],), eps=NORM_EPS)
        return torch.addcmul(self.bias, normed, self.weight) if self.affine else normed


class MLPSpeculator(nn.Module):
    """Parameters are named as in the checkpoints (`emb.i`, `proj.i`, `head.i`, `ln.i`); loading a state
    dict also takes the checkpoints' `speculator.` prefix and, when tied, their single stored copy."""

    def __init__(
        self,
        config: MLPSpeculatorConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        inner, vocab, n = config.resolved_inner_dim, config.vocab_size, config.n_predict
        where: dict[str, Any] = {"device": device, "dtype": dtype}
        self.emb = nn.ModuleList(nn.Embedding(vocab, inner, **where) for _ in range(n))
        self.proj = nn.ModuleList(
            nn.Linear(config.emb_dim if i == 0 else inner, inner, bias=False, **where) for i in range(n)
        )
        self.head = nn.ModuleList(nn.Linear(inner, vocab, bias=False, **where) for _ in range(n))
        self.ln = nn.ModuleList(StateNorm(inner, affine=True, **where) for _ in range(n))
        # Parameter-free, so absent from checkpoints: rescales a base model state of unusual size.
        self.ln0 = StateNorm(config.emb_dim, affine=False) if config.scale_input else None
        self.token_scale = config.token_scale
        self.tie_stages()
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(_accept_checkpoint_names)

    def tied_aliases(self) -> dict[str, str]:
        """Parameter name -> the name it shares storage with, when tie_weights (else empty).

        Every stage shares the first stage's embedding, head and norm; projections after the second
        share the second's, since the first reads the base model's width.
        """
        if not self.config.tie_weights:
            return {}
        aliases: dict[str, str] = {}
        for i in range(1, self.config.n_predict):
            for name in (f"emb.{i}.weight", f"head.{i}.weight", f"ln.{i}.weight", f"ln.{i}.bias"):
                aliases[name] = name.replace(f".{i}.", ".0.")
            if i >= 2:
                aliases[f"proj.{i}.weight"] = "proj.1.weight"
        return aliases

    def tie_groups(self) -> dict[str, list[str]]:
        """Each tied parameter's first name -> every name it goes by (empty unless tie_weights)."""
        groups: dict[str, list[str]] = {}
        for alias, canonical in self.tied_aliases().items():
            groups.setdefault(canonical, [canonical]).append(alias)
        return groups

    def tie_stages(self) -> None:
        """Make tied parameters one object again (after moving or assigning them, which can split them)."""
        for alias, canonical in self.tied_aliases().items():
            module_name, _, param_name = alias.rpartition(".")
            setattr(self.get_submodule(module_name), param_name, self.get_parameter(canonical))

    def reset_parameters(self) -> None:
        """Random weights as the reference trainer starts them: N(0, 1/inner_dim) matrices, unit norms."""
        std = 1 / math.sqrt(self.config.resolved_inner_dim)
        with torch.no_grad():
            for name, param in self.canonical_parameters().items():
                if name.startswith("ln."):
                    param.fill_(1.0 if name.endswith(".weight") else 0.0)
                else:
                    param.normal_(0.0, std)

    def canonical_parameters(self) -> dict[str, nn.Parameter]:
        """Each distinct parameter once, by the name a checkpoint stores it under (minus the prefix)."""
        aliases = self.tied_aliases()
        return {name: p for name, p in self.named_parameters(remove_duplicate=False) if name not in aliases}

    def input_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The base model's state as head 0 reads it."""
        hidden = hidden.to(self.get_parameter("proj.0.weight").dtype)
        if self.ln0 is None:
            return hidden
        return self.ln0(hidden) / math.sqrt(2)

    def advance(self, stage: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The state after head `stage` has seen `tokens` (the chain's last token per row).

        Few torch calls, since proposals run on the engine thread while the event loop streams the last
        step's tokens: every call lets go of the GIL and may wait a switch interval to take it back. The
        stage is an embedding, the projection's transposed view, an addmm, rms_norm, addcmul and GELU
        (StateNorm): six calls where it was fourteen. 16 streams' 4-token proposals of the demo
        speculator took 9-12 ms instead of 18-27 ms beside a busy Python thread (2-core Xeon), the same
        2.2 ms alone."""
        projection = cast(nn.Linear, self.proj[stage]).weight.t()
        mixed = torch.addmm(self.emb[stage](tokens), state, projection, beta=self.token_scale)
        return nn.functional.gelu(self.ln[stage](mixed))

    def forward(self, hidden: torch.Tensor, chain_tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits for training: hidden [P, emb_dim], chain_tokens [P, m] (m <= n_predict)
        where column i is the token fed to head i. Returns [m, P, vocab_size]."""
        state = self.input_state(hidden)
        logits = []
        for stage in range(chain_tokens.shape[1]):
            state = self.advance(stage, state, chain_tokens[:, stage])
            logits.append(self.head[stage](state))
        return torch.stack(logits)

    def propose(self, hidden: torch.Tensor, last_tokens: torch.Tensor, k: int) -> torch.Tensor:
        """The greedy chain of k proposed token ids [B, k] (int64) following `last_tokens` [B].

        `hidden` [B, emb_dim] is the base model's final hidden state (after its final norm, the LM
        head's input) at the position that produced `last_tokens`.
        """
        self._check_proposal_inputs(hidden, last_tokens, k)
        with torch.inference_mode():
            state = self.input_state(hidden)
            tokens = last_tokens.long()
            proposed = []
            for stage in range(k):
                state = self.advance(stage, state, tokens)
                tokens = self.head[stage](state).argmax(dim=-1)
                proposed.append(tokens)
            if not proposed:
                return last_tokens.new_empty((last_tokens.shape[0], 0), dtype=torch.long)
            return torch.stack(proposed, dim=1)

    def _check_proposal_inputs(self, hidden: torch.Tensor, last_tokens: torch.Tensor, k: int) -> None:
        if hidden.dim() != 2 or hidden.shape[1] != self.config.emb_dim:
            raise ValueError(
                f"hidden must be [batch, {self.config.emb_dim}] (the speculator's emb_dim), "
                f"not {list(hidden.shape)}"
            )
        if last_tokens.shape != hidden.shape[:1]:
            raise ValueError(f"last_tokens must be [{hidden.shape[0]}], not {list(last_tokens.shape)}")
        if not 0 <= k <= self.config.n_predict:
            raise ValueError(f"k must be between 0 and n_predict={self.config.n_predict}, not {k}")


def _accept_checkpoint_names(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any, **__: Any
) -> None:
    # load_state_dict hands hooks its own copy of the dict, so renaming here leaves the caller's alone.
    assert isinstance(module, MLPSpeculator)
    for key in [k for k in state_dict if k.startswith(prefix + CHECKPOINT_PREFIX)]:
        state_dict[prefix + key.removeprefix(prefix + CHECKPOINT_PREFIX)] = state_dict.pop(key)
    fill_tied_copies(state_dict, module.tie_groups(), prefix)


def fill_tied_copies(tensors: dict[str, Any], groups: Mapping[str, list[str]], prefix: str = "") -> None:
    """Give every name of a tied group the tensor stored under one of them: checkpoints may keep one copy
    (under the first stage's name, or another), or all."""
    for names in groups.values():
        stored = next((tensors[prefix + name] for name in names if prefix + name in tensors), None)
        if stored is not None:
            for name in names:
                tensors.setdefault(prefix + name, stored)
