"""Speculative decoding drafters: models that propose the target model's next tokens cheaply."""

from engines.speculative.mlp import (
    MLPSpeculator,
    MLPSpeculatorConfig,
    load_mlp_speculator,
    save_mlp_speculator,
)

__all__ = ["MLPSpeculator", "MLPSpeculatorConfig", "load_mlp_speculator", "save_mlp_speculator"]
