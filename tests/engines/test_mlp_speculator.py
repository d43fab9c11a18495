"""The MLP speculator: its config, the math of a head, greedy proposals, and its checkpoint files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.speculative import MLPSpeculator, MLPSpeculatorConfig, load_mlp_speculator, save_mlp_speculator
from engines.speculative.mlp import CHECKPOINT_PREFIX

SMALL = MLPSpeculatorConfig(vocab_size=50, emb_dim=16, inner_dim=8, n_predict=3)
TIED = MLPSpeculatorConfig(
    vocab_size=50, emb_dim=16, inner_dim=8, n_predict=4, tie_weights=True, scale_input=True
)


def random_speculator(config: MLPSpeculatorConfig, seed: int = 0) -> MLPSpeculator:
    torch.manual_seed(seed)
    model = MLPSpeculator(config).eval()
    with torch.no_grad():  # norms start at 1 and 0; vary them so a mix-up of weight and bias shows
        for name, param in model.canonical_parameters().items():
            if name.startswith("ln."):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def inputs(config: MLPSpeculatorConfig, rows: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, config.emb_dim, generator=generator) * 3
    return hidden, torch.randint(0, config.vocab_size, (rows,), generator=generator)


def test_config_round_trips_through_json_and_ignores_unknown_keys() -> None:
    written = json.loads(json.dumps(TIED.to_dict(torch.bfloat16)))
    assert written["model_type"] == "mlp_speculator"
    assert written["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    assert written["torch_dtype"] == "bfloat16"
    assert MLPSpeculatorConfig.from_dict(written | {"transformers_version": "4.40.0"}) == TIED


def test_config_reads_a_public_style_config() -> None:
    raw = {
        "architectures": ["MLPSpeculatorPreTrainedModel"],
        "emb_dim": 4096,
        "inner_dim": 0,
        "model_type": "mlp_speculator",
        "n_candidates": 5,
        "n_predict": 3,
        "top_k_tokens_per_head": [5, 4, 3],
        "torch_dtype": "float16",
        "vocab_size": 32000,
    }
    config = MLPSpeculatorConfig.from_dict(raw)
    assert config.resolved_inner_dim == 4096
    assert config.top_k_tokens_per_head == (5, 4, 3)
    assert (config.tie_weights, config.scale_input) == (False, False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "model_type"),
        ({"n_predict": 0, "top_k_tokens_per_head": []}, "n_predict"),
        ({"top_k_tokens_per_head": [5, 4]}, "top_k_tokens_per_head"),
        ({"top_k_tokens_per_head": "5,4,3"}, "top_k_tokens_per_head"),
        ({"inner_dim": -1}, "inner_dim"),
        ({"emb_dim": True}, "emb_dim"),
        ({"tie_weights": "yes"}, "tie_weights"),
        ({"n_predict": 1, "top_k_tokens_per_head": [1], "tie_weights": True}, "tie_weights"),
    ],
)
def test_config_refuses_bad_fields(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLPSpeculatorConfig.from_dict(SMALL.to_dict() | change)


def test_config_needs_the_dimensions() -> None:
    raw = SMALL.to_dict()
    del raw["emb_dim"]
    with pytest.raises(ValueError, match="emb_dim"):
        MLPSpeculatorConfig.from_dict(raw)


def test_token_scale_matches_the_reference_constants() -> None:
    # state_weight = 0.5 ** (0.5 / n_predict); emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2).
    # n_predict=1, inner_dim=2: state_weight = sqrt(0.5), emb_weight = sqrt(0.5), ratio 1.
    assert MLPSpeculatorConfig(vocab_size=5, emb_dim=2, n_predict=1).token_scale == pytest.approx(1.0)
    # n_predict=2, inner_dim=4: state_weight = 0.840896, emb_weight = sqrt(0.292893 * 2) = 0.765367.
    two = MLPSpeculatorConfig(vocab_size=5, emb_dim=4, n_predict=2)
    assert two.token_scale == pytest.approx(0.765367 / 0.840896, rel=1e-5)


def _gelu(x: float) -> float:
    return x * 0.5 * (1 + math.erf(x / math.sqrt(2)))


@pytest.mark.parametrize("scale_input", [False, True])
def test_one_head_by_hand(scale_input: bool) -> None:
    config = MLPSpeculatorConfig(vocab_size=5, emb_dim=2, inner_dim=2, n_predict=1, scale_input=scale_input)
    model = MLPSpeculator(config)
    with torch.no_grad():
        model.get_parameter("proj.0.weight").copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        model.get_parameter("emb.0.weight").copy_(torch.arange(10.0).view(5, 2) - 5)  # row 4: [3, 4]
        model.get_parameter("ln.0.weight").copy_(torch.tensor([2.0, 1.0]))
        model.get_parameter("ln.0.bias").copy_(torch.tensor([0.0, 0.5]))
        head = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [1.0, -1.0]])
        model.get_parameter("head.0.weight").copy_(head)
    h = [3.0, 1.0]
    if scale_input:  # divide by the root mean square (no mean subtracted), then by sqrt(2)
        rms = math.sqrt((h[0] ** 2 + h[1] ** 2) / 2)
        h = [v / rms / math.sqrt(2) for v in h]
    # proj @ h + 1.0 (the token scale for n_predict=1, inner_dim=2) * emb[4]
    mixed = [h[0] + 3.0, 2 * h[1] + 4.0]
    rms = math.sqrt((mixed[0] ** 2 + mixed[1] ** 2) / 2 + 1e-6)
    state = [_gelu(2.0 * mixed[0] / rms), _gelu(1.0 * mixed[1] / rms + 0.5)]
    expected = [sum(w * s for w, s in zip(row, state, strict=True)) for row in head.tolist()]

    logits = model(torch.tensor([[3.0, 1.0]]), torch.tensor([[4]]))
    assert logits.shape == (1, 1, 5)
    torch.testing.assert_close(logits[0, 0], torch.tensor(expected), rtol=1e-5, atol=1e-6)
    best = max(range(5), key=lambda i: expected[i])
    assert model.propose(torch.tensor([[3.0, 1.0]]), torch.tensor([4]), 1).tolist() == [[best]]


@pytest.mark.parametrize("config", [SMALL, TIED], ids=["plain", "tied-scaled"])
def test_proposals_are_the_greedy_chain_of_the_heads(config: MLPSpeculatorConfig) -> None:
    model = random_speculator(config)
    hidden, last = inputs(config)
    proposed = model.propose(hidden, last, config.n_predict)
    assert proposed.shape == (6, config.n_predict)
    assert proposed.dtype == torch.long
    # Teacher-forcing each head with the previous head's pick must reproduce every pick.
    chain = torch.cat([last[:, None], proposed[:, :-1]], dim=1)
    with torch.no_grad():
        assert torch.equal(model(hidden, chain).argmax(-1).T, proposed)
    assert len({tuple(row) for row in proposed.tolist()}) > 1  # the heads depend on their inputs


def test_proposals_are_deterministic_prefixes_and_batch_independent() -> None:
    model = random_speculator(SMALL)
    hidden, last = inputs(SMALL)
    full = model.propose(hidden, last, 3)
    assert torch.equal(model.propose(hidden, last, 3), full)
    assert torch.equal(model.propose(hidden, last, 2), full[:, :2])
    assert model.propose(hidden, last, 0).shape == (6, 0)
    for row in range(6):
        assert torch.equal(model.propose(hidden[row : row + 1], last[row : row + 1], 3), full[row : row + 1])


def test_proposals_refuse_bad_inputs() -> None:
    model = random_speculator(SMALL)
    hidden, last = inputs(SMALL)
    with pytest.raises(ValueError, match="n_predict"):
        model.propose(hidden, last, 4)
    with pytest.raises(ValueError, match="emb_dim"):
        model.propose(hidden[:, :8], last, 2)
    with pytest.raises(ValueError, match="last_tokens"):
        model.propose(hidden, last[:3], 2)


def test_tied_weights_share_storage_as_described() -> None:
    model = MLPSpeculator(TIED)
    assert model.get_parameter("emb.3.weight") is model.get_parameter("emb.0.weight")
    assert model.get_parameter("head.2.weight") is model.get_parameter("head.0.weight")
    assert model.get_parameter("ln.1.bias") is model.get_parameter("ln.0.bias")
    assert model.get_parameter("proj.3.weight") is model.get_parameter("proj.1.weight")
    assert model.get_parameter("proj.1.weight") is not model.get_parameter("proj.0.weight")
    assert sorted(model.canonical_parameters()) == [
        "emb.0.weight",
        "head.0.weight",
        "ln.0.bias",
        "ln.0.weight",
        "proj.0.weight",
        "proj.1.weight",
    ]


@pytest.mark.parametrize("config", [SMALL, TIED], ids=["plain", "tied-scaled"])
def test_save_then_load_gives_the_same_parameters_and_proposals(
    config: MLPSpeculatorConfig, tmp_path: Path
) -> None:
    model = random_speculator(config)
    save_mlp_speculator(model, config, tmp_path)
    loaded = load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)
    assert loaded.config == config
    assert not loaded.training
    original = dict(model.named_parameters(remove_duplicate=False))
    for name, param in loaded.named_parameters(remove_duplicate=False):
        assert torch.equal(param, original[name]), name
    if config.tie_weights:
        assert loaded.get_parameter("emb.2.weight") is loaded.get_parameter("emb.0.weight")
    hidden, last = inputs(config)
    n = config.n_predict
    assert torch.equal(loaded.propose(hidden, last, n), model.propose(hidden, last, n))


def test_files_carry_the_public_names_and_load_state_dict_takes_them_as_they_are(tmp_path: Path) -> None:
    model = random_speculator(TIED)
    save_mlp_speculator(model, TIED, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    # A tied checkpoint stores each shared tensor once, under its first stage's name.
    assert sorted(tensors) == [
        f"{CHECKPOINT_PREFIX}{name}"
        for name in (
            "emb.0.weight",
            "head.0.weight",
            "ln.0.bias",
            "ln.0.weight",
            "proj.0.weight",
            "proj.1.weight",
        )
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator"
    assert config["architectures"] == ["MLPSpeculatorPreTrainedModel"]
    fresh = MLPSpeculator(TIED)
    fresh.load_state_dict(tensors)
    assert torch.equal(fresh.get_parameter("head.3.weight"), model.get_parameter("head.0.weight"))
    assert torch.equal(fresh.get_parameter("proj.2.weight"), model.get_parameter("proj.1.weight"))


def test_loads_every_tied_copy_when_a_checkpoint_stores_them_all(tmp_path: Path) -> None:
    model = random_speculator(TIED)
    save_mlp_speculator(model, TIED, tmp_path)
    every = {CHECKPOINT_PREFIX + k: v.clone() for k, v in model.state_dict().items()}
    save_file(every, str(tmp_path / "model.safetensors"))
    loaded = load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.get_parameter("emb.3.weight"), model.get_parameter("emb.0.weight"))
    every[f"{CHECKPOINT_PREFIX}emb.2.weight"] += 1.0
    save_file(every, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"emb\.2\.weight differs from emb\.0\.weight"):
        load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)


def test_loads_a_tied_copy_kept_under_another_stages_name(tmp_path: Path) -> None:
    model = random_speculator(TIED)
    save_mlp_speculator(model, TIED, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors[f"{CHECKPOINT_PREFIX}emb.2.weight"] = tensors.pop(f"{CHECKPOINT_PREFIX}emb.0.weight")
    tensors[f"{CHECKPOINT_PREFIX}proj.3.weight"] = tensors.pop(f"{CHECKPOINT_PREFIX}proj.1.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.get_parameter("emb.0.weight"), model.get_parameter("emb.0.weight"))
    assert torch.equal(loaded.get_parameter("proj.1.weight"), model.get_parameter("proj.1.weight"))
    hidden, last = inputs(TIED)
    assert torch.equal(loaded.propose(hidden, last, 4), model.propose(hidden, last, 4))


def test_loads_pytorch_bin_and_sharded_safetensors(tmp_path: Path) -> None:
    model = random_speculator(SMALL)
    hidden, last = inputs(SMALL)
    expected = model.propose(hidden, last, 3)
    save_mlp_speculator(model, SMALL, tmp_path / "st")
    tensors = load_file(str(tmp_path / "st" / "model.safetensors"))

    as_bin = tmp_path / "bin"
    as_bin.mkdir()
    (as_bin / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(tensors, as_bin / "pytorch_model.bin")
    assert torch.equal(
        load_mlp_speculator(as_bin, device="cpu", dtype=torch.float32).propose(hidden, last, 3), expected
    )

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({key: tensors[key] for key in keys}, str(sharded / file))
    weight_map = {key: file for file, keys in shards.items() for key in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loaded = load_mlp_speculator(sharded, device="cpu", dtype=torch.float32)
    assert torch.equal(loaded.propose(hidden, last, 3), expected)


def test_loads_in_another_dtype(tmp_path: Path) -> None:
    save_mlp_speculator(random_speculator(SMALL), SMALL, tmp_path)
    loaded = load_mlp_speculator(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    hidden, last = inputs(SMALL)
    assert loaded.propose(hidden, last, 3).shape == (6, 3)  # float32 states are cast to the weights' dtype


def test_wrong_model_type_is_a_clear_error(tmp_path: Path) -> None:
    save_mlp_speculator(random_speculator(SMALL), SMALL, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type is 'gpt2', expected 'mlp_speculator'"):
        load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 60}, r"speculator weight emb.0.weight .* has shape \[50, 8\].* needs \[60, 8\]"),
        ({"emb_dim": 32}, r"proj.0.weight .* has shape \[8, 16\].* needs \[8, 32\]"),
        ({"n_predict": 4, "top_k_tokens_per_head": [1, 1, 1, 1]}, r"missing \['emb.3.weight'"),
        ({"n_predict": 2, "top_k_tokens_per_head": [1, 1]}, r"unexpected \['emb.2.weight'"),
    ],
)
def test_weights_that_do_not_fit_the_config_are_a_clear_error(
    tmp_path: Path, change: dict[str, object], message: str
) -> None:
    save_mlp_speculator(random_speculator(SMALL), SMALL, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ValueError, match=message):
        load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)


def test_missing_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(SMALL.to_dict()))
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32)


def test_save_refuses_a_config_of_another_shape(tmp_path: Path) -> None:
    model = random_speculator(SMALL)
    with pytest.raises(ValueError, match="config describes"):
        save_mlp_speculator(model, MLPSpeculatorConfig(vocab_size=50, emb_dim=16, n_predict=3), tmp_path)
    # The candidate-tree fields are free to differ: they do not change the weights.
    tree = MLPSpeculatorConfig(
        vocab_size=50, emb_dim=16, inner_dim=8, n_predict=3, top_k_tokens_per_head=(5, 4, 3), n_candidates=7
    )
    save_mlp_speculator(model, tree, tmp_path)
    assert load_mlp_speculator(tmp_path, device="cpu", dtype=torch.float32).config == tree
