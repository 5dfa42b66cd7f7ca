"""The FlashAttention prefill kernel (Mosaic GPU) against its jnp reference.

Off the GPU the kernel runs in Mosaic GPU's interpreter on small shapes; on a GPU the same
checks run compiled, plus one on a bigger shape. Lengths are never multiples of the blocks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_attention as fa
from spark_jax.ops.options import KernelOptions

ON_GPU = jax.default_backend() == "gpu"
_DEFAULTS = KernelOptions()
PAGED_WALK = {  # the engine's paged walk
    "stages": _DEFAULTS.paged_walk_stages,
    "consumers": _DEFAULTS.paged_walk_consumers,
}


def _inputs(seed, b, t, s, n, kv_heads, h, dtype):
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, h), (b, s, kv_heads, h), (b, s, kv_heads, h)]
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)


@partial(
    jax.jit,
    static_argnames=["causal", "block_q", "block_k", "stages", "consumers", "pingpong", "programs"],
)
def _kernel(
    q,
    k,
    v,
    query_lengths,
    key_lengths,
    causal,
    block_q=64,
    block_k=64,
    stages=2,
    consumers=0,
    pingpong=False,
    programs=None,
):
    return fa.flash_attention(
        q,
        k,
        v,
        query_lengths,
        key_lengths,
        causal=causal,
        block_q=block_q,
        block_k=block_k,
        stages=stages,
        consumers=consumers,
        pingpong=pingpong,
        programs=programs,
        interpret=not ON_GPU,
    )


def _reference(q, k, v, query_lengths, key_lengths, causal):
    up = (x.astype(jnp.float32) for x in (q, k, v))
    return fa.flash_attention_reference(*up, query_lengths, key_lengths, causal)


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# (t, s, n, kv_heads, h, query lengths, key lengths, causal, block_q, block_k)
CASES = {
    # Prefill of ragged prompts, GQA 1; the second row is idle (no queries: all zeros).
    "causal_gqa1": (128, 128, 2, 2, 64, [100, 0], [100, 0], True, 64, 64),
    # GQA 4, queries appended to a cached prefix (key length > query length).
    "causal_gqa4_prefix": (128, 192, 8, 2, 64, [70, 128], [131, 150], True, 64, 64),
    # GQA 8, one 128-row query block; a row with keys but fewer than its queries (its first
    # queries see no key: zeros) and a row with queries but no keys (zeros).
    "causal_gqa8_unseen": (128, 128, 8, 1, 64, [90, 40], [50, 0], True, 128, 64),
    # NLLB cross-attention: padded target queries over padded source lengths, non-causal.
    "cross_gqa4": (64, 256, 4, 1, 64, [37, 64], [200, 77], False, 64, 128),
    # Head dim 128, GQA 4, 128-key blocks.
    "causal_h128": (128, 128, 4, 1, 128, [128, 81], [128, 97], True, 64, 128),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_flash_attention_matches_the_reference(case, dtype, tolerance):
    t, s, n, kv_heads, h, q_len, k_len, causal, block_q, block_k = CASES[case]
    q, k, v = _inputs(1, 2, t, s, n, kv_heads, h, dtype)
    q_len, k_len = jnp.asarray(q_len, jnp.int32), jnp.asarray(k_len, jnp.int32)
    out = _kernel(q, k, v, q_len, k_len, causal, block_q, block_k)
    assert out.dtype == dtype and out.shape == q.shape
    ref = _reference(q, k, v, q_len, k_len, causal)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _relative_error(out, ref) <= tolerance
    padding = np.arange(t)[None, :] >= np.asarray(q_len)[:, None]  # queries past the length
    assert (np.asarray(out, np.float32)[padding] == 0).all()


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("case", ["causal_gqa4_prefix", "cross_gqa4"])
def test_deeper_pipelines_give_the_same_attention(case, stages):
    """3 and 4 K/V slots: rows walking fewer blocks than there are slots (fewer prefetches
    than slots), and more (slots reused)."""
    t, s, n, kv_heads, h, q_len, k_len, causal, block_q, _ = CASES[case]
    q, k, v = _inputs(3, 2, t, s, n, kv_heads, h, jnp.float32)
    q_len, k_len = jnp.asarray(q_len, jnp.int32), jnp.asarray(k_len, jnp.int32)
    out = _kernel(q, k, v, q_len, k_len, causal, block_q, 64, stages)
    assert _relative_error(out, _reference(q, k, v, q_len, k_len, causal)) <= 1e-5


@pytest.mark.parametrize(
    "case, consumers, stages, pingpong, programs",
    [
        ("causal_gqa1", 2, 2, False, None),
        ("cross_gqa4", 1, 3, False, 3),
        ("causal_gqa4_prefix", 2, 2, True, 3),
        ("causal_gqa1", 2, 2, True, None),
    ],
)
def test_warp_specialized_programs_give_the_same_attention(
    case, consumers, stages, pingpong, programs
):
    """A producer warpgroup with one or two consumers: two query blocks of one program that
    walk different numbers of key blocks (causal, ragged: the shorter one releases the
    slots it does not read), an idle row, and more key blocks than slots; two consumers
    taking turns on the tensor cores (``pingpong``), where one walks fewer blocks or none;
    and persistent programs (3 of them over 8 or 16 tiles: uneven counts, slots and query
    buffers reused across tiles)."""
    t, s, n, kv_heads, h, q_len, k_len, causal, block_q, block_k = CASES[case]
    q, k, v = _inputs(4, 2, t, s, n, kv_heads, h, jnp.float32)
    q_len, k_len = jnp.asarray(q_len, jnp.int32), jnp.asarray(k_len, jnp.int32)
    tuning = dict(stages=stages, consumers=consumers, pingpong=pingpong, programs=programs)
    out = _kernel(q, k, v, q_len, k_len, causal, block_q, block_k, **tuning)
    ref = _reference(q, k, v, q_len, k_len, causal)
    assert _relative_error(out, ref) <= 1e-5
    padding = np.arange(t)[None, :] >= np.asarray(q_len)[:, None]
    assert (np.asarray(out)[padding] == 0).all()


def test_flash_attention_never_reads_past_the_lengths():
    """NaN in every key block past a row's key length and in every query past its query
    length: the kernel's output stays finite (and right), so those blocks were never read."""
    q, k, v = _inputs(2, 2, 128, 192, 4, 2, 64, jnp.float32)
    q_len, k_len = jnp.asarray([60, 128], jnp.int32), jnp.asarray([64, 120], jnp.int32)
    ref = _reference(q, k, v, q_len, k_len, causal=True)
    keys_past = (jnp.arange(192)[None, :] >= jnp.asarray([64, 128])[:, None])[..., None, None]
    queries_past = (jnp.arange(128)[None, :] >= q_len[:, None])[..., None, None]
    k, v = (jnp.where(keys_past, jnp.nan, x) for x in (k, v))
    q = jnp.where(queries_past, jnp.nan, q)
    out = _kernel(q, k, v, q_len, k_len, causal=True)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_key_blocks_skip_exactly_the_invisible_blocks(causal):
    """Against the dense mask, for every query block: the walked key blocks are those with a
    key visible to a live query, and the unmasked ones those visible to every live query."""
    t, s, block_q, block_k = 256, 320, 64, 64
    lengths = [(0, 0), (0, 100), (1, 1), (50, 50), (100, 300), (256, 256), (256, 320), (200, 30)]
    for q_len, k_len in lengths:
        q_lengths, k_lengths = jnp.asarray([q_len]), jnp.asarray([k_len])
        mask = fa.attention_mask(t, s, q_lengths, k_lengths, causal)
        dense = np.asarray(mask[0]) & (np.arange(t) < q_len)[:, None]
        for q_start in range(0, t, block_q):
            full, total = fa._key_blocks(
                jnp.int32(q_start), q_lengths[0], k_lengths[0], block_q, block_k, causal
            )
            tiles = dense[q_start : q_start + block_q].reshape(block_q, -1, block_k)
            live = tiles[: max(0, min(block_q, q_len - q_start))]
            any_visible = tiles.any(axis=(0, 2))
            all_visible = live.all(axis=(0, 2)) & (live.shape[0] > 0)
            assert int(total) == (np.flatnonzero(any_visible).max() + 1 if any_visible.any() else 0)
            assert int(full) == int(np.argmin(np.append(all_visible, False)))
            assert all_visible[: int(full)].all()


def test_flash_attention_declines_what_it_cannot_run():
    q, k = jnp.zeros((1, 128, 8, 64)), jnp.zeros((1, 256, 2, 64))
    assert fa.flash_attention_applies(q, k)
    assert fa.flash_attention_applies(q, k, block_q=128, block_k=64)
    assert not fa.flash_attention_applies(q[:, :100], k)  # T not a multiple of the block
    assert not fa.flash_attention_applies(q, k[:, :200])  # S not a multiple of the block
    assert not fa.flash_attention_applies(q[..., :7, :], k)  # 7 heads over 2 kv heads
    assert not fa.flash_attention_applies(jnp.zeros((1, 128, 8, 96)), jnp.zeros((1, 256, 2, 96)))
    assert not fa.flash_attention_applies(q, k.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="does not apply"):
        fa.flash_attention(q[:, :100], k, k, interpret=True)
    with pytest.raises(ValueError, match="does not apply"):  # 2 x 64 rows do not divide 64
        fa.flash_attention(q[:, :64], k, k, consumers=2, interpret=True)
    with pytest.raises(ValueError, match="does not apply"):
        fa.flash_attention(q, k, k, consumers=3, interpret=True)
    with pytest.raises(ValueError, match="does not apply"):  # ping-pong takes 2 consumers
        fa.flash_attention(q, k, k, consumers=1, pingpong=True, interpret=True)
    with pytest.raises(ValueError, match="does not apply"):  # persistent: warp-specialised
        fa.flash_attention(q, k, k, programs=4, interpret=True)
    with pytest.raises(ValueError, match="positive scale"):  # row max of unscaled scores
        fa.flash_attention(q, k, k, scale=-0.125, interpret=True)
    big_q, big_k = (
        jnp.zeros((1, 256, 8, 128), jnp.bfloat16),
        jnp.zeros((1, 512, 2, 128), jnp.bfloat16),
    )
    with pytest.raises(ValueError, match="KiB of shared memory"):  # checked before compiling
        fa.flash_attention(big_q, big_k, big_k, block_k=128, stages=4, consumers=2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize(
    "causal, t, s, lengths",
    [(True, 1024, 1024, ([1024, 700], [1024, 900])), (False, 256, 1024, ([256, 31], [977, 400]))],
)
@pytest.mark.parametrize(
    "dtype, stages, consumers, pingpong",
    [
        (jnp.bfloat16, 2, 0, False),
        (jnp.float16, 2, 0, False),
        (jnp.bfloat16, 3, 0, False),
        (jnp.bfloat16, 2, 2, False),
        (jnp.bfloat16, 2, 2, True),
    ],
)
def test_flash_attention_on_gpu_matches_the_reference(
    causal, t, s, lengths, dtype, stages, consumers, pingpong
):
    q, k, v = _inputs(11, 2, t, s, 32, 8, 128, dtype)
    q_len, k_len = (jnp.asarray(x, jnp.int32) for x in lengths)
    out = fa.flash_attention(
        q,
        k,
        v,
        q_len,
        k_len,
        causal=causal,
        stages=stages,
        consumers=consumers,
        pingpong=pingpong,
    )
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _relative_error(out, _reference(q, k, v, q_len, k_len, causal)) <= 1e-2


def test_the_dispatch_runs_the_flash_kernel_on_the_models_prefill_mask():
    """``attention`` under ``KernelOptions(implementation="pallas")`` for a chunk appended to
    a cached prefix (positions ``starts + t``, keys below ``starts + num_new``): the real
    queries match the reference; padding queries (t >= num_new) are the kernel's zeros."""
    from spark_jax.ops import attention as att
    from spark_jax.ops.reference import AttentionMask, reference_attention

    rng = np.random.default_rng(21)
    b, t, s, n, kv_heads, h = 2, 64, 128, 4, 2, 64
    q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((b, s, kv_heads, h)), jnp.float32) for _ in "kv")
    starts, num_new = jnp.asarray([10, 0]), jnp.asarray([50, 64])
    mask = AttentionMask(starts[:, None] + jnp.arange(t)[None], starts + num_new)
    pallas = KernelOptions(implementation="pallas")
    out = np.asarray(att.attention(q, k, v, mask, options=pallas))
    ref = np.asarray(reference_attention(q, k, v, mask))
    for row, real in enumerate(np.asarray(num_new)):
        np.testing.assert_allclose(out[row, :real], ref[row, :real], rtol=1e-5, atol=1e-5)
        assert not out[row, real:].any()


@pytest.mark.parametrize("n, kv_heads, h, s", [(8, 2, 64, 256), (8, 1, 128, 128), (2, 2, 64, 64)])
def test_flash_decode_matches_the_reference(n, kv_heads, h, s):
    """A one-token step through the flash kernel (each kv head's query heads as rows): ragged
    lengths, one row of length 0 (zeros), GQA 4, 8 and 1."""
    q, k, v = _inputs(5, 3, 1, s, n, kv_heads, h, jnp.float32)
    lengths = jnp.asarray([s, 0, s // 2 + 3], jnp.int32)
    out = jax.jit(partial(fa.flash_decode_attention, interpret=not ON_GPU))(q, k, v, lengths)
    ref = _reference(q, k, v, jnp.ones(3, jnp.int32), lengths, causal=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert (np.asarray(out)[1] == 0).all()


def test_flash_decode_with_a_producer_warpgroup_matches_the_reference():
    """The decode walk with its copies issued by a producer warpgroup, 3 slots over rows of
    4 key blocks (slots reused), ragged lengths, a row of one block and an empty row."""
    q, k, v = _inputs(7, 4, 1, 256, 8, 2, 64, jnp.float32)
    lengths = jnp.asarray([256, 0, 131, 9], jnp.int32)
    walk = partial(fa.flash_decode_attention, block_k=64, stages=3, consumers=1)
    out = jax.jit(partial(walk, interpret=not ON_GPU))(q, k, v, lengths)
    ref = _reference(q, k, v, jnp.ones(4, jnp.int32), lengths, causal=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    assert (np.asarray(out)[1] == 0).all()


def test_pallas_decode_takes_the_flash_walk_for_many_rows(monkeypatch):
    """``attention`` under ``KernelOptions(implementation="pallas")`` on a one-token step: the
    flash walk once rows x kv heads reach ``flash_decode_min_programs``, with a causal mask
    whose query sits before its row's end (the walk then stops at the query); split-K below
    it."""
    from spark_jax.ops import attention as att
    from spark_jax.ops.reference import AttentionMask, reference_attention

    q, k, v = _inputs(6, 2, 1, 128, 4, 2, 64, jnp.float32)
    lengths, positions = jnp.asarray([128, 70], jnp.int32), jnp.asarray([[100], [69]], jnp.int32)
    mask = AttentionMask(positions, lengths, causal=True)
    ref = reference_attention(q, k, v, mask)
    walked = []
    flash = fa.flash_decode_attention
    monkeypatch.setattr(
        fa, "flash_decode_attention", lambda *a, **kw: walked.append(1) or flash(*a, **kw)
    )
    for minimum, expected in ((10**6, []), (4, [1])):
        options = KernelOptions(implementation="pallas", flash_decode_min_programs=minimum)
        out = att.attention(q, k, v, mask, options=options)
        assert walked == expected
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("tuning", [{}, {"stages": 3, "consumers": 1}])
def test_flash_decode_on_gpu_matches_the_reference(tuning):
    q, k, v = _inputs(12, 64, 1, 1024, 32, 8, 128, jnp.bfloat16)
    lengths = jnp.asarray(np.random.default_rng(3).integers(0, 1025, 64), jnp.int32)
    out = jax.jit(partial(fa.flash_decode_attention, **tuning))(q, k, v, lengths)
    ref = _reference(q, k, v, jnp.ones(64, jnp.int32), lengths, causal=False)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _relative_error(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU (Hopper)")
@pytest.mark.parametrize("page_size, tuning", [(16, {}), (64, {}), (16, PAGED_WALK)])
def test_paged_flash_decode_on_gpu_matches_the_reference(page_size, tuning):
    """The flash walk over a shuffled page pool, bf16, GQA 32/8: equal to the dense walk's
    reference on the gathered rows (the defaults, and the engine's paged tuning)."""
    b, s = 64, 1024
    q, k, v = _inputs(13, b, 1, s, 32, 8, 128, jnp.bfloat16)
    lengths = jnp.asarray(np.random.default_rng(4).integers(0, s + 1, b), jnp.int32)
    per_row = s // page_size
    order = np.random.default_rng(5).permutation(b * per_row)
    table = jnp.asarray(order.reshape(b, per_row), jnp.int32)
    inverse = jnp.asarray(np.argsort(order))
    k_pool, v_pool = (x.reshape(b * per_row, page_size, 8, 128)[inverse] for x in (k, v))
    run = jax.jit(partial(fa.flash_decode_attention, block_table=table, **tuning))
    out = run(q, k_pool, v_pool, lengths)
    ref = _reference(q, k, v, jnp.ones(b, jnp.int32), lengths, causal=False)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _relative_error(out, ref) <= 1e-2


@pytest.mark.parametrize("tuning", [{}, PAGED_WALK])
def test_paged_flash_decode_matches_the_reference(tuning):
    """The walk over a shuffled pool of 16-key pages (4 per 64-key block), ragged lengths and
    an empty row, with one warpgroup or a producer and 3 slots (the engine's paged tuning)."""
    b, s, page_size = 3, 256, 16
    q, k, v = _inputs(14, b, 1, s, 8, 2, 64, jnp.float32)
    lengths = jnp.asarray([256, 0, 77], jnp.int32)
    per_row = s // page_size
    order = np.random.default_rng(6).permutation(b * per_row)
    table = jnp.asarray(order.reshape(b, per_row), jnp.int32)
    inverse = jnp.asarray(np.argsort(order))
    k_pool, v_pool = (x.reshape(b * per_row, page_size, 2, 64)[inverse] for x in (k, v))
    walk = partial(fa.flash_decode_attention, block_table=table, block_k=64, **tuning)
    out = jax.jit(partial(walk, interpret=not ON_GPU))(q, k_pool, v_pool, lengths)
    ref = _reference(q, k, v, jnp.ones(b, jnp.int32), lengths, causal=False)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_prefill_tuning_picks_the_measured_fastest_where_it_applies():
    """One persistent program per SM with two ping-pong consumers over 128-key blocks where T
    and S are multiples of 128 at head dim 128 on the GPU (its shared memory fits); the
    defaults in the interpreter and elsewhere (and they apply)."""
    q, k = jnp.zeros((1, 256, 8, 128), jnp.bfloat16), jnp.zeros((1, 384, 2, 128), jnp.bfloat16)
    tuning = fa.prefill_tuning(q, k, interpret=False)
    persistent = {"block_k": 128, "stages": 2, "consumers": 2, "pingpong": True}
    assert tuning == {**persistent, "programs": fa.sm_count()}
    assert fa._shared_bytes(64, 128, 128, 2, 2, True, jnp.bfloat16) <= fa._SMEM_LIMIT
    assert fa.prefill_tuning(q, k, interpret=True) == {}
    assert fa.prefill_tuning(q[:, :192], k, interpret=False) == {}
    assert fa.prefill_tuning(q[..., :64], k[..., :64], interpret=False) == {}
