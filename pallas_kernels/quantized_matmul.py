"""Weight-only quantized matmul on the GPU (Pallas, Triton backend): ``x @ (q * scale)`` with
the narrow weights (fp8 E4M3 or int8) read once and widened in registers.

A decode step reads every weight once, so a narrow weight halves its bytes only if the matmul
reads the narrow bytes at the copy ceiling. XLA fuses the convert into its Triton GEMM, but at
one or a few rows that GEMM tiles the output columns alone and reaches ~1.2 TB/s on the H200
(``benchmarks/NOTES.md``). Here the summed axis is split as well: program (j, s) takes
``block_n`` output columns and the s-th of ``splits`` slices of the inputs, walks that slice in
blocks of ``block_k`` rows of ``q`` (each a coalesced ``[block_k, block_n]`` tile of bytes),
widens each tile to x's dtype in registers and accumulates in fp32; the ``splits`` partial
sums ``[splits, M, F]`` are added, scaled per output channel and rounded after the kernel
(one small fusion). With one row the products are a multiply and a column sum per tile on the
CUDA cores; with more, the widened tile feeds the tensor cores (``jnp.dot``; rows padded to
16). Measured on the H200 (``benchmarks/NOTES.md``): the kernel reads ~2 TB/s of narrow bytes,
not yet the ceiling; widening by integer operations instead of conversions was no faster, so
the conversions are not what bounds it.

The scale is one per output channel, so it factors out of the sum: the kernel never sees it.
``quantized_matmul_reference`` is the same math in jnp (the CPU's path and the tests' oracle).

Axes: M rows of x, D inputs, F outputs, S splits of D.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import triton_params

NARROW_DTYPES = (jnp.float8_e4m3fn, jnp.int8)
MIN_DOT_ROWS = 16  # Triton's smallest tensor-core tile


def quantized_matmul_reference(
    x: jax.Array, q: jax.Array, scale: jax.Array, out_dtype: jnp.dtype
) -> jax.Array:
    """``x [..., D] @ (q [D, F] * scale [F])`` in jnp, accumulated in fp32."""
    y = jnp.einsum("...d,df->...f", x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (y * scale.astype(jnp.float32)).astype(out_dtype)


def _rows(m: int) -> int:
    """Rows a program computes: one (CUDA cores), else the power of two >= max(m, 16)."""
    return 1 if m == 1 else max(MIN_DOT_ROWS, 1 << (m - 1).bit_length())


SMALLEST_BLOCK = 64  # D and F must be multiples of it


def _block(size: int, largest: int) -> int:
    """The largest power-of-two block up to ``largest`` that divides ``size``."""
    block = largest
    while size % block:
        block //= 2
    return block


def quantized_matmul_applies(
    x: jax.Array, q: jax.Array, scale: jax.Array, *, max_rows: int = 16
) -> bool:
    """True where the kernel's static constraints hold: a narrow ``q [D, F]`` with one scale
    per output channel, x of a half dtype with at most ``max_rows`` rows (at 64 rows XLA's
    GEMM measured faster), and D, F multiples of 64."""
    if q.ndim != 2 or scale.shape != (q.shape[1],) or q.dtype not in NARROW_DTYPES:
        return False
    d, f = q.shape
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    return (
        x.shape[-1] == d
        and x.dtype in (jnp.bfloat16, jnp.float16)
        and 1 <= rows <= max_rows
        and d % SMALLEST_BLOCK == 0
        and f % SMALLEST_BLOCK == 0
    )


def _splits(d: int, f: int, rows: int, block_n: int, block_k: int, programs: int) -> int:
    """The most splits of D (a power of two, each at least one block) up to ``programs``
    programs in all; one split when the columns alone give that many."""
    splits = 1
    while (
        (f // block_n) * splits * 2 <= programs
        and d % (block_k * splits * 2) == 0
        and 4 * rows * splits * 2 <= d // 4  # partial sums under 1/4 of q's bytes
    ):
        splits *= 2
    return splits


def quantized_matmul(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    out_dtype: jnp.dtype,
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    programs: int = 528,
    num_warps: int = 4,
    num_stages: int = 4,
    splits: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``x [..., D] @ (q [D, F] * scale [F])`` -> ``[..., F]`` in ``out_dtype``.

    ``programs``: the grid is split along D until it has about this many programs (4 per SM of
    an H200), or into ``splits``; ``block_n`` (None: up to 128 columns up to 16 rows, else 64)
    / ``block_k`` (None: up to 256 inputs for one row, else 64; each the largest that divides
    F or D) / ``num_warps`` / ``num_stages``: the tile and Triton's launch and pipelining, the
    fastest measured on the H200 (``benchmarks/NOTES.md``). ``interpret`` runs the kernel on
    the CPU (tests).
    """
    lead = x.shape[:-1]
    d, f = q.shape
    x2 = x.reshape(-1, d)
    m = x2.shape[0]
    rows = _rows(m)
    block_n = block_n or _block(f, 128 if rows <= MIN_DOT_ROWS else 64)
    block_k = block_k or _block(d, 256 if rows == 1 else 64)
    if rows != m:
        x2 = jnp.pad(x2, ((0, rows - m), (0, 0)))
    splits = splits or _splits(d, f, rows, block_n, block_k, programs)
    chunk = d // splits
    kernel = functools.partial(_kernel, block_k=block_k, steps=chunk // block_k)
    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, rows, f), jnp.float32),
        grid=(f // block_n, splits),
        in_specs=[
            pl.BlockSpec((rows, chunk), lambda j, s: (0, s)),
            pl.BlockSpec((chunk, block_n), lambda j, s: (s, j)),
        ],
        out_specs=pl.BlockSpec((None, rows, block_n), lambda j, s: (s, 0, j)),
        compiler_params=triton_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="quantized_matmul",
    )(x2, q)
    y = jnp.sum(partial, axis=0)[:m] * scale.astype(jnp.float32)
    return y.astype(out_dtype).reshape(*lead, f)


def _kernel(x_ref, q_ref, o_ref, *, block_k: int, steps: int):
    rows, block_n = x_ref.shape[0], q_ref.shape[1]

    def step(i, acc):
        inputs = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        xs = x_ref[:, inputs]  # [rows, block_k]
        if rows == 1:  # a multiply and a column sum on the CUDA cores
            w = q_ref[inputs, :].astype(jnp.float32)
            return acc + jnp.sum(xs.astype(jnp.float32).reshape(block_k, 1) * w, axis=0)[None]
        w = q_ref[inputs, :].astype(xs.dtype)  # [block_k, block_n], widened in registers
        return acc + jnp.dot(xs, w, preferred_element_type=jnp.float32)

    o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros((rows, block_n), jnp.float32))
