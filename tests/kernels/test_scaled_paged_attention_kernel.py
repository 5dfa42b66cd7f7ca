"""The fp8-cache decode kernel (``pallas_kernels/scaled_paged_attention.py``) against its jnp
reference, in interpret mode on the CPU (compiled on the GPU), and the dispatch of
``spark_jax.ops.attention.cache_attention`` over dense and paged E4M3 caches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import scaled_paged_attention as spa
from spark_jax.ops.attention import cache_attention
from spark_jax.ops.kv_cache import FP8, PagedLayer, ScaledLayer, quantize_kv
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask

ON_GPU = jax.default_backend() == "gpu"


def _close(out: jax.Array, ref: jax.Array, tolerance: float = 1e-2) -> bool:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return np.linalg.norm(out - ref) <= tolerance * np.linalg.norm(ref)


def _paged_case(seed, rows, heads, kv_heads, head_dim, page_size, width, lengths):
    """q, E4M3 pages with uneven per-head scales, and a table of distinct shuffled pages
    (entries past each row's pages hold the out-of-range id)."""
    rng = np.random.default_rng(seed)
    num_pages = rows * width + 3
    q = jnp.asarray(rng.standard_normal((rows, 1, heads, head_dim)), jnp.bfloat16)
    scales = [jnp.asarray(rng.uniform(0.25, 2.0, kv_heads), jnp.bfloat16) for _ in range(2)]
    shape = (num_pages, page_size, kv_heads, head_dim)
    pages = [quantize_kv(jnp.asarray(rng.standard_normal(shape) * 2), s) for s in scales]
    owned = rng.permutation(num_pages)[: rows * width].reshape(rows, width)
    lengths = np.asarray(lengths, np.int32)
    used = np.arange(width)[None, :] < -(-lengths[:, None] // page_size)
    table = jnp.asarray(np.where(used, owned, num_pages), jnp.int32)
    return q, pages[0], pages[1], scales[0], scales[1], table, jnp.asarray(lengths)


@pytest.mark.parametrize(
    "heads, kv_heads, page_size, programs, keys_per_step",
    [
        (8, 2, 16, 8, 16),
        (8, 2, 16, 4096, 16),
        (6, 2, 32, 64, 32),
        (4, 4, 16, 1, 16),
        (8, 2, 16, 8, 64),  # 4 pages a step: 6 pages in 2 steps, the last half out of range
        (8, 2, 16, 4096, 32),  # 2 pages a step, as many splits as steps
        (6, 2, 32, 1, 128),  # 4 pages a step, one program a row
    ],
)
def test_kernel_matches_the_reference(heads, kv_heads, page_size, programs, keys_per_step):
    # Lengths 0 (zeros), 1, inside a page, on a page's end and the whole table.
    case = _paged_case(0, 5, heads, kv_heads, 64, page_size, 6, [0, 1, 17, 96, 6 * page_size])
    kernel = lambda *a: spa.scaled_paged_attention(
        *a, programs=programs, keys_per_step=keys_per_step, interpret=not ON_GPU
    )
    out = jax.jit(kernel)(*case)
    ref = spa.scaled_paged_attention_reference(*case)
    assert out.shape == (5, 1, heads, 64) and out.dtype == jnp.bfloat16
    assert _close(out, ref)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # the empty row


@pytest.mark.parametrize(
    "page_size, programs, keys_per_step",
    [
        (16, 8, 16),
        (16, 4096, 16),
        (16, 8, 64),  # 4 pages a step: the last step reaches past the last row's pages
        (32, 1, 128),
    ],
)
def test_consecutive_pages_read_the_same_keys_as_the_table(page_size, programs, keys_per_step):
    # A dense cache's table: row r's pages r * 6 .. r * 6 + 5, one after another, the last
    # row's at the pool's end. The kernel told so reads each row's first entry alone.
    q, k_pages, v_pages, k_scale, v_scale, _, lengths = _paged_case(
        3, 5, 8, 2, 64, page_size, 6, [0, 1, 17, 96, 6 * page_size]
    )
    k_pages, v_pages = k_pages[:30], v_pages[:30]  # 5 rows x 6 pages: no spare page after
    table = jnp.arange(30, dtype=jnp.int32).reshape(5, 6)
    case = (q, k_pages, v_pages, k_scale, v_scale, table, lengths)
    run = lambda consecutive: spa.scaled_paged_attention(
        *case,
        programs=programs,
        keys_per_step=keys_per_step,
        consecutive_pages=consecutive,
        interpret=not ON_GPU,
    )
    out = run(True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(run(False), np.float32))
    assert _close(out, spa.scaled_paged_attention_reference(*case))


def test_queries_beyond_fp16s_range_saturate_instead_of_overflowing():
    # The kernel takes q in fp16: one component of 1e6 (1.25e5 after the 1 / 8 scale)
    # overflows it unless it saturates (inf times the zero key components below would be NaN).
    # Only each row's first key has that component (1.0, the others 0), so that key alone
    # dominates the head's softmax in the kernel and the reference alike: with tied keys the
    # tie would be broken by the other components' few units, below f32's resolution at
    # scores ~1e5, which the kernel and the reference round in different orders.
    q, k_pages, *rest = _paged_case(2, 3, 8, 2, 64, 16, 4, [9, 40, 64])
    v_pages, _, v_scale, table, _ = rest
    q = q.at[:, 0, 3, 5].set(1e6)  # query head 3 reads kv head 0 (G = 4)
    k_pages = k_pages.at[:, :, 0, 5].set(0).at[table[:, 0], 0, 0, 5].set(1.0)
    case = (q, k_pages, *rest)
    out = spa.scaled_paged_attention(*case, interpret=not ON_GPU)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    assert _close(out, spa.scaled_paged_attention_reference(*case))
    first_value = v_pages[table[:, 0], 0, 0].astype(jnp.float32) * v_scale[0].astype(jnp.float32)
    assert _close(out[:, 0, 3], first_value)  # the head's output is that key's value


def test_applies_only_where_its_constraints_hold():
    q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
    pages = jnp.zeros((4, 16, 2, 64), FP8)
    assert spa.scaled_paged_attention_applies(q, pages)
    assert not spa.scaled_paged_attention_applies(q, pages.astype(jnp.bfloat16))  # not E4M3
    assert not spa.scaled_paged_attention_applies(jnp.zeros((2, 3, 8, 64), q.dtype), pages)
    assert not spa.scaled_paged_attention_applies(q, jnp.zeros((4, 8, 2, 64), FP8))  # 8-key pages
    assert not spa.scaled_paged_attention_applies(q.astype(jnp.float32), pages)
    assert not spa.scaled_paged_attention_applies(jnp.zeros((2, 1, 48, 64), q.dtype), pages)


@pytest.mark.parametrize("layout", ["dense", "paged"])
def test_cache_attention_reads_an_fp8_cache_through_the_kernel(layout):
    q, k_pages, v_pages, k_scale, v_scale, table, lengths = _paged_case(
        1, 4, 8, 2, 64, 16, 8, [5, 128, 70, 33]
    )
    if layout == "paged":
        slots = jnp.asarray([2, 0, 3, 1])  # rows read out of order: table row i is slot i's
        k_cache = PagedLayer(k_pages, table[jnp.argsort(slots)], k_scale)
        v_cache = PagedLayer(v_pages, table[jnp.argsort(slots)], v_scale)
    else:  # each row's pages laid end to end: a dense [slots, S, K, H] buffer
        rows = lambda p: jnp.take(p, jnp.clip(table, 0, p.shape[0] - 1), axis=0)
        dense = lambda p: rows(p).reshape(4, 8 * 16, *p.shape[2:])
        k_cache, v_cache = (
            ScaledLayer(dense(k_pages), k_scale),
            ScaledLayer(dense(v_pages), v_scale),
        )
        slots = None
    mask = AttentionMask(query_positions=(lengths - 1)[:, None], key_lengths=lengths)
    run = lambda options: cache_attention(q, k_cache, v_cache, slots, mask, None, options)
    kernel, xla = run(KernelOptions(implementation="pallas")), run(KernelOptions("xla"))
    assert _close(kernel, xla)
    ref = spa.scaled_paged_attention_reference(
        q, k_pages, v_pages, k_scale, v_scale, table, lengths
    )
    assert _close(xla, ref)
    if not ON_GPU:  # the default dispatch keeps XLA's path off the GPU
        np.testing.assert_array_equal(
            np.asarray(run(KernelOptions()), np.float32), np.asarray(xla, np.float32)
        )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("rows", [1, 64])
def test_the_compiled_kernel_at_llama_shapes(rows):
    lengths = np.linspace(1, 4096, rows).astype(np.int32)
    case = _paged_case(rows, rows, 32, 8, 128, 16, 256, lengths)
    out = jax.jit(spa.scaled_paged_attention)(*case)
    assert _close(out, spa.scaled_paged_attention_reference(*case))
