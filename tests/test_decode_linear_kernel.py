"""The fused decode projection (``pallas_kernels/decode_linear.py``) against the unfused jnp
path, in interpret mode on CPU (compiled on the GPU): LayerNorm first, bias, relu, residual."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import decode_linear as dl

ON_GPU = jax.default_backend() == "gpu"


def _inputs(seed, m, k, n, dtype):
    rng = np.random.default_rng(seed)
    draw = lambda *shape, loc=0.0, std=1.0: jnp.asarray(rng.normal(loc, std, shape), dtype)
    # Rows with an offset mean: the LayerNorm's statistics must not be those of N(0, 1).
    x = draw(m, k, loc=1.5, std=2.0)
    return (
        x,
        draw(k, n, std=0.1),
        draw(n, std=0.1),
        draw(m, n),
        (draw(k, loc=1.0, std=0.1), draw(k, std=0.1)),
    )


@pytest.mark.parametrize("m, k, n", [(16, 64, 48), (32, 256, 128), (128, 512, 96)])
@pytest.mark.parametrize(
    "form", ["plain", "norm", "residual", "norm_relu"]
)  # the four projections of a decoder layer: qkv/q/fc1 take a norm, out/fc2 a residual
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_kernel_matches_the_unfused_path(m, k, n, form, dtype, tolerance):
    x, w, b, residual, norm = _inputs(0, m, k, n, dtype)
    kwargs = {
        "plain": {},
        "norm": {"norm": norm},
        "residual": {"residual": residual},
        "norm_relu": {"norm": norm, "relu": True},
    }[form]
    ref = dl.decode_linear_reference(x, w, b, **kwargs)
    run = lambda *a: dl.decode_linear(*a, **kwargs, block_n=32, block_k=64, interpret=not ON_GPU)
    out = jax.jit(run)(x, w, b)
    assert out.shape == (m, n) and out.dtype == dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= tolerance
    if form == "norm_relu":
        assert (out >= 0).all() and (out == 0).any()


def test_applies_to_decode_shapes_only():
    x, w, *_ = _inputs(1, 32, 64, 48, jnp.float32)
    assert dl.decode_linear_applies(x, w)
    assert not dl.decode_linear_applies(x[:24], w)  # 24 rows: not a power of two
    assert not dl.decode_linear_applies(x[:8], w)  # under the 16-row tile
    assert not dl.decode_linear_applies(jnp.tile(x, (8, 1)), w)  # 256 rows: a prefill's
    assert not dl.decode_linear_applies(x, w[:, :40])  # N not a multiple of 16
    assert not dl.decode_linear_applies(x, w.astype(jnp.bfloat16))  # mixed dtypes


def test_tiles_shrink_to_divisors_of_the_shape():
    x, w, b, *_ = _inputs(2, 16, 48, 80, jnp.float32)
    out = dl.decode_linear(x, w, b, block_n=64, block_k=32, interpret=True)  # -> 16 x 16
    ref = dl.decode_linear_reference(x, w, b)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
