"""What the kernels of this package share: Mosaic GPU layout helpers, the interpreter's
differences, the per-configuration kernel sharing, the Triton backend's parameters, and a
small jnp attention reference.

The package imports nothing from ``spark_jax``: each kernel's jnp reference is built from
``reference_attention`` here, the same fp32 softmax as ``spark_jax.ops.reference``.

Interpret mode runs a kernel in Mosaic GPU's CPU interpreter (``InterpretGPUParams``). Two
things differ there, both layout-only, in ``transposed_keys`` and ``with_layout``: jax 0.10.2's
interpreter neither takes a transposed wgmma operand nor knows ``layout_cast``, so K^T is
materialised in shared memory and register layouts are skipped.

Axes: B batch, T query tokens, S key slots, N query heads, K kv heads, G = N / K, H head dim,
W block-table width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

MASKED = -1e30  # finite, so a fully masked row gives a uniform softmax (or zeros), never NaN


# -------------------------------------------------------------------------------------------
# The jnp reference of the kernels' references.


def visible_keys(
    query_positions: jax.Array, key_lengths: jax.Array, num_keys: int, causal: bool
) -> jax.Array:
    """bool[B, T, S]: key s visible to query t of row b when s < key_lengths[b] and, if
    ``causal``, s <= query_positions[b, t]."""
    keys = jnp.arange(num_keys)[None, None, :]
    visible = keys < key_lengths[:, None, None]
    if causal:
        visible &= keys <= query_positions[:, :, None]
    return visible


def reference_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float | None = None
) -> jax.Array:
    """Softmax attention in fp32: q [B,T,N,H], k/v [B,S,K,H], visible bool[B,T,S] ->
    [B,T,N,H] in q's dtype. A row with no visible key gets the uniform softmax over S."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(visible[:, None, None, :, :], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype)


def gather_rows(cache: jax.Array, row_table: jax.Array) -> jax.Array:
    """``[B, S, K, H]``: position t of row b read from cache row ``row_table[b, t]``."""
    positions = jnp.arange(cache.shape[1])[None, :]
    return cache[row_table, positions]


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """Each row's pages ``[P, page_size, K, H]`` laid out as ``[B, W * page_size, K, H]``;
    entries a row does not own (out of range) read as some other page (clipped)."""
    b, width = block_table.shape
    rows = jnp.take(pages, block_table.reshape(-1), axis=0, mode="clip")
    return rows.reshape(b, width * pages.shape[1], *pages.shape[2:])


# -------------------------------------------------------------------------------------------
# Shapes and block tables.


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def chunked_table(block_table: jax.Array, num_pages: int, pages_per_chunk: int) -> jax.Array:
    """int32[B, W] -> int32[B, C * pages_per_chunk]: whole chunks, every entry a page.

    A program copies whole chunks, so entries a row does not own (and the padding) become the
    row's first page: in range, the row's own, and past its length, so masked. (TMA would
    zero-fill an out-of-range page on the GPU, but the interpreter has no out-of-range reads.)
    """
    padding = round_up(block_table.shape[1], pages_per_chunk) - block_table.shape[1]
    table = jnp.pad(
        block_table.astype(jnp.int32), ((0, 0), (0, padding)), constant_values=num_pages
    )
    first = jnp.where(table[:, :1] < num_pages, table[:, :1], 0)
    return jnp.where(table < num_pages, table, first)


# -------------------------------------------------------------------------------------------
# Shared-memory layouts and the interpreter's differences.


def smem_transforms(dtype: jnp.dtype) -> tuple:
    """128-byte swizzled tiles, the layout wgmma reads from shared memory."""
    columns = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(128))


def transposed_keys(k_smem, kt_smem, interpret: bool):
    """K^T [H, L] as wgmma's B operand: a transposed view on the GPU, a copy in the
    interpreter (whose wgmma takes no transposed operand)."""
    if not interpret:
        return k_smem.transpose((1, 0))
    kt_smem[...] = k_smem[...].T
    return kt_smem


def iota(shape: tuple[int, int], dimension: int, interpret: bool) -> jax.Array:
    """int32 indices along ``dimension``, in the wgmma register layout on the GPU."""
    if interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def with_layout(x: jax.Array, layout, interpret: bool) -> jax.Array:
    """x cast to a register layout on the GPU; unchanged in the interpreter."""
    return x if interpret else plgpu.layout_cast(x, layout)


@functools.cache
def interpret_params():
    """Mosaic GPU's CPU interpreter parameters (one object: the kernels' caches key on it)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def triton_params(num_warps: int, num_stages: int, interpret: bool):
    """A Triton-backend kernel's launch and pipelining on the GPU; None in the interpreter
    (which takes no compiler parameters)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def shared_kernel(kernel: Callable) -> Callable:
    """``kernel`` jitted, and (through the factories' ``functools.cache``) one object per
    configuration.

    A model calls the same kernel once per layer; JAX lowers a jitted function once per
    module and calls it from every site, where a bare kernel call embeds its Mosaic GPU
    payload at each site, for XLA to compile again each time (32 layers x every prefill
    shape made an 8B engine's warm-up 4x longer; lowered for CUDA, 8 flash calls: 1.9 MB of
    module text unshared, 0.24 MB shared).
    """
    return jax.jit(kernel)
