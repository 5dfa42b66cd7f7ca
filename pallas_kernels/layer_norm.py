"""LayerNorm in one GPU kernel (Pallas, Triton backend): statistics and the affine in one pass.

XLA emits a LayerNorm as two kernels, a reduction for the statistics and an elementwise pass
that applies them (its fusion cannot feed a reduction's result back into the same kernel).
NLLB-600M's decode step has 37 norms over 32 rows of 1024: 74 kernels of ~1.5 us each, for
~2 MB of data in all, launch-bound. Here one program normalises one row: it loads the row
once, computes E[x] and E[x^2] in fp32 (the one-pass form of ``spark_jax.ops.layers.layer_norm``,
the reference), and writes the scaled, shifted row in the output dtype.

Interpret mode runs the same kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp

from pallas_kernels._mosaic import triton_params

MAX_WIDTH = 16384  # one row in one program's registers


def layer_norm_applies(x: jax.Array) -> bool:
    """True where the kernel runs: a feature width that is a power of two, at most MAX_WIDTH."""
    d = x.shape[-1]
    return x.ndim >= 1 and d & (d - 1) == 0 and 0 < d <= MAX_WIDTH


def layer_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    eps: float,
    out_dtype: jnp.dtype | None = None,
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> jax.Array:
    """LayerNorm of x [..., D] over D with fp32 statistics; the result in ``out_dtype`` (x's)."""
    shape, d = x.shape, x.shape[-1]
    rows = x.reshape(-1, d)
    row = pl.BlockSpec((1, d), lambda i: (i, 0))
    vector = pl.BlockSpec((d,), lambda i: (0,))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(rows.shape, out_dtype or x.dtype),
        grid=(rows.shape[0],),
        in_specs=[row, vector, vector],
        out_specs=row,
        compiler_params=triton_params(num_warps, 1, interpret),
        interpret=interpret,
        name="layer_norm",
    )(rows, scale, bias)
    return out.reshape(shape)


def _kernel(x_ref, scale_ref, bias_ref, o_ref, *, eps: float):
    x = x_ref[...].astype(jnp.float32)  # [1, D]
    mean = jnp.mean(x, axis=-1, keepdims=True)
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
    var = jnp.maximum(mean_square - mean * mean, 0.0)
    normed = (x - mean) * jax.lax.rsqrt(var + eps)
    scale = scale_ref[...].astype(jnp.float32)[None, :]
    bias = bias_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = (normed * scale + bias).astype(o_ref.dtype)
