"""Logits processing and token choice for the running batch (SPEC §2.2-§2.5)."""

from tgis.sampling.config import SamplingConfig, StepSample
from tgis.sampling.details import prompt_token_details
from tgis.sampling.sampler import BatchSampler

__all__ = ["BatchSampler", "SamplingConfig", "StepSample", "prompt_token_details"]
