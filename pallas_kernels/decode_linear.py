"""A decode step's projection in one GPU kernel (Pallas, Triton backend), with the LayerNorm
before it or the residual add after it folded in.

At decode a projection multiplies a few rows (M = 16-128) by a weight matrix, reading the
weights once: XLA runs it as a split-K GEMM writing fp32 partial sums, then a second kernel
sums them with the bias (and the residual); a LayerNorm before it is a third kernel. NLLB-600M's
decoder step is launch-bound (~17 kernels a layer, ~2-5 us each for 2-8 MB of weights), so
here each projection is one kernel: a program owns ``block_n`` output columns and walks the
whole K axis (weights in ``block_k``-row tiles, pipelined ``num_stages`` deep), with

- ``norm=(scale, bias)``: the rows' LayerNorm statistics first (fp32, the one-pass form of
  ``spark_jax.layers.layer_norm_reference``), each x tile normalised on the fly and rounded to
  x's dtype as the unfused LayerNorm's output is;
- the bias added and the result rounded as ``spark_jax.layers.Linear`` does (the product
  rounded to the output dtype, then the bias added); then ``relu``; then ``residual`` added
  (rounded again, as the model's ``x + h``).

Interpret mode runs the same kernel on the CPU. Axes: M rows, K input features, N outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax


def decode_linear_applies(x: jax.Array, kernel: jax.Array) -> bool:
    """True for the kernel's static constraints: rows a power of two from 16 to 128 (the
    tensor-core tile), K and N multiples of 16, x and the weights of one 16-bit or 32-bit
    float dtype (32-bit: the CPU interpreter's tests)."""
    if x.ndim != 2 or kernel.ndim != 2 or x.shape[1] != kernel.shape[0]:
        return False
    m, k = x.shape
    n = kernel.shape[1]
    return (
        m & (m - 1) == 0
        and 16 <= m <= 128
        and k % 16 == 0
        and n % 16 == 0
        and x.dtype == kernel.dtype
    )


def decode_linear_reference(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array,
    norm: tuple[jax.Array, jax.Array] | None = None,
    residual: jax.Array | None = None,
    relu: bool = False,
    eps: float = 1e-5,
) -> jax.Array:
    """The unfused jnp path: ``layer_norm_reference``, ``Linear``'s product and bias, relu,
    the residual add, each rounded where the model rounds."""
    from spark_jax.layers import layer_norm_reference

    dtype = x.dtype
    if norm is not None:
        x = layer_norm_reference(x, norm[0], norm[1], eps, dtype)
    y = jnp.einsum("md,dn->mn", x, kernel, preferred_element_type=dtype)
    y = (y + bias).astype(dtype)
    if relu:
        y = jax.nn.relu(y)
    if residual is not None:
        y = (residual + y).astype(dtype)
    return y


def decode_linear(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array,
    norm: tuple[jax.Array, jax.Array] | None = None,
    residual: jax.Array | None = None,
    relu: bool = False,
    eps: float = 1e-5,
    *,
    block_n: int = 32,
    block_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:
    """``decode_linear_reference`` in one kernel: x [M, K] @ kernel [K, N] + bias [N], with an
    optional LayerNorm of x first, relu, and residual [M, N] added; [M, N] in x's dtype."""
    m, k = x.shape
    n = kernel.shape[1]
    block_n, block_k = _divisor(n, block_n), _divisor(k, block_k)
    columns = lambda rows: pl.BlockSpec((rows, block_n), lambda j: (0, j))
    whole = lambda a: pl.BlockSpec(a.shape, lambda j: (0,) * a.ndim)
    inputs = [x, kernel, bias]
    in_specs = [
        whole(x),
        pl.BlockSpec((k, block_n), lambda j: (0, j)),
        pl.BlockSpec((block_n,), lambda j: (j,)),
    ]
    if norm is not None:
        inputs += list(norm)
        in_specs += [whole(norm[0]), whole(norm[1])]
    if residual is not None:
        inputs.append(residual)
        in_specs.append(columns(m))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plt

        compiler_params = plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(
            _kernel,
            block_k=block_k,
            eps=eps,
            norm=norm is not None,
            residual=residual is not None,
            relu=relu,
        ),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(n // block_n,),
        in_specs=in_specs,
        out_specs=columns(m),
        compiler_params=compiler_params,
        interpret=interpret,
        name="decode_linear",
    )(*inputs)


def _divisor(size: int, tile: int) -> int:
    """The largest power-of-two fraction of ``tile`` that divides ``size``."""
    tile = min(tile, size)
    while size % tile:
        tile //= 2
    return tile


def _kernel(x_ref, w_ref, b_ref, *rest, block_k, eps, norm, residual, relu):
    refs = list(rest)
    o_ref = refs.pop()
    scale_ref, shift_ref = (refs.pop(0), refs.pop(0)) if norm else (None, None)
    r_ref = refs.pop(0) if residual else None
    m, k = x_ref.shape
    dtype = x_ref.dtype
    steps = k // block_k

    def tile(i):
        return pl.ds(pl.multiple_of(i * block_k, block_k), block_k)

    if norm:

        def moments(i, sums):
            xs = x_ref[:, tile(i)].astype(jnp.float32)
            return sums[0] + jnp.sum(xs, axis=1), sums[1] + jnp.sum(xs * xs, axis=1)

        zero = jnp.zeros((m,), jnp.float32)
        total, total_square = lax.fori_loop(0, steps, moments, (zero, zero))
        mean = total / k
        var = jnp.maximum(total_square / k - mean * mean, 0.0)
        rstd = lax.rsqrt(var + eps)

    def product(i, acc):
        xs = x_ref[:, tile(i)]
        if norm:
            normed = (xs.astype(jnp.float32) - mean[:, None]) * rstd[:, None]
            scale = scale_ref[tile(i)].astype(jnp.float32)
            shift = shift_ref[tile(i)].astype(jnp.float32)
            xs = (normed * scale[None, :] + shift[None, :]).astype(dtype)
        return acc + jnp.dot(xs, w_ref[tile(i), :], preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, steps, product, jnp.zeros((m, w_ref.shape[1]), jnp.float32))
    y = acc.astype(dtype).astype(jnp.float32) + b_ref[...].astype(jnp.float32)[None, :]
    y = y.astype(dtype)
    if relu:
        y = jnp.maximum(y, 0)
    if residual:
        y = (r_ref[...].astype(jnp.float32) + y.astype(jnp.float32)).astype(dtype)
    o_ref[...] = y
