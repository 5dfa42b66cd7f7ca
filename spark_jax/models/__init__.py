"""Model families behind one small interface, chosen by the config's type.

``family(config)`` returns the module implementing the family: ``declare`` (its parameters,
spark_jax.models.params), ``weight_spec``, ``params_from_hf`` and ``lora_targets`` (derived from
the declaration), ``init_params``, ``init_cache`` and the jitted steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from spark_jax.config import ModelConfig, NllbConfig
from spark_jax.models.params import Declaration, Param, WeightSpec


def family(config: ModelConfig | NllbConfig) -> ModuleType:
    """The module implementing this config's model family."""
    if config.is_encoder_decoder:
        from spark_jax.models import nllb

        return nllb
    from spark_jax.models import decoder

    return decoder


def declare(config: ModelConfig | NllbConfig) -> Declaration:
    """Every parameter of this config's model: params path, HF tensors, shapes, LoRA parts."""
    return family(config).declare(config)


def weight_spec(config: ModelConfig | NllbConfig) -> WeightSpec:
    """The HF tensors (names and shapes) a checkpoint of this config holds."""
    return family(config).weight_spec(config)


def params_from_hf(
    config: ModelConfig | NllbConfig, tensors: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """HF tensors → the family's params tree (numpy arrays)."""
    return family(config).params_from_hf(config, tensors)


__all__ = [
    "Declaration",
    "Param",
    "WeightSpec",
    "declare",
    "family",
    "params_from_hf",
    "weight_spec",
]
