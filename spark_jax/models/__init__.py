"""Model families behind one small interface, chosen by the config's type.

``family(config)`` returns the module implementing the family: ``weight_spec``,
``params_from_hf``, ``init_params``, ``init_cache`` and the jitted steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from spark_jax.config import ModelConfig, NllbConfig
from spark_jax.models.weights import WeightSpec


def family(config: ModelConfig | NllbConfig) -> ModuleType:
    """The module implementing this config's model family."""
    if config.is_encoder_decoder:
        from spark_jax.models import nllb

        return nllb
    from spark_jax.models import decoder

    return decoder


def weight_spec(config: ModelConfig | NllbConfig) -> WeightSpec:
    """The HF tensors (names and shapes) a checkpoint of this config holds."""
    return family(config).weight_spec(config)


def params_from_hf(
    config: ModelConfig | NllbConfig, tensors: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """HF tensors → the family's params tree (numpy arrays)."""
    return family(config).params_from_hf(config, tensors)


__all__ = ["WeightSpec", "family", "params_from_hf", "weight_spec"]
