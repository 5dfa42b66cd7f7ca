"""spark_jax: an LLM and NLLB translation inference engine in JAX/XLA for NVIDIA GPUs.

import spark_jax as sj
m = sj.load(path)
r = sj.generate(m, prompt_ids, sj.SamplingParams(max_tokens=64))
"""

from spark_jax.config import ModelConfig, NllbConfig, config_from_hf
from spark_jax.generation.beam import BeamRequest, BeamResult, generate_beam
from spark_jax.generation.generate import generate, generate_batch, generate_streaming, stream
from spark_jax.generation.request import GenerationResult, StreamOutput, TokenLogprobs
from spark_jax.generation.speculative import (
    Draft,
    Drafter,
    DraftModelDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
    SpeculativeResult,
    generate_speculative,
)
from spark_jax.generation.step import LoopOptions
from spark_jax.model import Model, load
from spark_jax.models.common import ForwardOutput
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.sampling import GuidedDecodingParams, SamplingParams
from spark_jax.serving.engine import Engine, RequestOutput

__all__ = [
    "BeamRequest",
    "BeamResult",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "Engine",
    "ForwardOutput",
    "generate_beam",
    "generate_speculative",
    "GenerationResult",
    "GuidedDecodingParams",
    "KernelOptions",
    "LayerSkipDrafter",
    "LoopOptions",
    "Model",
    "ModelConfig",
    "RequestOutput",
    "NllbConfig",
    "PromptLookupDrafter",
    "SamplingParams",
    "SpeculativeResult",
    "StreamOutput",
    "TokenLogprobs",
    "config_from_hf",
    "generate",
    "generate_batch",
    "generate_streaming",
    "load",
    "stream",
]
