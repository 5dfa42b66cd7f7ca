"""The paged Mosaic GPU decode kernel against dense attention, in interpret mode on CPU.

Every case lays dense random rows out in a shuffled page pool (rows share no page, a row's
pages are out of order in the pool, entries a row does not own hold ``num_pages``) and fills
the pool's spare pages, its first ones, with NaN: a finite result shows the kernel read only
the rows' own pages (page 0 is no stand-in for an entry a row does not own).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_attention as dk
from pallas_kernels import paged_attention as pk
from pallas_kernels._mosaic import chunked_table
from spark_jax.ops.reference import AttentionMask, reference_attention

ON_GPU = jax.default_backend() == "gpu"


def _paged_inputs(seed, t, n, kv_heads, h, page_size, width, lengths, dtype, spare=2):
    """q [B,T,N,H], dense k/v [B, W * page_size, K, H], their pools, the block table and the
    causal positions of the last T tokens of each row."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    q, k, v = (
        rng.standard_normal(shape).astype(np.float32)
        for shape in [(b, t, n, h)] + [(b, width * page_size, kv_heads, h)] * 2
    )
    owned = [-(-length // page_size) for length in lengths]
    num_pages = sum(owned) + spare
    slots = iter(spare + rng.permutation(num_pages - spare))  # owned blocks' pages, shuffled
    table = np.full((b, width), num_pages, np.int32)
    k_pool, v_pool = (np.full((num_pages, page_size, kv_heads, h), np.nan) for _ in "kv")
    for row, count in enumerate(owned):
        for block in range(count):
            page = table[row, block] = next(slots)
            keys = slice(block * page_size, (block + 1) * page_size)
            k_pool[page], v_pool[page] = k[row, keys], v[row, keys]
    lengths = jnp.asarray(lengths, jnp.int32)
    positions = jnp.maximum(lengths[:, None] - t + jnp.arange(t)[None], 0)
    as_dtype = lambda *xs: tuple(jnp.asarray(x, dtype) for x in xs)
    return (*as_dtype(q, k, v, k_pool, v_pool), jnp.asarray(table), lengths, positions)


@partial(jax.jit, static_argnames=["chunk", "causal"])
def _kernel(q, k_pool, v_pool, table, lengths, positions, chunk, causal):
    positions = positions if causal else None
    return pk.paged_attention(
        q, k_pool, v_pool, table, lengths, positions, chunk=chunk, interpret=not ON_GPU
    )


def _dense_reference(q, k, v, lengths, positions, causal):
    """fp32 attention over the dense rows; zeros for a row of length 0 (the kernel's rule)."""
    mask = AttentionMask(positions, lengths, causal=causal)
    out = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask)
    return jnp.where((lengths > 0)[:, None, None, None], out, 0)


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    "t, n, kv_heads, page_size, lengths, causal",
    [
        (1, 4, 4, 16, [70, 0, 33], False),  # GQA 1, a row of length 0, lengths mid-page
        (1, 8, 2, 8, [1, 129, 64], False),  # GQA 4, 8 pages a chunk, a length on a chunk edge
        (1, 8, 1, 64, [100, 5, 128], False),  # GQA 8, one page a chunk
        (3, 8, 2, 16, [3, 150, 40], True),  # speculative verify: 3 tokens, causal among them
    ],
)
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_paged_attention_matches_dense_attention(
    t, n, kv_heads, page_size, lengths, causal, dtype, tolerance
):
    width = 192 // page_size  # three 64-key chunks
    q, k, v, k_pool, v_pool, table, lengths, positions = _paged_inputs(
        7, t, n, kv_heads, 64, page_size, width, lengths, dtype
    )
    ref = _dense_reference(q, k, v, lengths, positions, causal)
    out = _kernel(q, k_pool, v_pool, table, lengths, positions, chunk=64, causal=causal)
    assert out.dtype == dtype and out.shape == q.shape
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _relative_error(out, ref) <= tolerance
    empty = np.asarray(lengths) == 0
    assert (np.asarray(out, np.float32)[empty] == 0).all()


def test_paged_reference_equals_dense_attention():
    q, k, v, k_pool, v_pool, table, lengths, positions = _paged_inputs(
        2, 3, 8, 2, 64, 16, 12, [3, 0, 150, 40], jnp.float32
    )
    paged = pk.paged_attention_reference(q, k_pool, v_pool, table, lengths, positions)
    dense = _dense_reference(q, k, v, lengths, positions, causal=True)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(dense), rtol=1e-5, atol=1e-6)


def _skipping_inputs():
    """Two rows owning 10 pages of 16 keys each, at lengths 70 and 10, and the pages wholly
    past their last visible 64-key chunk set to NaN."""
    q, k, v, k_pool, v_pool, table, _, positions = _paged_inputs(
        3, 1, 8, 2, 64, 16, 10, [160, 160], jnp.float32, spare=0
    )
    lengths = jnp.asarray([70, 10], jnp.int32)  # row 0 sees chunks 0 and 1, row 1 chunk 0
    unread = np.concatenate([np.asarray(table)[0, 8:], np.asarray(table)[1, 4:]])
    k_pool, v_pool = (x.at[unread].set(jnp.nan) for x in (k_pool, v_pool))
    return q, k, v, k_pool, v_pool, table, lengths, positions


def test_paged_attention_skips_chunks_past_the_length():
    q, k, v, k_pool, v_pool, table, lengths, positions = _skipping_inputs()
    ref = _dense_reference(q, k, v, lengths, positions, causal=False)
    # 10 pages of 16 keys: the table is padded to three 64-key chunks
    out = _kernel(q, k_pool, v_pool, table, lengths, positions, chunk=64, causal=False)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ON_GPU, reason="never-written memory is NaN only in the interpreter")
def test_paged_kernel_reads_and_writes_only_visible_chunks():
    """The merge selects skipped chunks away, so the raw partials show what ran: a visible
    chunk's slots are finite (no NaN page read), a skipped chunk's unwritten (NaN)."""
    q, _, _, k_pool, v_pool, table, lengths, _ = _skipping_inputs()
    rows, limit = dk.query_rows(q, 2, lengths, None)
    table = chunked_table(table, k_pool.shape[0], 4)
    run = pk._paged_kernel(2, 16, 2, 64, 64, 12, rows.shape[2], q.dtype, 0.125, interpret=True)
    partials = run(lengths, table, limit, rows, k_pool, v_pool)
    ran = np.asarray(jnp.arange(3)[None, :] * 64 < lengths[:, None])  # [B, C]
    for partial_result in partials:
        finite = np.isfinite(np.asarray(partial_result)).reshape(*partial_result.shape[:3], -1)
        assert (finite.all(-1).all(1) == ran).all()
        assert (finite.any(-1).any(1) == ran).all()


def test_paged_attention_declines_what_it_cannot_run():
    q = jnp.zeros((1, 1, 8, 64))
    pool = jnp.zeros((4, 16, 2, 64))
    assert pk.paged_attention_applies(q, pool)
    assert pk.paged_attention_applies(q, pool, chunk=64)
    assert not pk.paged_attention_applies(q, jnp.zeros((4, 12, 2, 64)), chunk=192)  # 8 ∤ 12
    assert not pk.paged_attention_applies(q, jnp.zeros((4, 128, 2, 64)), chunk=64)  # page > L
    assert not pk.paged_attention_applies(jnp.zeros((1, 17, 8, 64)), pool)  # 68 query rows
    assert not pk.paged_attention_applies(q, pool, sliding_window=32)
    with pytest.raises(ValueError, match="does not apply"):
        table = jnp.zeros((1, 1), jnp.int32)
        pk.paged_attention(q, pool, pool, table, jnp.ones(1, jnp.int32), chunk=32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("t, causal, page_size", [(1, False, 16), (4, True, 64)])
def test_paged_attention_on_gpu_matches_dense_attention(t, causal, page_size):
    rng = np.random.default_rng(11)
    lengths = list(rng.integers(t, 2049, 4))
    q, k, v, k_pool, v_pool, table, lengths, positions = _paged_inputs(
        11, t, 32, 8, 128, page_size, 2048 // page_size, lengths, jnp.bfloat16
    )
    ref = _dense_reference(q, k, v, lengths, positions, causal)
    out = _kernel(q, k_pool, v_pool, table, lengths, positions, chunk=256, causal=causal)
    assert _relative_error(out, ref) <= 1e-2
