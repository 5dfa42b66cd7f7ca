"""The model shapes the GPU benchmarks share: Llama-3-8B and a tiny stand-in for CPU runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from spark_jax.config import ModelConfig, RopeConfig

LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
LLAMA3_8B = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=LLAMA3_ROPE,
    max_position_embeddings=131072,
)
TINY = dataclasses.replace(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)


def hf_llama_kwargs(config: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """``transformers.LlamaConfig`` keyword arguments of the same model (the torch peers')."""
    rope = config.rope
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={
            "rope_type": rope.kind,
            "rope_theta": rope.theta,
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
    )
    return kwargs | overrides
