"""LoRA adapters mixed per row in one batch: the peft wrapper around a model and the adapters loaded into it.

peft is imported only when the first adapter is loaded: a server that never sees a LoRA row neither
pays for the import nor runs its model through a peft wrapper.
"""

from __future__ import annotations

import contextlib
import functools
import re
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from engines.base import AdapterUnavailableError, LoraAdapter

if TYPE_CHECKING:
    from peft import PeftModel

# peft's entry in `adapter_names` for a row that runs the base model alone.
BASE = "__base__"


class LoraLoadError(AdapterUnavailableError):
    """An adapter directory could not be loaded into the model; the model is left as it was."""


def _inject_adapter_names(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A forward pre-hook giving a peft layer one adapter name per batch row, as peft's own hook does."""
    kwargs["adapter_names"] = names
    return args, kwargs


def _tokens_as_rows(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A flat step's [1, T, ...] input seen as T rows of one token, one adapter name per token."""
    kwargs["adapter_names"] = names
    return (args[0].transpose(0, 1), *args[1:]), kwargs


def _rows_as_tokens(module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return output.transpose(0, 1)


class LoraAdapters:
    """The LoRA adapters loaded into one model, each under a peft-safe name, and how to run rows with them.

    The first load wraps the model in a `peft.PeftModel` (LoRA layers are injected into the model's
    own modules, so callers keep calling the model they hold); unloading the last adapter unwraps it,
    restoring the plain modules. While wrapped, every model call must run inside `forward_context`,
    else peft would apply its active adapter to every row.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._peft: PeftModel | None = None
        self._names: dict[str, str] = {}  # adapter id -> peft adapter name
        self._loaded = 0  # numbers peft names, so a reloaded id never reuses a deleted name
        self._layers: list[torch.nn.Module] = []  # modules that take `adapter_names`

    @property
    def wrapped(self) -> bool:
        """Whether the model currently runs through peft (at least one adapter is loaded)."""
        return self._peft is not None

    @property
    def peft_model(self) -> PeftModel | None:
        return self._peft

    @property
    def loaded(self) -> frozenset[str]:
        """Ids of the adapters loaded now."""
        return frozenset(self._names)

    def peft_name(self, adapter_id: str) -> str:
        """The name peft knows a loaded adapter by (ids may hold '/', peft names may not hold '.')."""
        return self._names[adapter_id]

    def load(self, adapter: LoraAdapter) -> None:
        """Load `adapter` unless its id is loaded; a failure raises LoraLoadError and changes nothing."""
        if adapter.adapter_id in self._names:
            return
        from peft import LoraConfig, PeftConfig, PeftModel

        try:
            config = PeftConfig.from_pretrained(str(adapter.path))
        except Exception as e:
            raise LoraLoadError(adapter.adapter_id, f"cannot read LoRA adapter config: {e}") from e
        if not isinstance(config, LoraConfig):
            kind = getattr(config.peft_type, "value", config.peft_type)  # PeftType.X formats with its class
            raise LoraLoadError(adapter.adapter_id, f"adapter type {kind} is not currently supported")
        if config.use_dora or getattr(config, "alora_invocation_tokens", None):
            raise LoraLoadError(
                adapter.adapter_id, "DoRA and aLoRA adapters cannot be mixed with other rows in a batch"
            )
        self._loaded += 1
        name = f"{re.sub(r'[^0-9A-Za-z_]', '_', adapter.adapter_id)}__{self._loaded}"
        created = self._peft is None
        config.inference_mode = True
        try:
            if self._peft is None:
                # Injects this adapter's (freshly initialised) LoRA layers; its weights are read below.
                self._peft = PeftModel(self._model, config, adapter_name=name)
                self._peft.eval()
            self._peft.load_adapter(str(adapter.path), adapter_name=name, torch_device=str(self._device))
        except Exception as e:
            self._discard(name, unwrap=created)
            raise LoraLoadError(adapter.adapter_id, f"cannot load LoRA adapter: {e}") from e
        self._names[adapter.adapter_id] = name
        self._find_layers()

    def unload(self, adapter_id: str) -> None:
        """Delete a loaded adapter from the model (no-op if not loaded); the last one unwraps the model."""
        name = self._names.pop(adapter_id, None)
        if name is not None:
            self._discard(name, unwrap=not self._names)
            self._find_layers()

    def _discard(self, name: str, unwrap: bool) -> None:
        if self._peft is None:
            return
        if unwrap:
            self._peft.unload()  # puts the base layers back in place of the LoRA layers
            self._peft = None
        elif name in self._peft.peft_config:
            with warnings.catch_warnings():
                # Which adapter peft makes "active" next is moot: every call names each row's adapter.
                warnings.filterwarnings("ignore", message=r"Adapter .* was active which is now deleted")
                self._peft.delete_adapter(name)

    def _find_layers(self) -> None:
        if self._peft is None:
            self._layers = []
            return
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        self._layers = [
            module
            for module in self._model.modules()
            if isinstance(module, LoraLayer | AuxiliaryTrainingWrapper)
        ]

    @contextlib.contextmanager
    def forward_context(self, adapter_ids: Sequence[str | None], *, flat: bool = False) -> Iterator[None]:
        """Model calls inside run row i with adapter `adapter_ids[i]` (None: the base model).

        peft's mixed-batch inference: each LoRA layer gets `adapter_names`, one entry per batch row,
        and adds each adapter's update to its own rows only. `flat`: the model runs one [1, T] row
        of tokens from many sequences, and `adapter_ids` names one adapter per token; each LoRA layer
        then sees its input as T one-token rows (and gives its output back as one row). The hooks
        are removed on exit, also when the call raised.
        """
        if self._peft is None:
            yield
            return
        names = [BASE if adapter_id is None else self._names[adapter_id] for adapter_id in adapter_ids]
        hook = functools.partial(_tokens_as_rows if flat else _inject_adapter_names, names=names)
        handles = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in self._layers]
        if flat:
            handles += [layer.register_forward_hook(_rows_as_tokens) for layer in self._layers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
