"""The one-kernel LayerNorm (``pallas_kernels/layer_norm.py``) against the jnp reference, in
interpret mode on CPU (compiled on the GPU), and the dispatch of ``spark_jax.layers``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layer_norm as ln
from spark_jax import layers

ON_GPU = jax.default_backend() == "gpu"


def _inputs(seed, shape, dtype):
    rng = np.random.default_rng(seed)
    d = shape[-1]
    # An offset mean and uneven channels: the statistics must not be those of N(0, 1).
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3.0, d) + 2.0
    scale, bias = rng.normal(1.0, 0.2, d), rng.normal(0.0, 0.2, d)
    return (jnp.asarray(a, dtype) for a in (x, scale, bias))


@pytest.mark.parametrize("shape", [(3, 5, 64), (7, 1024), (1, 16)])
@pytest.mark.parametrize(
    "dtype, out_dtype, tolerance",
    [(jnp.float32, jnp.float32, 1e-5), (jnp.bfloat16, jnp.bfloat16, 1e-2)],
)
def test_kernel_matches_the_reference(shape, dtype, out_dtype, tolerance):
    x, scale, bias = _inputs(0, shape, dtype)
    ref = layers.layer_norm_reference(x, scale, bias, 1e-5, out_dtype)
    out = jax.jit(lambda *a: ln.layer_norm(*a, 1e-5, out_dtype, interpret=not ON_GPU))(
        x, scale, bias
    )
    assert out.shape == shape and out.dtype == out_dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= tolerance


def test_applies_to_power_of_two_widths_only():
    assert ln.layer_norm_applies(jnp.zeros((2, 1024)))
    assert not ln.layer_norm_applies(jnp.zeros((2, 48)))
    assert not ln.layer_norm_applies(jnp.zeros((2, 2 * ln.MAX_WIDTH)))


def test_dispatch_keeps_the_reference_off_the_gpu_and_for_fp32():
    x, scale, bias = _inputs(1, (4, 64), jnp.float32)
    ref = layers.layer_norm_reference(x, scale, bias, 1e-5, jnp.float32)
    np.testing.assert_array_equal(layers.layer_norm(x, scale, bias, 1e-5, jnp.float32), ref)
    module = layers.LayerNorm(1e-5, jnp.float32)
    params = {"params": {"scale": scale, "bias": bias}}
    np.testing.assert_array_equal(module.apply(params, x), ref)


@pytest.mark.parametrize("shape, splits", [((3, 5, 64), 4), ((7, 1024), 8), ((1, 1, 128), 8)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_residual_kernel_matches_the_reference(shape, splits, with_bias, dtype, tolerance):
    """Split-K partials + bias + residual, then the norm: both outputs against the jnp form."""
    x, scale, bias = _inputs(2, shape, dtype)
    rng = np.random.default_rng(3)
    partials = jnp.asarray(rng.standard_normal((splits, *shape)), jnp.float32)
    add = layers.UnreducedSum(partials, bias if with_bias else None)
    ref = layers.residual_layer_norm_reference(x, add, scale, bias, 1e-5, dtype)
    out = jax.jit(
        lambda x, p, b, s, nb: ln.residual_layer_norm(
            p, b, x, s, nb, 1e-5, dtype, interpret=not ON_GPU
        )
    )(x, partials, add.bias, scale, bias)
    for got, want in zip(out, ref, strict=True):
        assert got.shape == shape and got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tolerance


def test_layer_norm_add_is_the_residual_stream_and_its_norm():
    x, scale, bias = _inputs(4, (4, 64), jnp.float32)
    h = jnp.asarray(np.random.default_rng(5).standard_normal((4, 64)), jnp.float32)
    module = layers.LayerNorm(1e-5, jnp.float32)
    params = {"params": {"scale": scale, "bias": bias}}
    total, normed = module.apply(params, x, h)
    np.testing.assert_array_equal(total, x + h)
    np.testing.assert_array_equal(normed, module.apply(params, x + h))


def test_nllb_decode_with_split_k_residual_norms_matches_the_plain_step(monkeypatch):
    """The GPU path forced on the CPU (the kernel interpreted): every decoder layer's attention
    outputs come back as split-K partials and the next norm sums them. Logits of four decode
    steps against the plain step's, fp32."""
    from spark_jax.config import config_from_hf
    from spark_jax.models import nllb

    config = config_from_hf(
        dict(
            model_type="m2m_100",
            vocab_size=256,
            d_model=128,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
        )
    )
    params = nllb.init_params(config, jax.random.key(1), jnp.float32)
    runner = nllb.NllbRunner(config, params, {"fra_Latn": 250}, "fra_Latn")
    rng = np.random.default_rng(6)
    sources = [[4, *rng.integers(5, 200, n).tolist(), 2] for n in (3, 9, 6)]
    fused_calls = []
    kernel = layers.residual_layer_norm

    def counted(*args):
        fused_calls.append(1)
        return kernel(*args)

    runs = {}
    for name in ("plain", "fused"):
        if name == "fused":
            monkeypatch.setattr(layers, "fused_residual_norm_applies", lambda x, f: True)
            monkeypatch.setattr(layers, "residual_layer_norm", counted)
            jax.clear_caches()  # the choice is made at trace time
        state = runner.init_state(3, 16, 16)
        logits, state = runner.prefill(state, range(3), sources)
        decode = jax.jit(nllb.decode.__wrapped__, static_argnames="config")
        outs = []
        for _ in range(4):
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            logits, state = decode(runner.params, runner.config, tokens, jnp.ones(3, bool), state)
            outs.append(np.asarray(logits))
        runs[name] = np.stack(outs)
    jax.clear_caches()
    assert fused_calls  # the decode step was traced through the fused norms
    error = np.linalg.norm(runs["fused"] - runs["plain"]) / np.linalg.norm(runs["plain"])
    assert error <= 1e-5
