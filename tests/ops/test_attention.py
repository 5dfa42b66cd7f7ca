"""Attention implementations against the jnp reference, and the dispatch's fallback."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spark_jax.ops import attention as att
from spark_jax.ops import cudnn
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask, reference_attention, split_kv_attention


def _inputs(seed, b, t, n, kv_heads, h, s, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal(shape), dtype)
        for shape in [(b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h)]
    )
    lengths = jnp.asarray(rng.integers(t, s + 1, b), jnp.int32)
    positions = lengths[:, None] - t + jnp.arange(t)[None]
    return q, k, v, AttentionMask(positions, lengths)


@pytest.mark.parametrize(
    "b, t, n, kv_heads, window, chunk",
    [(2, 1, 8, 2, None, 64), (3, 1, 4, 4, None, 128), (2, 5, 8, 1, None, 64), (2, 1, 8, 2, 37, 64)],
)
def test_split_kv_attention_matches_the_reference(b, t, n, kv_heads, window, chunk):
    q, k, v, mask = _inputs(b * 10 + t, b, t, n, kv_heads, 16, 256)
    ref = reference_attention(q, k, v, mask, window)
    out = split_kv_attention(q, k, v, mask, window, chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_dispatch_falls_back_to_the_reference_off_gpu():
    q, k, v, mask = _inputs(0, 2, 1, 8, 2, 16, 64, jnp.bfloat16)
    if jax.default_backend() == "gpu":
        pytest.skip("the fallback is what runs off the GPU")
    assert not cudnn.cudnn_decode_applies(q, k, None)
    out = att.attention(q, k, v, mask)
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(reference_attention(q, k, v, mask), np.float32)
    )


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_cudnn_decode_attention_matches_the_reference_on_gpu():
    q, k, v, mask = _inputs(1, 8, 1, 32, 8, 128, 1024, jnp.bfloat16)
    assert cudnn.cudnn_decode_applies(q, k, None)
    ref = reference_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), mask
    )
    out = att.attention(q, k, v, mask).astype(jnp.float32)
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-2


def _paged_inputs(seed, b, n, kv_heads, h, page_size, num_pages, width, dtype=jnp.float32):
    """A page pool, a block table of distinct pages (num_pages where a row owns none), and the
    decode query and mask of rows with random lengths."""
    from spark_jax.ops.kv_cache import PagedLayer

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, width * page_size + 1, b)
    owned = -(-lengths // page_size)
    pages = rng.permutation(num_pages)[: owned.sum()]
    table = np.full((b, width), num_pages, np.int32)
    starts = np.concatenate([[0], np.cumsum(owned)])
    for row in range(b):
        table[row, : owned[row]] = pages[starts[row] : starts[row + 1]]
    pool_shape = (num_pages, page_size, kv_heads, h)
    k, v = (
        PagedLayer(jnp.asarray(rng.standard_normal(pool_shape), dtype), jnp.asarray(table))
        for _ in range(2)
    )
    q = jnp.asarray(rng.standard_normal((b, 1, n, h)), dtype)
    lengths = jnp.asarray(lengths, jnp.int32)
    return q, k, v, AttentionMask(lengths[:, None] - 1, lengths, causal=False)


def test_cudnn_page_table_addresses_each_rows_keys():
    """The padded page table reads, within each row's length, exactly the keys the gather does
    (cuDNN itself runs only on the GPU: the test below)."""
    q, k, _, mask = _paged_inputs(3, b=4, n=4, kv_heads=2, h=8, page_size=4, num_pages=32, width=6)
    table = cudnn.cudnn_page_table(k.block_table, k.pages.shape[0])
    assert table.shape == (4, 1, 8, 1)
    assert int(table.max()) < k.pages.shape[0]
    via_table = k.pages[table[:, 0, :, 0]].reshape(4, -1, 2, 8)
    gathered = k.read(None)
    for row, n in enumerate(np.asarray(mask.key_lengths)):
        np.testing.assert_array_equal(np.asarray(via_table[row, :n]), np.asarray(gathered[row, :n]))


def test_cache_attention_on_pages_falls_back_to_the_gather_off_gpu():
    q, k, v, mask = _paged_inputs(4, b=4, n=4, kv_heads=2, h=8, page_size=4, num_pages=32, width=6)
    if jax.default_backend() == "gpu":
        pytest.skip("the fallback is what runs off the GPU")
    assert not cudnn.cudnn_paged_applies(q, k, 4, None)
    out = att.cache_attention(q, k, v, None, mask)
    ref = reference_attention(q, k.read(None), v.read(None), mask)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_paged_kernel_takes_our_kernel_where_cudnn_does_not(monkeypatch):
    """The default dispatch reads the pages in place with our kernel where cuDNN's paged
    attention does not apply (a pool smaller than rows x table width: an 80 GB H100's at 256
    rows), for one-token steps on Hopper only; forced choices keep their kernel. Here the
    Hopper check is patched and the kernel interpreted."""
    if jax.default_backend() == "gpu":
        pytest.skip("on the GPU the real checks decide")
    q, k, v, mask = _paged_inputs(
        4, b=4, n=4, kv_heads=2, h=64, page_size=8, num_pages=40, width=8
    )  # fmt: skip
    assert att.paged_kernel(q, k) is None  # off Hopper: the gather
    monkeypatch.setattr(att, "_pallas_compiles", lambda q: True)
    assert not cudnn.cudnn_paged_applies(q, k, 4, None)
    assert att.paged_kernel(q, k) == "pallas"
    assert att.paged_kernel(q, k, options=KernelOptions(implementation="cudnn")) is None
    assert att.paged_kernel(q, k, options=KernelOptions(implementation="xla")) is None
    prefill = jnp.concatenate([q, q], axis=1)  # a chunk of two queries: not a decode step
    assert att.paged_kernel(prefill, k) is None
    assert att.paged_kernel(q, k.read(None)) is None  # not a paged cache
    monkeypatch.setattr(cudnn, "cudnn_paged_applies", lambda *a: True)
    monkeypatch.setattr(att, "cudnn_paged_applies", lambda *a: True)
    assert att.paged_kernel(q, k) == "cudnn"  # where it applies, cuDNN's
    monkeypatch.setattr(att, "cudnn_paged_applies", lambda *a: False)
    out = att.cache_attention(q, k, v, None, mask)
    ref = reference_attention(q, k.read(None), v.read(None), mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("page_size", [16, 64])
def test_cudnn_paged_decode_attention_matches_the_gather_on_gpu(page_size):
    q, k, v, mask = _paged_inputs(
        5, b=8, n=32, kv_heads=8, h=128, page_size=page_size, num_pages=8 * 32, width=16,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    assert cudnn.cudnn_paged_applies(q, k, 8, None)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = reference_attention(f32(q), f32(k.read(None)), f32(v.read(None)), mask)
    out = f32(att.cache_attention(q, k, v, None, mask))
    rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-2


def test_dispatch_runs_the_flash_kernel_for_prefill_where_it_compiles(monkeypatch):
    """With ``KernelOptions.flash_prefill`` (the default) and where our kernels compile
    (Hopper, bf16), a prefill (T > 1) goes through the flash kernel and a decode step does
    not; ``flash_prefill=False`` keeps the reference. Here the check is patched, the kernel
    interpreted."""
    if jax.default_backend() == "gpu":
        pytest.skip("on the GPU the real check decides; tests/test_gpu_paths.py covers it")
    calls = []
    flash = att.pallas_prefill_attention
    monkeypatch.setattr(att, "_pallas_compiles", lambda q: True)
    monkeypatch.setattr(
        att, "pallas_prefill_attention", lambda *a, **kw: calls.append(a[0].shape) or flash(*a)
    )
    q, k, v, mask = _inputs(9, 2, 128, 4, 2, 64, 128)  # a fresh prefill: S = T
    positions = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (2, 128))
    mask = AttentionMask(positions, jnp.asarray([77, 128], jnp.int32))  # ragged prompts
    out = att.attention(q, k, v, mask)
    assert calls == [q.shape]
    ref = reference_attention(q, k, v, mask)
    real = np.arange(128)[None, :] < np.asarray(mask.key_lengths)[:, None]  # past: zeros
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)
    att.attention(q[:, :1], k, v, AttentionMask(mask.query_positions[:, :1], mask.key_lengths))
    assert calls == [q.shape]  # a decode step is not a prefill
    out = att.attention(q, k, v, mask, options=KernelOptions(flash_prefill=False))
    assert calls == [q.shape]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("page_size, width", [(8, 24), (16, 9)])
def test_a_chunk_of_queries_reads_the_pages_in_place_with_the_flash_kernel(
    monkeypatch, page_size, width
):
    """Where our kernels compile (patched here, the kernel interpreted), ``cache_attention`` of
    a chunk of queries over a paged cache (the engine's prefill, appending to its rows) runs
    the flash kernel over the pool in place, rows of a few keys to many pages among them,
    and gives the gather + reference's output on every real query; without
    ``paged_flash_prefill``, or with ``flash_prefill=False``, it gathers."""
    q, k, v, mask = _paged_inputs(
        13, b=4, n=8, kv_heads=2, h=64, page_size=page_size, num_pages=96, width=width
    )  # fmt: skip
    t = 64
    q = jnp.asarray(np.random.default_rng(14).standard_normal((4, t, 8, 64)), jnp.float32)
    lengths = mask.key_lengths.at[0].set(20)  # a row shorter than the chunk
    starts = jnp.maximum(lengths - t, 0)
    mask = AttentionMask(starts[:, None] + jnp.arange(t, dtype=jnp.int32), lengths)
    paged = KernelOptions(paged_flash_prefill=True)
    assert att.paged_kernel(q, k, options=paged) is None  # off Hopper: the gather
    monkeypatch.setattr(att, "_pallas_compiles", lambda q: True)
    assert att.paged_kernel(q, k, options=paged) == "flash"
    assert att.paged_kernel(q, k) is None  # not asked for
    off = KernelOptions(flash_prefill=False, paged_flash_prefill=True)
    assert att.paged_kernel(q, k, options=off) is None
    assert att.paged_kernel(q[:, :48], k, options=paged) is None  # not whole query blocks
    out = att.cache_attention(q, k, v, None, mask, options=paged)
    ref = reference_attention(q, k.read(None), v.read(None), mask)
    real = np.arange(t)[None, :] < np.asarray(mask.key_lengths - starts)[:, None]
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("t", [576, 640])
def test_a_prefill_chunk_over_pages_in_place_equals_the_kernel_over_gathered_rows_on_gpu(t):
    """Llama-3-8B's heads, a cached wave's prefill: 8 rows of 72 new queries after ~1 000
    cached keys in 16-key pages (128-page table), padded to the ragged batch's ``t``. The
    flash kernel over the pages in place gives what it gives over the gathered rows, and
    both are near the f32 reference."""
    from spark_jax.ops.kv_cache import PagedLayer

    rng = np.random.default_rng(17)
    table = jnp.asarray(rng.permutation(8 * 128).reshape(8, 128), jnp.int32)  # all owned
    pool = lambda: jnp.asarray(rng.standard_normal((8 * 128, 16, 8, 128)), jnp.bfloat16)  # noqa: E731
    k, v = PagedLayer(pool(), table), PagedLayer(pool(), table)
    lengths = jnp.full((8,), 1072, jnp.int32)
    starts = lengths - 72
    q = jnp.asarray(np.random.default_rng(18).standard_normal((8, t, 32, 128)), jnp.bfloat16)
    mask = AttentionMask(starts[:, None] + jnp.arange(t, dtype=jnp.int32), lengths)
    paged = KernelOptions(paged_flash_prefill=True)
    assert att.paged_kernel(q, k, options=paged) == "flash"
    out = att.cache_attention(q, k, v, None, mask, options=paged)
    gathered = att.attention(q, k.read(None), v.read(None), mask)
    f32 = lambda x: np.asarray(x[:, :72].astype(jnp.float32))  # noqa: E731
    np.testing.assert_array_equal(f32(out), f32(gathered))
    ref = reference_attention(
        *(x.astype(jnp.float32) for x in (q, k.read(None), v.read(None))), mask
    )
    rel = np.linalg.norm(f32(out) - f32(ref)) / np.linalg.norm(f32(ref))
    assert rel < 1e-2


def test_options_implementation_forces_a_path_for_that_call_only():
    q, k, v, mask = _inputs(6, 2, 1, 8, 2, 16, 64)
    np.testing.assert_array_equal(
        np.asarray(att.attention(q, k, v, mask, options=KernelOptions(implementation="xla"))),
        np.asarray(reference_attention(q, k, v, mask)),
    )
    if jax.default_backend() != "gpu":
        cudnn_options = KernelOptions(implementation="cudnn")
        with pytest.raises(ValueError, match="cudnn"):
            att.attention(q, k, v, mask, options=cudnn_options)  # cuDNN: not off the GPU
    att.attention(q, k, v, mask)  # the default options: the dispatch picks, no error
    with pytest.raises(ValueError, match="unknown implementation"):
        KernelOptions(implementation="triton")


def test_kernel_options_are_frozen_and_hashable():
    """A static jit argument: equal options hash equal, and a field cannot be changed."""
    import dataclasses

    assert hash(KernelOptions()) == hash(KernelOptions())
    assert KernelOptions(implementation="xla") != KernelOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().flash_prefill = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="paged_walk_stages"):
        KernelOptions(paged_walk_stages=1)


def test_forced_pallas_attends_over_pages_with_the_paged_kernel():
    """``cache_attention`` under ``KernelOptions(implementation="pallas")`` runs the paged
    kernel (interpreted off the GPU) and matches the gather + reference."""
    q, k, v, mask = _paged_inputs(
        7, b=3, n=8, kv_heads=2, h=64, page_size=16, num_pages=24, width=8
    )  # fmt: skip
    assert att.pallas_paged_applies(q, k, None)
    out = att.cache_attention(q, k, v, None, mask, options=KernelOptions(implementation="pallas"))
    ref = reference_attention(q, k.read(None), v.read(None), mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size, width", [(8, 20), (16, 9), (64, 3)])
def test_forced_pallas_walks_the_pages_of_many_rows_with_the_flash_kernel(
    monkeypatch, page_size, width
):
    """Above ``flash_decode_min_programs`` the paged step runs the flash walk over the pool
    in place (a TMA copy per page into each key block; rows whose pages do not fill the last
    128-key block, table entries past a row's pages): equal to the gather + reference."""
    from pallas_kernels import flash_attention as fa

    q, k, v, mask = _paged_inputs(
        11, b=3, n=8, kv_heads=2, h=64, page_size=page_size, num_pages=64, width=width
    )  # fmt: skip
    walked = []
    flash = fa.flash_decode_attention
    monkeypatch.setattr(
        fa, "flash_decode_attention", lambda *a, **kw: walked.append(1) or flash(*a, **kw)
    )
    options = KernelOptions(implementation="pallas", flash_decode_min_programs=4)
    out = att.cache_attention(q, k, v, None, mask, options=options)
    assert walked == [1]
    ref = reference_attention(q, k.read(None), v.read(None), mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
