"""Pieces every model family shares: the padding ladder, random parameters and the research
forward's output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= n (and >= minimum): the padding ladder of shapes."""
    size = minimum
    while size < n:
        size *= 2
    return size


def random_params(init: Callable[[jax.Array], Any], key: jax.Array, dtype: jnp.dtype) -> Any:
    """Random parameters (N(0, 0.02), in ``dtype``) of the tree ``init(key)`` would build.

    Only the shapes are traced; each leaf is drawn straight in place, so an 8B model never
    exists twice in memory (benchmarks and tests).
    """
    shapes = jax.eval_shape(init, key)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    arrays = [
        (0.02 * jax.random.normal(k, s.shape, jnp.float32)).astype(dtype)
        for k, s in zip(keys, leaves, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, arrays)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ForwardOutput:
    """What a teacher-forced forward returns, as HF's ``output_hidden_states`` /
    ``output_attentions`` name it (each family's ``forward_outputs``; None where not asked).

    ``hidden_states``: the embeddings, then each layer's output, the last one after the final
    norm (HF's L + 1). ``attentions``: each layer's self-attention probabilities;
    ``cross_attentions``: an encoder-decoder's attention over the source, per decoder layer.
    """

    logits: jax.Array  # fp32 [B, T, V]
    hidden_states: tuple[jax.Array, ...] | None = None  # L + 1 of [B, T, D]
    attentions: tuple[jax.Array, ...] | None = None  # L of fp32 [B, N, T, T]
    cross_attentions: tuple[jax.Array, ...] | None = None  # L of fp32 [B, N, T, S_src]
