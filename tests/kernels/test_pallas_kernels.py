"""Pallas (Mosaic GPU) attention kernels against their jnp references, in interpret mode on CPU.

The Mosaic GPU interpreter fills never-written buffers with NaN, so a result that stays finite
with NaN poison in the skipped chunks (and a raw per-chunk output that stays NaN there) shows
those chunks were neither read nor written.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as dk
from spark_jax.ops import attention as att
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask, reference_attention

ON_GPU = jax.default_backend() == "gpu"


def _decode_inputs(seed, b, t, n, kv_heads, h, s, dtype, lengths=None):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in [(b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h)]
    )
    if lengths is None:
        lengths = rng.integers(t, s + 1, b)
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t)[None]
    return q, k, v, lengths, positions


@partial(jax.jit, static_argnames=["chunk", "causal"])
def _kernel(q, k, v, lengths, positions, chunk, causal):
    positions = positions if causal else None
    return dk.decode_attention(q, k, v, lengths, positions, chunk=chunk, interpret=not ON_GPU)


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    "t, n, kv_heads, lengths, causal",
    [
        (1, 4, 4, [70, 192], False),  # GQA 1, lengths not multiples of the 64-key chunk
        (1, 8, 2, [1, 129], False),  # GQA 4, a row with a single key
        (1, 8, 1, [64, 100], False),  # GQA 8, a length on a chunk boundary
        (3, 8, 2, [3, 150], True),  # speculative verify: 3 tokens, causal among themselves
    ],
)
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_decode_attention_matches_the_reference(t, n, kv_heads, lengths, causal, dtype, tolerance):
    q, k, v, lengths, positions = _decode_inputs(7, 2, t, n, kv_heads, 64, 192, dtype, lengths)
    mask = AttentionMask(positions, lengths, causal=causal)
    ref = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    out = _kernel(q, k, v, lengths, positions, chunk=64, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert _relative_error(out, ref) <= tolerance


def test_decode_attention_skips_chunks_past_the_length():
    q, k, v, lengths, positions = _decode_inputs(3, 2, 1, 8, 2, 64, 256, jnp.float32, [70, 10])
    ref = reference_attention(q, k, v, AttentionMask(positions, lengths, causal=False))
    beyond = (jnp.arange(256)[None, :] >= 128)[:, :, None, None]  # chunks 2 and 3 of both rows
    row1_tail = (jnp.arange(256)[None, :] >= 64) & (jnp.arange(2)[:, None] == 1)
    poison = beyond | row1_tail[:, :, None, None]
    k, v = (jnp.where(poison, jnp.nan, x) for x in (k, v))
    out = _kernel(q, k, v, lengths, positions, chunk=64, causal=False)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ON_GPU, reason="never-written memory is NaN only in the interpreter")
def test_decode_kernel_leaves_skipped_chunks_unwritten():
    q, k, v, lengths, _ = _decode_inputs(4, 2, 1, 8, 2, 64, 256, jnp.float32, [70, 10])
    rows, limit = dk.query_rows(q, 2, lengths, None)
    run = dk._decode_kernel(2, 256, 2, 64, 64, rows.shape[2], q.dtype, 0.125, interpret=True)
    row_max, row_sum, out = run(lengths, limit, rows, k, v)
    ran = np.asarray(jnp.arange(4)[None, :] * 64 < lengths[:, None])  # [B, C]
    for partial_result in (row_max, row_sum, out):
        written = np.isfinite(np.asarray(partial_result)).reshape(*partial_result.shape[:3], -1)
        assert (written.all(-1).all(1) == ran).all()
        assert (written.any(-1).any(1) == ran).all()


def test_decode_attention_declines_what_it_cannot_run():
    q = jnp.zeros((1, 9, 64, 64))  # 9 tokens x 8 heads per group: more than 64 rows
    k = jnp.zeros((1, 256, 8, 64))
    assert not dk.decode_attention_applies(q, k)
    assert not dk.decode_attention_applies(q[:, :1], k[:, :200])  # S not a multiple of chunk
    assert not dk.decode_attention_applies(q[:, :1], k, sliding_window=32)
    assert dk.decode_attention_applies(q[:, :1], k)
    with pytest.raises(ValueError, match="does not apply"):
        dk.decode_attention(q, k, k, jnp.ones(1, jnp.int32), interpret=True)


def test_attention_dispatch_default_and_overrides():
    q, k, v, lengths, positions = _decode_inputs(5, 2, 1, 8, 2, 64, 256, jnp.float32)
    mask = AttentionMask(positions, lengths)
    ref = reference_attention(q, k, v, mask)
    if not ON_GPU:  # the default is unchanged off the GPU: the reference, bit for bit
        np.testing.assert_array_equal(np.asarray(att.attention(q, k, v, mask)), np.asarray(ref))
    xla = att.attention(q, k, v, mask, options=KernelOptions(implementation="xla"))
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(ref))
    options = KernelOptions(implementation="pallas")
    pallas = jax.jit(partial(att.attention, options=options))(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(ref), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="pallas"):
        att.attention(q, k, v, mask, sliding_window=16, options=options)
    with pytest.raises(ValueError, match="implementation"):
        KernelOptions(implementation="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("t, causal", [(1, False), (4, True)])
def test_decode_attention_on_gpu_matches_the_reference(t, causal):
    q, k, v, lengths, positions = _decode_inputs(11, 4, t, 32, 8, 128, 2048, jnp.bfloat16)
    mask = AttentionMask(positions, lengths, causal=causal)
    ref = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    out = _kernel(q, k, v, lengths, positions, chunk=256, causal=causal)
    assert _relative_error(out, ref) <= 1e-2
