"""The one-kernel LayerNorm (``pallas_kernels/layer_norm.py``) against the jnp reference, in
interpret mode on CPU (compiled on the GPU), and the dispatch of ``spark_jax.ops.layers``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import layer_norm as ln
from spark_jax.ops import layers
from spark_jax.ops.options import KernelOptions

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
    module = layers.LayerNorm(1e-5, jnp.float32, KernelOptions(pallas_layer_norm=False))
    np.testing.assert_array_equal(module.apply(params, x), ref)
