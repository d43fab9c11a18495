"""The models the conformance servers run: the tiny fixtures, plus two edited copies owned by this suite.

`llama_eos`: on a random tiny model EOS is almost never the argmax, so this copy gives EOS the output
row of a token that greedy decoding of `EOS_PROMPT` emits at step `EOS_STEP`, scaled by 1.01, and
makes PAD equal to EOS (the TGIS "don't penalise EOS because of PAD" regression needs EOS == PAD).
`llama_ties`: every output row but a few is zero, so most logits tie exactly at 0.0; top-n then hits
ties beyond n and the 4n cap, which random float logits never do.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.conformance.oracle import Penalties, Reference

FIXTURE_MODELS = ("llama", "gpt2", "t5")
EOS_PROMPT = "Hello world"
EOS_STEP = 5  # greedy decoding of EOS_PROMPT on llama_eos ends with EOS as its 5th token
TIE_ROWS = range(4, 12)  # the only non-zero output rows of llama_ties
EOS_BOOST = 1.01


def model_dirs_for_suite(fixture_dir: Callable[[str], Path], work: Path) -> dict[str, Path]:
    """Model name (as the YAML cases spell it) → directory."""
    dirs = {name: fixture_dir(name) for name in FIXTURE_MODELS}
    dirs["llama_eos"] = _eos_copy(dirs["llama"], work / "llama_eos")
    dirs["llama_ties"] = _ties_copy(dirs["llama"], work / "llama_ties")
    return dirs


def _copy(source: Path, target: Path, edit: Callable[[Any], None], **config: int) -> Path:
    shutil.copytree(source, target, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    with torch.no_grad():
        edit(model)
    for key, value in config.items():
        setattr(model.config, key, value)
        setattr(model.generation_config, key, value)
    model.save_pretrained(target)
    return target


def _eos_copy(source: Path, target: Path) -> Path:
    original = Reference.load(source)
    prompt = original.encode(EOS_PROMPT)
    tokens = original.generate(prompt, EOS_STEP, Penalties()).token_ids
    victim = tokens[EOS_STEP - 1]
    if victim in tokens[: EOS_STEP - 1]:
        raise AssertionError(f"greedy {EOS_PROMPT!r} repeats token {victim} early; pick another EOS_PROMPT")
    eos = original.eos_id

    def edit(model: Any) -> None:
        weight = model.get_output_embeddings().weight
        weight[eos] = weight[victim] * EOS_BOOST

    _copy(source, target, edit, pad_token_id=eos)
    edited = Reference.load(target).generate(prompt, 3 * EOS_STEP, Penalties()).token_ids
    if len(edited) != EOS_STEP or edited[-1] != eos:
        raise AssertionError(f"llama_eos does not end {EOS_PROMPT!r} with EOS at step {EOS_STEP}: {edited}")
    return target


def _ties_copy(source: Path, target: Path) -> Path:
    def edit(model: Any) -> None:
        weight = model.get_output_embeddings().weight
        keep = weight[list(TIE_ROWS)].clone()
        weight.zero_()
        weight[list(TIE_ROWS)] = keep

    return _copy(source, target, edit)
