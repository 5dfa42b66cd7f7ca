"""The one-query MHA kernel (``pallas_kernels/one_query_attention.py``) against its reference,
in interpret mode on CPU (compiled on the GPU), its dispatch, and NLLB's decode step through it.

The reference is built independently of the kernel from ``reference_attention`` over the rows
a row table names (with the new key scattered in first), so a wrong block walk, mask, write
position or table read shows up as a mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import one_query_attention as oq
from spark_jax.ops import attention as att
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask

ON_GPU = jax.default_backend() == "gpu"


def _inputs(seed, b, s, n, h, dtype):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    return (
        draw(b, 1, n, h),
        draw(b, s, n, h),
        draw(b, s, n, h),
        draw(b, 1, n, h),
        draw(b, 1, n, h),
        rng,
    )


def _relative_error(out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("append", [False, True])
@pytest.mark.parametrize("with_table", [False, True])
@pytest.mark.parametrize(
    "heads_per_program, block_keys", [(4, 16), (2, 32), (8, 16)]
)  # whole rows' heads, pairs; blocks that split 48 positions and that do not
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_kernel_matches_its_reference(
    append, with_table, heads_per_program, block_keys, dtype, tolerance
):
    b, s, n, h = 5, 64, 8, 32
    q, k, v, k_new, v_new, rng = _inputs(0, b, s, n, h, dtype)
    # An empty row (append only), lengths inside a block, on a block edge, one short of full
    # and full (the new key's write is dropped there).
    lengths = jnp.asarray([0 if append else 1, 7, 32, 63, 64 if append else 50], jnp.int32)
    table = None
    if with_table:
        # Any rows, except the position another row writes in the same call (the kernel's
        # contract: beams of one request share their length, so none reads what one writes).
        table = rng.integers(0, b, (b, s))
        written = np.arange(s)[None, :] == np.asarray(lengths)[table]
        table = jnp.asarray(np.where(written, np.arange(b)[:, None], table), jnp.int32)
    news = (k_new, v_new) if append else (None, None)
    ref = oq.one_query_attention_reference(q, k, v, lengths, *news, table)
    out = jax.jit(
        lambda *a: oq.one_query_attention(
            *a,
            heads_per_program=heads_per_program,
            block_keys=block_keys,
            interpret=not ON_GPU,
        )
    )(q, jnp.array(k), jnp.array(v), lengths, *news, table)
    assert _relative_error(out[0], ref[0]) <= tolerance
    if append:
        # The caches came back with exactly the new keys written: compare whole buffers.
        np.testing.assert_array_equal(
            np.asarray(out[1], np.float32), np.asarray(ref[1], np.float32)
        )
        np.testing.assert_array_equal(
            np.asarray(out[2], np.float32), np.asarray(ref[2], np.float32)
        )
        assert not np.array_equal(np.asarray(out[1]), np.asarray(k))  # something was written
    else:
        assert out[1] is None and out[2] is None


def test_tunings_that_do_not_divide_the_shape_fall_back_to_divisors():
    # 6 heads, 4 a program -> 2; 80 positions, 64-key blocks -> 16 (lengths past 64 included).
    q, k, v, *_ = _inputs(1, 2, 80, 6, 16, jnp.float32)
    lengths = jnp.asarray([3, 71])
    out = oq.one_query_attention(
        q, k, v, lengths, heads_per_program=4, block_keys=64, interpret=True
    )[0]
    ref = oq.one_query_attention_reference(q, k, v, lengths)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_applies_only_to_one_query_mha_steps():
    q, k, *_ = _inputs(2, 2, 32, 4, 16, jnp.float32)
    assert oq.one_query_attention_applies(q, k)
    assert not oq.one_query_attention_applies(q, k[:, :, :2])  # GQA: shared key heads
    assert not oq.one_query_attention_applies(jnp.tile(q, (1, 2, 1, 1)), k)  # two queries
    assert not oq.one_query_attention_applies(q, k[:, :24])  # 24 positions: not a multiple of 16
    assert not oq.one_query_attention_applies(q, k.astype(jnp.bfloat16))  # mixed dtypes


def test_dispatch_takes_the_kernel_where_picked_and_nowhere_else():
    q, k, *_ = _inputs(3, 2, 32, 4, 16, jnp.bfloat16)
    pallas, cudnn, xla = (KernelOptions(implementation=i) for i in ("pallas", "cudnn", "xla"))
    long_cache = jnp.zeros((2, 2 * pallas.one_query_max_keys, 4, 16), jnp.bfloat16)
    assert att.one_query_picked(q, k, None, pallas)
    assert not att.one_query_picked(q, long_cache, None, pallas)  # the split kernels' regime
    assert att.one_query_picked(  # unless the options raise the limit
        q, long_cache, None, KernelOptions(implementation="pallas", one_query_max_keys=512)
    )
    assert not att.one_query_picked(q, k, 8, pallas)  # a sliding window
    assert not att.one_query_picked(q, k, None, cudnn)
    assert not att.one_query_picked(q, k, None, xla)
    # The default takes it on a GPU for bf16/f16 only; fp32 (and every CPU run) keeps XLA.
    assert att.one_query_picked(q, k, None) == ON_GPU
    q32, k32 = q.astype(jnp.float32), k.astype(jnp.float32)
    assert not att.one_query_picked(q32, k32, None)
    assert att.one_query_picked(q32, k32, None, pallas) == (not ON_GPU)  # interpreted: any float


@pytest.mark.parametrize("with_table", [False, True])
def test_cache_step_attention_is_the_same_step_either_way(with_table):
    """The fused step (``implementation="pallas"``) against write + XLA attention: the
    same output for every row whose mask shows its new key, the same caches everywhere."""
    b, s, n, h = 4, 32, 4, 16
    q, k_cache, v_cache, k, v, rng = _inputs(4, b, s, n, h, jnp.float32)
    lengths = jnp.asarray([0, 5, 16, 31], jnp.int32)
    positions = lengths[:, None]
    mask = AttentionMask(positions, lengths + 1)
    table = None
    if with_table:  # rows 2 and 3 share row 2's history, as two beams of one request do
        table = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, s))
        table = table.at[3, :16].set(2)
        lengths = lengths.at[3].set(16)
        positions, mask = lengths[:, None], AttentionMask(lengths[:, None], lengths + 1)
    step = lambda options: att.cache_step_attention(
        q, k, v, k_cache, v_cache, None, positions, mask, table, options=options
    )
    # The same step from a fused projection's output: q, k, v side by side, read in place.
    qkv = jnp.concatenate([q, k, v], axis=2)
    packed = lambda options: att.packed_cache_step_attention(
        qkv, k_cache, v_cache, None, positions, mask, table, options=options
    )
    step, packed = jax.jit(step, static_argnums=0), jax.jit(packed, static_argnums=0)
    xla, pallas = KernelOptions(implementation="xla"), KernelOptions(implementation="pallas")
    plain, plain_packed = step(xla), packed(xla)
    fused, fused_packed = step(pallas), packed(pallas)
    for other in (fused, fused_packed, plain_packed):
        assert _relative_error(other[0], plain[0]) <= 1e-5
        for got, want in zip(other[1:], plain[1:], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nllb_decode_steps_through_the_kernel_match_the_plain_steps():
    """NLLB's decode step with the kernel (interpreted) against the plain step: beam-like
    reorders between steps, rows moved (no table) or read through the row table."""
    from helpers import ours, random_sources, tiny_hf

    from spark_jax.models import nllb

    runner = ours(tiny_hf(decoder_layers=2))
    sources = random_sources(5, 4, max_len=12)
    source_rows = jnp.asarray([1, 1, 3, 2], jnp.int32)  # rows 0-1 follow row 1, 2-3 swap
    runs = {}
    for name, row_table, forced in [
        ("moved", False, None),
        ("table", True, None),
        ("table_kernel", True, "pallas"),
        ("moved_kernel", False, "pallas"),
    ]:
        state = runner.init_state(4, 16, 16, row_table=row_table)
        logits, state = runner.prefill(state, range(4), sources)
        options = KernelOptions(implementation=forced)
        outs = []
        for _ in range(4):
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, state = nllb.decode(
                runner.params, runner.config, tokens, jnp.ones(4, bool), state, options=options
            )
            outs.append(np.asarray(logits))
            state = state.gather_rows(source_rows, False)
        runs[name] = np.stack(outs)
    for name in ("table", "table_kernel", "moved_kernel"):
        assert _relative_error(runs[name], runs["moved"]) <= 1e-5, name


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_nllb_bf16_decode_on_the_gpu_matches_the_plain_xla_step():
    """bf16, NLLB-like shapes (16 heads of 64): the default GPU step (one-query kernel, our
    LayerNorm) against the plain one (XLA attention and LayerNorm), rows read through a row
    table and reordered between steps, both fed the same tokens: logits within bf16 rounding,
    the same argmax except near-ties (top-2 gap < 1e-2)."""
    from spark_jax.config import config_from_hf
    from spark_jax.models import nllb

    config = config_from_hf(
        dict(
            model_type="m2m_100",
            vocab_size=512,
            d_model=1024,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=16,
            decoder_attention_heads=16,
            encoder_ffn_dim=512,
            decoder_ffn_dim=512,
            max_position_embeddings=128,
        )
    )
    params = nllb.init_params(config, jax.random.key(0), jnp.bfloat16)
    rng = np.random.default_rng(0)
    sources = [[4, *rng.integers(5, 400, n).tolist(), 2] for n in (5, 20, 11, 30)]
    source_rows = jnp.asarray([1, 1, 3, 2], jnp.int32)
    runs, fed = {}, []  # both runs are fed the plain run's picks: a near-tie cannot cascade
    plain_options = KernelOptions(implementation="xla", pallas_layer_norm=False)
    for name, options in [("plain", plain_options), ("default", KernelOptions())]:
        runner = nllb.NllbRunner(config, params, {"fra_Latn": 500}, "fra_Latn", options=options)
        state = runner.init_state(4, 32, 32, row_table=True)
        logits, state = runner.prefill(state, range(4), sources)
        outs = []
        for step in range(6):
            if name == "plain":
                fed.append(jnp.argmax(logits, axis=-1).astype(jnp.int32))
            logits, state = runner.decode(state, fed[step], jnp.ones(4, bool))
            outs.append(np.asarray(logits, np.float32))
            state = state.gather_rows(source_rows, False)
        runs[name] = np.stack(outs)
    plain, default = runs["plain"], runs["default"]
    assert _relative_error(default, plain) <= 1e-2
    top2 = np.sort(plain, axis=-1)[..., -2:]
    differ = np.argmax(default, -1) != np.argmax(plain, -1)
    assert np.all(top2[..., 1] - top2[..., 0] < 1e-2, where=differ)
