"""Weight-only quantization: narrow kernels (fp8 E4M3 or int8) with float scales, and the matmul
that reads them.

A quantized kernel ``q [D, F]`` (our [in, out] layout) holds ``w / scale`` rounded to the
narrow type; ``scale`` is ``[F]`` (one per output channel) or ``[D / g, F]`` (one per group of
``g`` input channels and output channel), so ``w ~= q * scale`` with the scale broadcast over
its inputs. Scales are symmetric: a column's (or group's) largest magnitude maps to the type's
largest finite value (448 for E4M3, 127 for int8).

``quantized_matmul`` computes ``x @ (q * scale)`` with fp32 accumulation. One scale per output
channel factors out of the sum, so the dot reads ``q`` (converted to x's dtype, which holds
every E4M3 and int8 value exactly) and the scale multiplies the fp32 output. On the GPU a
matmul of few rows runs our kernel (``pallas_kernels/quantized_matmul.py``: the same math,
split along the summed axis; ~2.5 TB/s of narrow bytes at one row on the H200, where XLA's
fused GEMM reads ~1.2); elsewhere XLA's GEMM with the convert fused into its operand read.
Group scales vary along the summed axis and cannot factor out; the kernel is dequantized per
group first (again a producer XLA may fuse into the GEMM). The CPU runs the same expressions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quantized_matmul import quantized_matmul as quantized_matmul_kernel
from pallas_kernels.quantized_matmul import (
    quantized_matmul_applies,
    quantized_matmul_reference,
)
from spark_jax.ops.options import KernelOptions

# The narrow type of each scheme and its largest finite value. E4M3 "fn" has no infinity: a
# value past 448 converts to NaN, so scaled weights are clipped first.
NARROW_TYPES = {"fp8": (jnp.float8_e4m3fn, 448.0), "int8": (jnp.int8, 127.0)}


def quantize(
    kernel: jax.Array, weights: str, group_size: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """``kernel [D, F]`` -> (q [D, F] narrow, scale float32 [F] or [D / group_size, F]).

    Computed in fp32 from whatever precision ``kernel`` holds. An all-zero column (or group)
    gets scale 1, so it stays zero and never divides by zero.
    """
    narrow, largest = NARROW_TYPES[weights]
    w = jnp.asarray(kernel, jnp.float32)
    d, f = w.shape
    if group_size is not None and d % group_size:
        raise ValueError(
            f"group_size {group_size} does not divide a kernel's {d} input channels; pick a "
            "divisor of every quantized layer's input size."
        )
    groups = 1 if group_size is None else d // group_size
    wg = w.reshape(groups, d // groups, f)
    amax = jnp.max(jnp.abs(wg), axis=1)  # [G, F]
    scale = jnp.where(amax > 0, amax / largest, 1.0)
    scaled = jnp.clip(wg / scale[:, None, :], -largest, largest)
    if narrow == jnp.int8:
        scaled = jnp.round(scaled)
    q = scaled.astype(narrow).reshape(d, f)
    return q, (scale[0] if group_size is None else scale)


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``q * scale`` as a ``[D, F]`` kernel of ``dtype`` (computed in fp32, rounded once)."""
    d, f = q.shape
    groups = 1 if scale.ndim == 1 else scale.shape[0]
    w = q.astype(jnp.float32).reshape(groups, d // groups, f) * scale.reshape(groups, 1, f)
    return w.reshape(d, f).astype(dtype)


def quantized_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    out_dtype: jnp.dtype,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """``x [..., D] @ (q * scale)`` -> ``[..., F]`` in ``out_dtype``, accumulated in fp32."""
    if scale.ndim == 1:  # per output channel: the scale factors out of the dot
        if (
            options.pallas_quantized_matmul
            and options.implementation != "xla"
            and options.mesh is None
            and jax.default_backend() == "gpu"
            and quantized_matmul_applies(x, q, scale, max_rows=options.quantized_matmul_max_rows)
        ):
            return quantized_matmul_kernel(x, q, scale, out_dtype)
        return quantized_matmul_reference(x, q, scale, out_dtype)
    kernel = dequantize(q, scale, x.dtype)
    return jnp.einsum("...d,df->...f", x, kernel, preferred_element_type=out_dtype)


def is_quantized(kernel: jax.Array) -> bool:
    """True for a kernel held in a narrow type (it then has a ``kernel_scale`` beside it)."""
    return jnp.dtype(kernel.dtype).itemsize == 1
