"""Attention implementations against the jnp reference, and the dispatch's fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spark_jax import attention as att


def _inputs(seed, b, t, n, kv_heads, h, s, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in [(b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h)]
    )
    lengths = jnp.asarray(rng.integers(t, s + 1, b), jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t)[None]
    return q, k, v, att.AttentionMask(positions, lengths)


@pytest.mark.parametrize(
    "b, t, n, kv_heads, window, chunk",
    [(2, 1, 8, 2, None, 64), (3, 1, 4, 4, None, 128), (2, 5, 8, 1, None, 64), (2, 1, 8, 2, 37, 64)],
)
def test_split_kv_attention_matches_the_reference(b, t, n, kv_heads, window, chunk):
    q, k, v, mask = _inputs(b * 10 + t, b, t, n, kv_heads, 16, 256)
    ref = att.reference_attention(q, k, v, mask, window)
    out = att.split_kv_attention(q, k, v, mask, window, chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_to_the_reference_off_gpu():
    q, k, v, mask = _inputs(0, 2, 1, 8, 2, 16, 64, jnp.bfloat16)
    if jax.default_backend() == "gpu":
        pytest.skip("the fallback is what runs off the GPU")
    assert not att.cudnn_decode_applies(q, k, None)
    out = att.attention(q, k, v, mask)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(att.reference_attention(q, k, v, mask), np.float32)
    )


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_cudnn_decode_attention_matches_the_reference_on_gpu():
    q, k, v, mask = _inputs(1, 8, 1, 32, 8, 128, 1024, jnp.bfloat16)
    assert att.cudnn_decode_applies(q, k, None)
    ref = att.reference_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask
    )
    out = att.attention(q, k, v, mask).astype(jnp.float32)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-2
