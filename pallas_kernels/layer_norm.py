"""LayerNorm in one GPU kernel (Pallas, Triton backend): statistics and the affine in one pass.

XLA emits a LayerNorm as two kernels, a reduction for the statistics and an elementwise pass
that applies them (its fusion cannot feed a reduction's result back into the same kernel).
NLLB-600M's decode step has 37 norms over 32 rows of 1024: 74 kernels of ~1.5 us each, for
~2 MB of data in all, launch-bound. Here one program normalises one row: it loads the row
once, computes E[x] and E[x^2] in fp32 (the one-pass form of ``spark_jax.layers.layer_norm``,
the reference), and writes the scaled, shifted row in the output dtype.

Interpret mode runs the same kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp

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
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    row = pl.BlockSpec((1, d), lambda i: (i, 0))
    vector = pl.BlockSpec((d,), lambda i: (0,))
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(rows.shape, out_dtype or x.dtype),
        grid=(rows.shape[0],),
        in_specs=[row, vector, vector],
        out_specs=row,
        compiler_params=compiler_params,
        interpret=interpret,
        name="layer_norm",
    )(rows, scale, bias)
    return out.reshape(shape)


def _kernel(x_ref, scale_ref, bias_ref, o_ref, *, eps: float):
    o_ref[...] = _normalize(x_ref[...], scale_ref, bias_ref, eps).astype(o_ref.dtype)


def _normalize(x: jax.Array, scale_ref, bias_ref, eps: float) -> jax.Array:
    """LayerNorm of rows x [1, D] in fp32 (one-pass statistics)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
    var = jnp.maximum(mean_square - mean * mean, 0.0)
    normed = (x - mean) * jax.lax.rsqrt(var + eps)
    scale = scale_ref[...].astype(jnp.float32)[None, :]
    return normed * scale + bias_ref[...].astype(jnp.float32)[None, :]


def residual_layer_norm(
    partials: jax.Array,
    bias: jax.Array | None,
    residual: jax.Array,
    scale: jax.Array,
    norm_bias: jax.Array,
    eps: float,
    out_dtype: jnp.dtype | None = None,
    *,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """A residual add and the LayerNorm after it, fed by a projection's split-K partials.

    partials fp32 [S, ..., D]: the projection's products over S slices of its inner dim, not
    yet summed; ``bias`` [D] (or None) its bias; ``residual`` [..., D]. Returns ``total`` =
    residual + sum(partials) + bias in the residual's dtype (rounded once) and the LayerNorm
    of ``total`` in ``out_dtype``. One kernel for what XLA runs as two (the split-K
    reduction with the bias and residual, then the norm): a program sums one row's partials.
    """
    d = residual.shape[-1]
    rows = residual.reshape(-1, d)
    splits = partials.shape[0]
    partials = partials.reshape(splits, rows.shape[0], d)
    bias = jnp.zeros((d,), jnp.float32) if bias is None else bias
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    row = pl.BlockSpec((1, d), lambda i: (i, 0))
    vector = pl.BlockSpec((d,), lambda i: (0,))
    total, normed = pl.pallas_call(
        functools.partial(_residual_kernel, eps=eps),
        out_shape=(
            jax.ShapeDtypeStruct(rows.shape, residual.dtype),
            jax.ShapeDtypeStruct(rows.shape, out_dtype or residual.dtype),
        ),
        grid=(rows.shape[0],),
        in_specs=[pl.BlockSpec((splits, 1, d), lambda i: (0, i, 0)), vector, row, vector, vector],
        out_specs=(row, row),
        compiler_params=compiler_params,
        interpret=interpret,
        name="residual_layer_norm",
    )(partials, bias, rows, scale, norm_bias)
    return total.reshape(residual.shape), normed.reshape(residual.shape)


def _residual_kernel(p_ref, b_ref, r_ref, scale_ref, bias_ref, total_ref, o_ref, *, eps: float):
    summed = jnp.sum(p_ref[...], axis=0) + b_ref[...].astype(jnp.float32)[None, :]  # [1, D]
    total = (summed + r_ref[...].astype(jnp.float32)).astype(total_ref.dtype)
    total_ref[...] = total
    # The norm reads the rounded sum, as a norm of the stored residual stream would.
    o_ref[...] = _normalize(total, scale_ref, bias_ref, eps).astype(o_ref.dtype)
