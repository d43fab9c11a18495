"""The tgis suite's fixtures these tests use: tiny random-weight models and tokenizers, built locally."""

from tests.conftest import llama_tokenizer, model_dirs, tokenizer, tokenizer_dir_gpt2  # noqa: F401
