"""Attention dispatch: the jnp reference (any backend), later Pallas kernels on Hopper.

Every caller describes what it wants with an ``AttentionMask`` of positions and lengths; the
mask itself is built here, once, so the model files never build masks by hand.

Axes: B batch, T query length, S key length, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["query_positions", "key_lengths"],
    meta_fields=["causal"],
)
@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see.

    A key at position s is visible to the query at position p when s < key_lengths[b] and,
    if causal, s <= p, and, with a sliding window w, s > p - w.
    """

    query_positions: jax.Array  # int32[B, T]
    key_lengths: jax.Array  # int32[B]
    causal: bool = True

    def dense(self, num_keys: int, sliding_window: int | None = None) -> jax.Array:
        """bool[B, T, S]."""
        keys = jnp.arange(num_keys)[None, None, :]
        visible = keys < self.key_lengths[:, None, None]
        q = self.query_positions[:, :, None]
        if self.causal:
            visible &= keys <= q
        if sliding_window is not None:
            visible &= keys > q - sliding_window
        return visible


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention in fp32: q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H] in q's dtype."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask.dense(k.shape[1], sliding_window)[:, None, None, :, :]
    scores = jnp.where(visible, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The attention entry point of every model; picks the implementation for the backend."""
    return reference_attention(q, k, v, mask, sliding_window, scale)
