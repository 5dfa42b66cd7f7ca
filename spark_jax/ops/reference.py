"""The jnp attention every backend runs: the mask, the reference and XLA's split-K form.

Every caller describes what it wants with an ``AttentionMask`` of positions and lengths; the
mask itself is built here, once, so the model files never build masks by hand.

Axes: B batch, T query length, S key length, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


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
    probs = _grouped_probabilities(q, k, mask, sliding_window, scale)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype)


def attention_probabilities(
    q: jax.Array,
    k: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The reference's softmax weights, fp32 [B,N,T,S] (HF's ``attentions`` layout): q
    [B,T,N,H], k [B,S,K,H]; query head n reads kv head n // G, as HF's ``repeat_kv``."""
    probs = _grouped_probabilities(q, k, mask, sliding_window, scale)
    b, kv_heads, g, t, s = probs.shape
    return probs.reshape(b, kv_heads * g, t, s)


def _grouped_probabilities(q, k, mask, sliding_window, scale) -> jax.Array:
    """fp32 [B,K,G,T,S]: softmax(scale q k) over the visible keys, heads grouped by kv head."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask.dense(k.shape[1], sliding_window)[:, None, None, :, :]
    scores = jnp.where(visible, scores, MASKED)
    return jax.nn.softmax(scores, axis=-1)


def split_kv_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
    chunk: int = 256,
) -> jax.Array:
    """Flash-decoding in plain XLA: keys in chunks, a partial softmax per chunk, then a merge.

    For few query rows (decode at small batch) the reference's batched dots have only B*K
    independent products to spread over the GPU; here every (chunk, key, head) is its own
    work item, and each product is an elementwise multiply-reduce that reads K and V once,
    in place, with no transposed copy of the cache. Needs S to be a multiple of ``chunk``.
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    c, g = s // chunk, n // kv_heads
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, 1, 1, kv_heads, g, h).astype(jnp.float32) * scale
    kc = k.reshape(b, 1, c, chunk, kv_heads, 1, h)
    vc = v.reshape(b, 1, c, chunk, kv_heads, 1, h)
    visible = mask.dense(s, sliding_window).reshape(b, t, c, chunk, 1, 1)
    scores = jnp.sum(qg * kc.astype(jnp.float32), axis=-1)  # [B, T, C, L, K, G]
    scores = jnp.where(visible, scores, MASKED)
    chunk_max = jnp.max(scores, axis=3)  # [B, T, C, K, G]
    probs = jnp.where(visible, jnp.exp(scores - chunk_max[:, :, :, None]), 0.0)
    chunk_sum = jnp.sum(probs, axis=3)
    chunk_out = jnp.sum(probs[..., None] * vc.astype(jnp.float32), axis=3)  # [B,T,C,K,G,H]
    weight = jnp.exp(chunk_max - jnp.max(chunk_max, axis=2, keepdims=True))
    total = jnp.sum(weight * chunk_sum, axis=2)  # [B, T, K, G]
    out = jnp.sum(weight[..., None] * chunk_out, axis=2) / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)
