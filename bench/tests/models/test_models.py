"""The benchmark models' shapes, the configs they build (no weights) and the 32k tokenizer's training."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM

from tgis_bench.baselines.bound import count_weight_traffic
from tgis_bench.models.shapes import DEFAULT_SHAPE, SHAPES, model_config, shape_named
from tgis_bench.models.tokenizer import BOS, EOS, UNK, corpus, train_tokenizer

TINYLLAMA_PARAMETERS = 1_100_048_384  # TinyLlama-1.1B's published count


@dataclass(frozen=True)
class VocabOnly:
    """What a config takes from a tokenizer: its size and special-token ids."""

    size: int
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 2

    def __len__(self) -> int:
        return self.size


def _meta_model(shape_name: str, vocab: int) -> torch.nn.Module:
    config = model_config(shape_named(shape_name), cast(Any, VocabOnly(vocab)))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_gpt2_small_stays_the_default_under_its_old_directory():
    assert DEFAULT_SHAPE == "gpt2-small"
    assert SHAPES["gpt2-small"].dir_name == "bench-gpt2-small-v1"  # existing caches and reports
    assert SHAPES["llama-1b"].dir_name == "bench-llama-1b-v1"
    assert set(SHAPES) == {"gpt2-small", "llama-1b", "llama-tiny"}


def test_an_unknown_shape_names_the_known_ones():
    with pytest.raises(ValueError, match="gpt2-small, llama-1b, llama-tiny"):
        shape_named("llama-70b")


def test_llama_1b_has_tinyllamas_dimensions_and_parameter_count():
    config = model_config(SHAPES["llama-1b"], cast(Any, VocabOnly(32000)))
    assert config.model_type == "llama"
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (2048, 5632, 22)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 64)
    assert (config.vocab_size, config.max_position_embeddings, config.rms_norm_eps) == (32000, 2048, 1e-5)
    assert config.rope_parameters["rope_theta"] == 10000.0 and not config.tie_word_embeddings
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    model = _meta_model("llama-1b", 32000)
    assert sum(p.numel() for p in model.parameters()) == TINYLLAMA_PARAMETERS


def test_a_llama_decode_step_reads_everything_but_the_input_embeddings():
    traffic = count_weight_traffic(_meta_model("llama-1b", 32000), bytes_per_parameter=2)
    assert traffic.parameters == TINYLLAMA_PARAMETERS
    assert traffic.lookup_tables == ("model.embed_tokens.weight",)
    assert traffic.read_parameters == TINYLLAMA_PARAMETERS - 32000 * 2048  # the LM head stays in
    assert traffic.bytes_per_step == 2 * traffic.read_parameters == 2_069_024_768


def test_llama_tiny_is_the_same_family_at_smoke_size():
    model = _meta_model("llama-tiny", 32000)
    parameters = sum(p.numel() for p in model.parameters())
    assert 20e6 <= parameters <= 50e6
    assert type(model).__name__ == "LlamaForCausalLM"


def test_gpt2_small_ties_its_output_matrix_and_looks_up_positions():
    config = model_config(SHAPES["gpt2-small"], cast(Any, VocabOnly(2048, 0, 0, 0)))
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (12, 768, 12, 1024)
    traffic = count_weight_traffic(_meta_model("gpt2-small", 2048), bytes_per_parameter=4)
    # The tied token table is the LM head and counts once; the position table is only looked up.
    assert traffic.lookup_tables == ("transformer.wpe.weight",)
    assert traffic.read_parameters == traffic.parameters - 1024 * 768


def test_the_tokenizer_trains_to_exactly_its_size_and_starts_with_bos():
    documents = ["the quick brown fox jumps over the lazy dog " * 3, "def function(argument): return value"]
    tokenizer = train_tokenizer(documents, vocab_size=300)
    assert tokenizer.get_vocab_size() == 300
    assert [tokenizer.token_to_id(token) for token in (UNK, BOS, EOS)] == [0, 1, 2]
    encoding = tokenizer.encode(" the lazy fox")
    assert encoding.ids[0] == 1
    assert tokenizer.decode(encoding.ids[1:]) == " the lazy fox"


def test_too_little_text_for_the_vocabulary_is_refused():
    with pytest.raises(RuntimeError, match="yields"):
        train_tokenizer(["tiny corpus"], vocab_size=5000)


def test_the_corpus_is_the_python_docs_prose_then_the_standard_library():
    documents = corpus()
    assert len(documents) > 100
    assert sum(map(len, documents)) > 2_000_000  # enough distinct words for 32000 tokens
    assert any("def " in document for document in documents)
