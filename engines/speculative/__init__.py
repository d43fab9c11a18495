"""Speculative decoding drafters: models that propose the target model's next tokens cheaply."""

from engines.speculative.checkpoint import load_mlp_speculator, save_mlp_speculator
from engines.speculative.mlp import MLPSpeculator, MLPSpeculatorConfig

__all__ = ["MLPSpeculator", "MLPSpeculatorConfig", "load_mlp_speculator", "save_mlp_speculator"]
