"""The MLP speculator's files, as the public `*-accelerator` checkpoints lay them out: config.json, and
model.safetensors, pytorch_model.bin or either's shards, with the module's names under `speculator.`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from engines.speculative.mlp import CHECKPOINT_PREFIX, MLPSpeculator, MLPSpeculatorConfig, fill_tied_copies

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"


def read_config(path: Path) -> MLPSpeculatorConfig:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"No {CONFIG_FILE} in the speculator directory {path}")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    try:
        return MLPSpeculatorConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{config_path}: {exc}") from exc


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of model.safetensors, pytorch_model.bin, or either's shards named by an index json."""
    for name in (SAFETENSORS_FILE, TORCH_FILE):
        if (path / name).is_file():
            return _read_weight_file(path / name)
        index = path / f"{name}.index.json"
        if index.is_file():
            return _read_shards(index)
    raise FileNotFoundError(
        f"No speculator weights in {path}: expected {SAFETENSORS_FILE}, {TORCH_FILE} or a sharded index"
    )


def _read_weight_file(file: Path) -> dict[str, torch.Tensor]:
    if file.name.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(str(file), device="cpu")
    loaded = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict):
        raise ValueError(f"{file} does not hold a state dict")
    return loaded


def _read_shards(index: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise ValueError(f"{index} names a shard outside its directory: {shard!r}")
        loaded = _read_weight_file(index.parent / shard)
        tensors.update({key: value for key, value in loaded.items() if weight_map.get(key) == shard})
    return tensors


def check_checkpoint(model: MLPSpeculator, tensors: Mapping[str, torch.Tensor], source: Path) -> None:
    """Raise ValueError unless `tensors` (prefix stripped, tied copies filled) are exactly `model`'s
    parameters, in shape, and tied copies agree."""
    expected = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    aliases = model.tied_aliases()
    unexpected = sorted(set(tensors) - set(expected))
    missing = sorted(name for name in expected if name not in tensors)
    if unexpected or missing:
        raise ValueError(
            f"The speculator weights in {source} do not match its config (n_predict="
            f"{model.config.n_predict}, tie_weights={model.config.tie_weights}): "
            f"missing {missing or 'nothing'}, unexpected {unexpected or 'nothing'}"
        )
    c = model.config
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"The speculator weight {name} in {source} has shape {list(tensor.shape)}, but the config "
                f"(vocab_size={c.vocab_size}, emb_dim={c.emb_dim}, inner_dim={c.resolved_inner_dim}) "
                f"needs {list(expected[name])}"
            )
        canonical = aliases.get(name)
        if canonical is not None and not torch.equal(tensor, tensors[canonical]):
            raise ValueError(f"tie_weights is set, but {name} differs from {canonical} in {source}")


def load_mlp_speculator(
    path: Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> MLPSpeculator:
    """The speculator saved in directory `path`, in eval mode without gradients, on `device` as `dtype`."""
    config = read_config(path)
    tensors = {key.removeprefix(CHECKPOINT_PREFIX): value for key, value in read_checkpoint(path).items()}
    # Built on the meta device: random initialisation of a 128k-vocabulary model would cost seconds.
    model = MLPSpeculator(config, device="meta", dtype=dtype)
    fill_tied_copies(tensors, model.tie_groups())
    check_checkpoint(model, tensors, path)
    model.to_empty(device=device)
    model.tie_stages()
    model.load_state_dict(tensors)
    return model.eval().requires_grad_(False)


def save_mlp_speculator(model: MLPSpeculator, config: MLPSpeculatorConfig, path: Path) -> Path:
    """Write config.json and model.safetensors into directory `path`, named as the public checkpoints.

    `config` may differ from `model.config` only in the candidate-tree fields.
    """
    from safetensors.torch import save_file

    if config.architecture() != model.config.architecture():
        raise ValueError(
            f"config describes {config.architecture()}, the model is {model.config.architecture()} "
            "(vocab_size, emb_dim, inner_dim, n_predict, tie_weights, scale_input)"
        )
    path.mkdir(parents=True, exist_ok=True)
    params = model.canonical_parameters()
    tensors = {CHECKPOINT_PREFIX + name: p.detach().to("cpu").contiguous() for name, p in params.items()}
    save_file(tensors, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    dtype = next(iter(params.values())).dtype
    (path / CONFIG_FILE).write_text(json.dumps(config.to_dict(dtype), indent=2) + "\n", encoding="utf-8")
    return path
