"""The adapter store (SPEC §8): ids, store layouts, checks, LRU cache, concurrency, metrics, settings."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engines.base import LoraAdapter, PrefixEmbeddings
from tests.fixtures.adapters import write_lora, write_peft_prompt_tuning, write_raw_prefix
from tgis.adapters import AdapterLoadError, AdapterNotFound, AdapterStore, model_hidden_size
from tgis.adapters import store as store_module
from tgis.config import Settings, StartupError, max_prefix_length
from tgis.metrics import Metrics

HIDDEN = 16
MIB = 2**20
# [64, 1024] float32 is 256 KiB: four of them fill a 1 MiB cache exactly.
QUARTER_MIB_ROWS, QUARTER_MIB_HIDDEN = 64, 1024


def embeddings(rows: int, hidden: int = HIDDEN, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def make_store(root: Path, **overrides: Any) -> AdapterStore:
    options: dict[str, Any] = {
        "is_encoder_decoder": False,
        "hidden_size": HIDDEN,
        "dtype": torch.float32,
        "device": torch.device("cpu"),
        "max_prefix_length": 64,
        "cache_size_mb": 1,
    }
    options.update(overrides)
    return AdapterStore(root, **options)


def load_failure(store: AdapterStore, adapter_id: str) -> str:
    with pytest.raises(AdapterLoadError) as caught:
        store.get(adapter_id)
    assert str(caught.value) == caught.value.reason
    return caught.value.reason


@pytest.fixture
def root(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    store.mkdir()
    return store


# ---------------------------------------------------------------- ids


def test_nested_id_maps_to_a_subdirectory(root: Path) -> None:
    prefix = embeddings(3)
    write_raw_prefix(root, "team/project/prefix_1", decoder=prefix)
    loaded = make_store(root).get("team/project/prefix_1")
    assert isinstance(loaded, PrefixEmbeddings)
    assert loaded.decoder is not None and torch.equal(loaded.decoder, prefix)


@pytest.mark.parametrize("adapter_id", ["a.b", "../escape", "a b", "semi;colon", "tab\tid", ""])
def test_id_with_other_characters_is_rejected(root: Path, adapter_id: str) -> None:
    assert load_failure(make_store(root), adapter_id) == (
        f"Invalid prefix id {adapter_id}, must contain only alphanumeric, _ and - and /"
    )


def test_dot_dot_escape_is_rejected_before_touching_the_filesystem(root: Path) -> None:
    write_raw_prefix(root.parent, "outside", decoder=embeddings(2))
    reason = load_failure(make_store(root), "../outside")
    assert reason == "Invalid prefix id ../outside, must contain only alphanumeric, _ and - and /"


def test_symlink_out_of_the_store_is_rejected(root: Path) -> None:
    outside = write_raw_prefix(root.parent, "outside", decoder=embeddings(2))
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "team").symlink_to(root.parent, target_is_directory=True)
    store = make_store(root)
    assert load_failure(store, "link") == "Invalid prefix id link"
    assert load_failure(store, "team/outside") == "Invalid prefix id team/outside"


def test_symlink_within_the_store_is_followed(root: Path) -> None:
    prefix = embeddings(2)
    real = write_raw_prefix(root, "real", decoder=prefix)
    (root / "alias").symlink_to(real, target_is_directory=True)
    loaded = make_store(root).get("alias")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert torch.equal(loaded.decoder, prefix)


def test_absolute_id_outside_the_store_is_rejected(root: Path) -> None:
    outside = write_raw_prefix(root.parent, "outside", decoder=embeddings(2))
    store = make_store(root)
    assert load_failure(store, str(outside)) == f"Invalid prefix id {outside}"
    assert load_failure(store, "/") == "Invalid prefix id /"


def test_the_store_root_itself_is_no_entry(root: Path) -> None:
    write_raw_prefix(root, "", decoder=embeddings(2))
    assert load_failure(make_store(root), str(root)) == f"Invalid prefix id {root}"


# ---------------------------------------------------------------- layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_prefix_is_returned_in_the_model_dtype(root: Path, dtype: torch.dtype) -> None:
    prefix = embeddings(5)
    write_raw_prefix(root, "raw", decoder=prefix)
    loaded = make_store(root, dtype=dtype).get("raw")
    assert isinstance(loaded, PrefixEmbeddings)
    assert loaded.encoder is None
    assert loaded.decoder is not None
    assert loaded.decoder.dtype == dtype
    assert loaded.decoder.device == torch.device("cpu")
    assert torch.equal(loaded.decoder, prefix.to(dtype))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_prefix_is_placed_on_the_model_device(root: Path) -> None:
    prefix = embeddings(4)
    write_raw_prefix(root, "gpu", decoder=prefix)
    loaded = make_store(root, dtype=torch.float16, device=torch.device("cuda", 0)).get("gpu")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert loaded.decoder.device == torch.device("cuda", 0)
    assert torch.equal(loaded.decoder.cpu(), prefix.to(torch.float16))


def test_raw_prefix_saved_in_another_dtype_is_converted(root: Path) -> None:
    prefix = embeddings(4, dtype=torch.float64)
    write_raw_prefix(root, "f64", decoder=prefix)
    loaded = make_store(root, dtype=torch.float16).get("f64")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert torch.equal(loaded.decoder, prefix.to(torch.float16))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_peft_prompt_tuning_entry(root: Path, fmt: Any) -> None:
    prefix = embeddings(6)
    write_peft_prompt_tuning(root, f"peft-{fmt}", prefix, fmt=fmt)
    loaded = make_store(root, dtype=torch.float16).get(f"peft-{fmt}")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert loaded.decoder.dtype == torch.float16
    assert torch.equal(loaded.decoder, prefix.to(torch.float16))


def test_peft_safetensors_wins_over_bin(root: Path) -> None:
    safetensors_prefix, bin_prefix = embeddings(2, seed=1), embeddings(2, seed=2)
    directory = write_peft_prompt_tuning(root, "both", safetensors_prefix, fmt="safetensors")
    torch.save({"prompt_embeddings": bin_prefix}, directory / "adapter_model.bin")
    loaded = make_store(root).get("both")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert torch.equal(loaded.decoder, safetensors_prefix)


def test_peft_weights_without_config_are_prompt_tuning(root: Path) -> None:
    prefix = embeddings(3)
    (root / "bare").mkdir()
    save_file({"prompt_embeddings": prefix}, str(root / "bare" / "adapter_model.safetensors"))
    loaded = make_store(root).get("bare")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert torch.equal(loaded.decoder, prefix)


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_prompt_tuning_saved_by_peft_loads_as_peft_sees_it(
    root: Path, model_dirs: Callable[[str], Path], safe_serialization: bool
) -> None:
    from peft import PromptTuningConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs("llama")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=4))
    peft_model.save_pretrained(str(root / "trained"), safe_serialization=safe_serialization)
    expected = peft_model.get_prompt_embedding_to_save("default")

    hidden = model_hidden_size(model.config.to_dict())
    loaded = make_store(root, hidden_size=hidden).get("trained")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.decoder is not None
    assert loaded.decoder.shape == (4, hidden)
    assert torch.equal(loaded.decoder, expected)


def test_peft_entry_without_weights_file_is_not_found(root: Path) -> None:
    (root / "odd").mkdir()
    (root / "odd" / "adapter_model.pt").write_bytes(b"")
    assert load_failure(make_store(root), "odd") == 'prefix id "odd" not found'


def test_peft_weights_without_prompt_embeddings(root: Path) -> None:
    (root / "nokey").mkdir()
    save_file({"something_else": embeddings(2)}, str(root / "nokey" / "adapter_model.safetensors"))
    assert load_failure(make_store(root), "nokey") == "Invalid prefix embedding tensor"


def test_peft_prompt_tuning_on_encoder_decoder_is_rejected(root: Path) -> None:
    write_peft_prompt_tuning(root, "peft", embeddings(2))
    reason = load_failure(make_store(root, is_encoder_decoder=True), "peft")
    assert reason == "encoder-decoder architectures not supported for peft models"


@pytest.mark.parametrize("peft_type", ["IA3", "PREFIX_TUNING"])
def test_other_peft_types_are_rejected(root: Path, peft_type: str) -> None:
    (root / "other").mkdir()
    (root / "other" / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type}))
    save_file({"w": embeddings(2)}, str(root / "other" / "adapter_model.safetensors"))
    assert load_failure(make_store(root), "other") == f"adapter type {peft_type} is not currently supported"


def test_ia3_config_written_by_peft_is_rejected(root: Path) -> None:
    from peft import IA3Config, TaskType

    IA3Config(
        task_type=TaskType.CAUSAL_LM, target_modules=["q_proj"], feedforward_modules=[]
    ).save_pretrained(str(root / "ia3"))
    save_file({"w": embeddings(2)}, str(root / "ia3" / "adapter_model.safetensors"))
    assert load_failure(make_store(root), "ia3") == "adapter type IA3 is not currently supported"


def test_unreadable_config_is_reported(root: Path) -> None:
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    save_file({"prompt_embeddings": embeddings(2)}, str(root / "broken" / "adapter_model.safetensors"))
    assert load_failure(make_store(root), "broken").startswith("Invalid adapter config: ")


def test_unreadable_tensor_file_is_reported(root: Path) -> None:
    (root / "garbage").mkdir()
    (root / "garbage" / "decoder.pt").write_bytes(b"not a torch file")
    assert load_failure(make_store(root), "garbage").startswith("Could not read decoder.pt: ")


# ---------------------------------------------------------------- not found


def test_missing_directory_is_not_found(root: Path) -> None:
    with pytest.raises(AdapterNotFound, match=r'^prefix id "nope" not found$'):
        make_store(root).get("nope")


def test_empty_directory_is_not_found(root: Path) -> None:
    (root / "empty").mkdir()
    assert load_failure(make_store(root), "empty") == 'prefix id "empty" not found'


def test_id_naming_a_file_is_not_found(root: Path) -> None:
    (root / "file").write_bytes(b"x")
    assert load_failure(make_store(root), "file") == 'prefix id "file" not found'


def test_decoder_only_model_needs_decoder_pt(root: Path) -> None:
    write_raw_prefix(root, "enc-only", decoder=None, encoder=embeddings(2))
    assert load_failure(make_store(root), "enc-only") == 'prefix id "enc-only" not found'


# ---------------------------------------------------------------- encoder-decoder raw prefixes


@pytest.mark.parametrize(("with_encoder", "with_decoder"), [(True, False), (False, True), (True, True)])
def test_encoder_decoder_needs_at_least_one_tensor(
    root: Path, with_encoder: bool, with_decoder: bool
) -> None:
    encoder, decoder = embeddings(4, seed=1), embeddings(2, seed=2)
    write_raw_prefix(
        root, "ed", decoder=decoder if with_decoder else None, encoder=encoder if with_encoder else None
    )
    loaded = make_store(root, is_encoder_decoder=True).get("ed")
    assert isinstance(loaded, PrefixEmbeddings)
    assert (loaded.encoder is not None) == with_encoder
    assert (loaded.decoder is not None) == with_decoder
    if loaded.encoder is not None:
        assert torch.equal(loaded.encoder, encoder)
    if loaded.decoder is not None:
        assert torch.equal(loaded.decoder, decoder)


def test_encoder_decoder_without_tensors_is_not_found(root: Path) -> None:
    (root / "none").mkdir()
    (root / "none" / "unrelated.pt").write_bytes(b"")
    assert load_failure(make_store(root, is_encoder_decoder=True), "none") == 'prefix id "none" not found'


@pytest.mark.parametrize("part", ["encoder", "decoder"])
def test_encoder_decoder_prefix_must_be_of_even_length(root: Path, part: str) -> None:
    write_raw_prefix(root, "odd", **{"decoder": None, "encoder": None, part: embeddings(3)})
    reason = load_failure(make_store(root, is_encoder_decoder=True), "odd")
    assert reason == "Encoder/decoder prefix tensor must be of even length"


def test_odd_length_is_fine_for_decoder_only_models(root: Path) -> None:
    write_raw_prefix(root, "odd", decoder=embeddings(3))
    loaded = make_store(root).get("odd")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.length(False) == 3


def test_encoder_pt_is_ignored_by_decoder_only_models(root: Path) -> None:
    write_raw_prefix(root, "both", decoder=embeddings(2), encoder=embeddings(3, hidden=5))
    loaded = make_store(root).get("both")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.encoder is None


# ---------------------------------------------------------------- checks


@pytest.mark.parametrize(
    "tensor",
    [torch.zeros(4), torch.zeros(1, 2, HIDDEN), torch.tensor(1.0), {"prompt": torch.zeros(2, HIDDEN)}],
    ids=["1d", "3d", "scalar", "dict"],
)
def test_prefix_must_be_a_2d_tensor(root: Path, tensor: Any) -> None:
    (root / "bad").mkdir()
    torch.save(tensor, root / "bad" / "decoder.pt")
    assert load_failure(make_store(root), "bad") == "Invalid prefix embedding tensor"


def test_peft_prompt_embeddings_must_be_2d(root: Path) -> None:
    write_peft_prompt_tuning(root, "flat", torch.zeros(1, 3, HIDDEN))
    assert load_failure(make_store(root), "flat") == "Invalid prefix embedding tensor"


@pytest.mark.parametrize("rows", [0, 65])
def test_prefix_length_must_be_within_the_limit(root: Path, rows: int) -> None:
    write_raw_prefix(root, "long", decoder=torch.zeros(rows, HIDDEN))
    reason = load_failure(make_store(root, max_prefix_length=64), "long")
    assert reason == f"Invalid prefix embedding length of {rows}"


def test_prefix_of_the_maximum_length_is_accepted(root: Path) -> None:
    write_raw_prefix(root, "max", decoder=embeddings(64))
    loaded = make_store(root, max_prefix_length=64).get("max")
    assert isinstance(loaded, PrefixEmbeddings) and loaded.length(False) == 64


def test_length_is_checked_before_the_even_rule_and_the_width(root: Path) -> None:
    write_raw_prefix(root, "x", decoder=torch.zeros(7, 3))
    store = make_store(root, is_encoder_decoder=True, max_prefix_length=6)
    assert load_failure(store, "x") == "Invalid prefix embedding length of 7"


def test_prefix_width_must_match_the_model(root: Path) -> None:
    write_raw_prefix(root, "narrow", decoder=embeddings(2, hidden=8))
    reason = load_failure(make_store(root), "narrow")
    assert reason == f"Prefix embedding tensor dim 8 does not match model ({HIDDEN})"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_prefix_must_be_finite(root: Path, bad: float) -> None:
    prefix = embeddings(2)
    prefix[1, 3] = bad
    write_raw_prefix(root, "nan", decoder=prefix)
    assert load_failure(make_store(root, dtype=torch.float16), "nan") == "Prefix contains non-finite elements"


@pytest.mark.parametrize(
    ("source", "target"), [(torch.float32, torch.float16), (torch.float64, torch.float32)]
)
def test_prefix_must_stay_finite_in_the_model_dtype(
    root: Path, source: torch.dtype, target: torch.dtype
) -> None:
    prefix = embeddings(2, dtype=source)
    prefix[0, 0] = torch.finfo(target).max * 4
    write_raw_prefix(root, "overflow", decoder=prefix)
    reason = load_failure(make_store(root, dtype=target), "overflow")
    assert reason == f"Prefix contains non-finite elements after conversion from {source} to {target}"


def test_peft_prefix_is_checked_too(root: Path) -> None:
    write_peft_prompt_tuning(root, "narrow", embeddings(2, hidden=HIDDEN + 1), fmt="bin")
    reason = load_failure(make_store(root), "narrow")
    assert reason == f"Prefix embedding tensor dim {HIDDEN + 1} does not match model ({HIDDEN})"


def test_failures_are_not_cached(root: Path) -> None:
    store = make_store(root)
    assert load_failure(store, "later") == 'prefix id "later" not found'
    write_raw_prefix(root, "later", decoder=embeddings(2))
    assert isinstance(store.get("later"), PrefixEmbeddings)


# ---------------------------------------------------------------- LoRA


def expected_lora_bytes(directory: Path, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    with safe_open(str(directory / "adapter_model.safetensors"), framework="pt") as weights:
        numels = [math.prod(weights.get_slice(key).get_shape()) for key in weights.keys()]  # noqa: SIM118
    return sum(math.ceil(n * element / 512) * 512 for n in numels)


@pytest.mark.parametrize(("arch", "targets"), [("llama", None), ("gpt2", ["c_attn"])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_entry_is_recognised_with_its_size(
    root: Path, model_dirs: Callable[[str], Path], arch: str, targets: list[str] | None, dtype: torch.dtype
) -> None:
    model_dir = model_dirs(arch)
    directory = write_lora(root, f"lora/{arch}", model_dir, seed=7, target_modules=targets)
    config = json.loads((model_dir / "config.json").read_text())
    store = make_store(root, hidden_size=model_hidden_size(config), dtype=dtype)
    loaded = store.get(f"lora/{arch}")
    assert loaded == LoraAdapter(adapter_id=f"lora/{arch}", path=directory.resolve())
    assert f"lora/{arch}" in store
    assert store.cached_bytes == expected_lora_bytes(directory, dtype) > 0


def test_written_lora_changes_the_model_output(root: Path, model_dirs: Callable[[str], Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs("llama")
    directory = write_lora(root, "visible", model_dir, seed=3)
    ids = torch.arange(4, 20).unsqueeze(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(directory)).eval()
        lora_logits = adapted(ids).logits
    assert not torch.equal(base_logits.argmax(-1), lora_logits.argmax(-1))
    assert (lora_logits - base_logits).abs().mean() > 0.5 * base_logits.std()


def test_lora_with_non_finite_weights_is_rejected(root: Path, model_dirs: Callable[[str], Path]) -> None:
    directory = write_lora(root, "nan-lora", model_dirs("llama"), seed=1)
    weights = load_file(str(directory / "adapter_model.safetensors"))
    key = sorted(k for k in weights if ".lora_B." in k)[0]
    weights[key][0, 0] = float("nan")
    save_file(weights, str(directory / "adapter_model.safetensors"))
    reason = load_failure(make_store(root, hidden_size=64), "nan-lora")
    assert reason == f"Invalid LoRA adapter: {key} has non-finite elements"


def test_lora_weights_must_pair_up(root: Path, model_dirs: Callable[[str], Path]) -> None:
    directory = write_lora(root, "unpaired", model_dirs("llama"), seed=1)
    weights = load_file(str(directory / "adapter_model.safetensors"))
    key = sorted(k for k in weights if ".lora_B." in k)[0]
    del weights[key]
    save_file(weights, str(directory / "adapter_model.safetensors"))
    module = key.split(".lora_B.")[0]
    reason = load_failure(make_store(root, hidden_size=64), "unpaired")
    assert reason == f"Invalid LoRA adapter: lora_A/lora_B shapes of {module} do not pair"


def test_lora_weights_must_belong_to_target_modules(root: Path, model_dirs: Callable[[str], Path]) -> None:
    directory = write_lora(root, "mismatch", model_dirs("llama"), seed=1, target_modules=["q_proj"])
    config = json.loads((directory / "adapter_config.json").read_text())
    config["target_modules"] = ["v_proj"]
    (directory / "adapter_config.json").write_text(json.dumps(config))
    reason = load_failure(make_store(root, hidden_size=64), "mismatch")
    assert reason.startswith("Invalid LoRA adapter: ") and reason.endswith(".q_proj is not a target module")


# ---------------------------------------------------------------- cache


def write_quarter_mib(root: Path, adapter_id: str, seed: int = 0) -> None:
    write_raw_prefix(root, adapter_id, decoder=embeddings(QUARTER_MIB_ROWS, QUARTER_MIB_HIDDEN, seed=seed))


def quarter_mib_store(root: Path, **overrides: Any) -> AdapterStore:
    return make_store(root, hidden_size=QUARTER_MIB_HIDDEN, cache_size_mb=1, **overrides)


def test_size_is_rounded_up_to_512_bytes_per_tensor(root: Path) -> None:
    write_raw_prefix(root, "small", decoder=embeddings(2, hidden=5))  # 40 bytes
    write_raw_prefix(root, "ed", decoder=embeddings(2, hidden=5), encoder=embeddings(2, hidden=5))
    store = make_store(root, hidden_size=5)
    store.get("small")
    assert store.cached_bytes == 512
    make_ed = make_store(root, hidden_size=5, is_encoder_decoder=True)
    make_ed.get("ed")
    assert make_ed.cached_bytes == 1024


def test_size_is_counted_in_the_model_dtype(root: Path) -> None:
    write_raw_prefix(root, "p", decoder=embeddings(QUARTER_MIB_ROWS, QUARTER_MIB_HIDDEN))
    store = quarter_mib_store(root, dtype=torch.float16)
    store.get("p")
    assert store.cached_bytes == MIB // 8


def test_least_recently_used_entry_is_evicted(root: Path) -> None:
    for name in "abcde":
        write_quarter_mib(root, name)
    store = quarter_mib_store(root)
    for name in "abcd":
        store.get(name)
    assert store.cached_bytes == MIB and len(store) == 4
    store.get("a")  # now b is the least recently used
    store.get("e")
    assert "b" not in store
    assert all(name in store for name in "acde")
    assert store.cached_bytes == MIB
    store.get("c")
    store.get("b")  # evicts d, the least recently used now
    assert "d" not in store and all(name in store for name in "abce")


def test_eviction_frees_enough_for_a_larger_entry(root: Path) -> None:
    for name in "abcd":
        write_quarter_mib(root, name)
    write_raw_prefix(root, "half", decoder=embeddings(2 * QUARTER_MIB_ROWS, QUARTER_MIB_HIDDEN))
    store = quarter_mib_store(root, max_prefix_length=2 * QUARTER_MIB_ROWS)
    for name in "abcd":
        store.get(name)
    store.get("half")
    assert "a" not in store and "b" not in store
    assert "c" in store and "d" in store and "half" in store
    assert store.cached_bytes == MIB


def test_entry_filling_the_whole_cache_fits(root: Path) -> None:
    write_raw_prefix(root, "full", decoder=embeddings(4 * QUARTER_MIB_ROWS, QUARTER_MIB_HIDDEN))
    store = quarter_mib_store(root, max_prefix_length=4 * QUARTER_MIB_ROWS)
    store.get("full")
    assert store.cached_bytes == MIB


def test_entry_larger_than_the_cache_is_rejected(root: Path) -> None:
    write_quarter_mib(root, "small")
    write_raw_prefix(root, "big", decoder=embeddings(4 * QUARTER_MIB_ROWS + 1, QUARTER_MIB_HIDDEN))
    store = quarter_mib_store(root, max_prefix_length=4 * QUARTER_MIB_ROWS + 1)
    store.get("small")
    assert load_failure(store, "big") == "Prefix ID object big exceeds the allowed cache size"
    assert "big" not in store and "small" in store
    assert store.cached_bytes == MIB // 4


def test_zero_sized_cache_accepts_nothing(root: Path) -> None:
    write_raw_prefix(root, "tiny", decoder=embeddings(1))
    store = make_store(root, cache_size_mb=0)
    assert load_failure(store, "tiny") == "Prefix ID object tiny exceeds the allowed cache size"


def test_evicted_lora_ids_are_drained_once(root: Path, model_dirs: Callable[[str], Path]) -> None:
    model_dir = model_dirs("llama")
    write_lora(root, "lora-1", model_dir, seed=1)
    write_lora(root, "lora-2", model_dir, seed=2)
    for name in "abcd":
        write_quarter_mib(root, name)
    store = quarter_mib_store(root)
    store.get("lora-1")
    store.get("lora-2")
    assert store.drain_evicted_loras() == []
    for name in "abcd":
        store.get(name)
    assert "lora-1" not in store and "lora-2" not in store
    assert store.drain_evicted_loras() == ["lora-1", "lora-2"]
    assert store.drain_evicted_loras() == []


def test_lora_loaded_again_before_the_drain_is_not_reported(
    root: Path, model_dirs: Callable[[str], Path]
) -> None:
    write_lora(root, "lora", model_dirs("llama"), seed=1)
    for name in "abcd":
        write_quarter_mib(root, name)
    store = quarter_mib_store(root)
    store.get("lora")
    for name in "abcd":
        store.get(name)
    store.get("lora")  # evicts "a", brings the adapter back
    assert "lora" in store
    assert store.drain_evicted_loras() == []


def test_evicted_prefixes_are_not_reported_as_loras(root: Path) -> None:
    for name in "abcde":
        write_quarter_mib(root, name)
    store = quarter_mib_store(root)
    for name in "abcde":
        store.get(name)
    assert store.drain_evicted_loras() == []


def test_memory_stays_bounded_over_many_ids(root: Path) -> None:
    store = quarter_mib_store(root)
    for index in range(50):
        write_quarter_mib(root, f"p{index}", seed=index)
        store.get(f"p{index}")
        assert store.cached_bytes <= MIB
        assert len(store) <= 4
    assert [f"p{index}" in store for index in range(46, 50)] == [True] * 4


# ---------------------------------------------------------------- concurrency


THREADS = 8


class HeldLoader:
    """Wraps the real loader: counts its calls and holds the load until every other caller waits
    on it (each has entered `_PendingLoad.result`), so that all of them share this one load."""

    def __init__(self, real: Callable[..., Any], waiters: int) -> None:
        self.real = real
        self.waiters = waiters
        self.calls: list[str] = []
        self.waiting = 0
        self.changed = threading.Condition()

    def __call__(self, directory: Path, adapter_id: str, limits: Any) -> Any:
        with self.changed:
            self.calls.append(adapter_id)
            assert self.changed.wait_for(lambda: self.waiting == self.waiters, timeout=60)
        return self.real(directory, adapter_id, limits)

    def wait_for_result(self, real_result: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def result(pending: Any) -> Any:
            with self.changed:
                self.waiting += 1
                self.changed.notify_all()
            return real_result(pending)

        return result


@pytest.fixture
def held_loader(monkeypatch: pytest.MonkeyPatch) -> HeldLoader:
    loader = HeldLoader(store_module.load_entry, waiters=THREADS - 1)
    monkeypatch.setattr(store_module, "load_entry", loader)
    pending_class = store_module._PendingLoad
    monkeypatch.setattr(pending_class, "result", loader.wait_for_result(pending_class.result))
    return loader


def run_threads(target: Callable[[], Any]) -> list[Any]:
    """Call `target` from THREADS threads at once; each result or AdapterLoadError, in order."""
    results: list[Any] = [None] * THREADS

    def work(index: int) -> None:
        try:
            results[index] = target()
        except AdapterLoadError as exc:
            results[index] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_concurrent_loads_of_one_id_run_the_loader_once(root: Path, held_loader: HeldLoader) -> None:
    write_raw_prefix(root, "shared", decoder=embeddings(3))
    store = make_store(root)
    results = run_threads(lambda: store.get("shared"))
    assert held_loader.calls == ["shared"]
    assert all(isinstance(result, PrefixEmbeddings) for result in results)
    assert all(result is results[0] for result in results)


def test_concurrent_failing_loads_share_the_failure(root: Path, held_loader: HeldLoader) -> None:
    store = make_store(root)
    results = run_threads(lambda: store.get("missing"))
    assert held_loader.calls == ["missing"]
    assert all(isinstance(result, AdapterNotFound) for result in results)
    assert {str(result) for result in results} == {'prefix id "missing" not found'}


def test_loads_of_different_ids_run_outside_the_lock(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_raw_prefix(root, "first", decoder=embeddings(2))
    write_raw_prefix(root, "second", decoder=embeddings(2))
    real = store_module.load_entry
    second_started = threading.Event()

    def loader(directory: Path, adapter_id: str, limits: Any) -> Any:
        if adapter_id == "first":
            # Holding the store lock here would keep "second" from ever starting.
            assert second_started.wait(timeout=60)
        else:
            second_started.set()
        return real(directory, adapter_id, limits)

    monkeypatch.setattr(store_module, "load_entry", loader)
    store = make_store(root)
    first = threading.Thread(target=store.get, args=("first",))
    first.start()
    store.get("second")
    first.join()
    assert "first" in store and "second" in store


def test_cache_hit_does_not_load_again(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_raw_prefix(root, "hit", decoder=embeddings(2))
    real = store_module.load_entry
    calls: list[str] = []

    def loader(directory: Path, adapter_id: str, limits: Any) -> Any:
        calls.append(adapter_id)
        return real(directory, adapter_id, limits)

    monkeypatch.setattr(store_module, "load_entry", loader)
    store = make_store(root)
    assert store.get("hit") is store.get("hit")
    assert calls == ["hit"]


# ---------------------------------------------------------------- metrics


def test_lookups_and_failures_are_recorded(root: Path) -> None:
    metrics = Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)
    write_raw_prefix(root, "ok", decoder=embeddings(2))
    store = make_store(root, metrics=metrics)

    def sample(name: str) -> float:
        value = metrics.registry.get_sample_value(name)
        return 0.0 if value is None else value

    store.get("ok")
    store.get("ok")
    assert sample("tgi_prompt_load_duration_count") == 2
    assert sample("tgi_prompt_load_failure_total") == 0
    load_failure(store, "bad.id")
    load_failure(store, "missing")
    assert sample("tgi_prompt_load_duration_count") == 4
    assert sample("tgi_prompt_load_failure_total") == 2


# ---------------------------------------------------------------- settings and model facts


@pytest.fixture
def clean_prefix_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("PREFIX_STORE_PATH", "ADAPTER_CACHE", "MAX_PROMPT_PREFIX_LENGTH", "PROMPT_CACHE_SIZE_MB"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_adapter_cache_is_an_alias_of_prefix_store_path(clean_prefix_env: pytest.MonkeyPatch) -> None:
    clean_prefix_env.setenv("ADAPTER_CACHE", "/adapters")
    assert Settings().prefix_store_path == "/adapters"


def test_prefix_store_path_still_works(clean_prefix_env: pytest.MonkeyPatch) -> None:
    clean_prefix_env.setenv("PREFIX_STORE_PATH", "/prefixes")
    assert Settings().prefix_store_path == "/prefixes"
    assert Settings(prefix_store_path="/given").prefix_store_path == "/given"


@pytest.mark.parametrize(("length", "expected"), [(200, 100), (201, 101), (2, 1)])
def test_max_prefix_length_defaults_to_half_the_sequence_length(
    clean_prefix_env: pytest.MonkeyPatch, length: int, expected: int
) -> None:
    assert max_prefix_length(Settings(), length) == expected


def test_max_prefix_length_from_env(clean_prefix_env: pytest.MonkeyPatch) -> None:
    clean_prefix_env.setenv("MAX_PROMPT_PREFIX_LENGTH", "199")
    assert max_prefix_length(Settings(), 200) == 199


@pytest.mark.parametrize("value", ["abc", "1.5", "0", "-3"])
def test_non_integer_max_prefix_length_fails_startup(
    clean_prefix_env: pytest.MonkeyPatch, value: str
) -> None:
    clean_prefix_env.setenv("MAX_PROMPT_PREFIX_LENGTH", value)
    with pytest.raises(StartupError) as caught:
        max_prefix_length(Settings(), 200)
    assert str(caught.value) == "Invalid value for MAX_PROMPT_PREFIX_LENGTH"


def test_max_prefix_length_above_sequence_length_fails_startup(clean_prefix_env: pytest.MonkeyPatch) -> None:
    clean_prefix_env.setenv("MAX_PROMPT_PREFIX_LENGTH", "200")
    with pytest.raises(StartupError) as caught:
        max_prefix_length(Settings(), 200)
    assert str(caught.value) == (
        "Value for the MAX_PROMPT_PREFIX_LENGTH (200) cannot be larger than the max sequence length - 1 (199)"
    )


def test_model_hidden_size_reads_each_config_family() -> None:
    from transformers import GPT2Config, LlamaConfig, T5Config

    assert model_hidden_size(LlamaConfig(hidden_size=48, num_attention_heads=4).to_dict()) == 48
    assert model_hidden_size(GPT2Config(n_embd=40).to_dict()) == 40
    assert model_hidden_size(T5Config(d_model=24).to_dict()) == 24
    with pytest.raises(ValueError, match="hidden_size, n_embd, d_model"):
        model_hidden_size({"vocab_size": 10})
