"""Split-K decode attention over a paged KV cache on Mosaic GPU: the pages are read in place.

The batching engine keeps keys and values in a shared pool of pages ``[pages, page_size, K,
H]``; row b's key s lives at ``pool[block_table[b, s // page_size], s % page_size]``. This
kernel is ``decode_attention`` with the pool in place of dense rows: one program per (batch
row b, kv head k, chunk c of L keys = L / page_size pages), skipped outright when the chunk
starts at or past ``key_lengths[b]``. A visible chunk reads its block-table entries and
copies each page's K and V for its kv head into consecutive slices of shared memory with
TMA, so the chunk lands exactly as the dense kernel's contiguous copy would; from there the
math, the per-chunk partial results and their log-sum-exp merge are the dense kernel's own
(``attend_chunk``, ``attention_output`` in decode_attention.py). No ``[B, S, K, H]`` gather
of the rows is ever written.

Barriers: a barrier completes when its expected number of arrivals has arrived and their
bytes have landed, and each TMA copy is one arrival carrying its byte count. So the queries,
the limits and the chunk's L / page_size K pages all signal one barrier (``num_arrivals`` =
2 + pages per chunk), and the V pages a second one: the scores wait for the first, P @ V
for the second, as in the dense kernel. The interpreter counts arrivals the same way.

Block-table entries a row does not own (``num_pages``) may still fall in the row's last
visible chunk; they are pointed at the row's first page, which is read and masked. So the
kernel reads only the pages of each row's table, and those must hold finite values past the
row's length (a zero-initialised pool does): masked keys weigh exactly 0, and 0 * NaN is NaN.

Axes: B batch, T query tokens, N query heads, K kv heads, H head dim, W block-table width,
C key chunks, L keys per chunk, P query rows written per kv head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import chunked_table, gather_pages, interpret_params, shared_kernel
from pallas_kernels.decode_attention import (
    ChunkScratch,
    attend_chunk,
    attention_output,
    decode_attention_applies,
    decode_attention_reference,
    partial_types,
    query_rows,
)


def paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    key_lengths: jax.Array,
    query_positions: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The jnp reference: each row's pages gathered (``gather_pages``), then
    ``decode_attention_reference``; a row of length 0 gives zeros, as in the kernel."""
    k, v = gather_pages(k_pages, block_table), gather_pages(v_pages, block_table)
    out = decode_attention_reference(q, k, v, key_lengths, query_positions, scale)
    return jnp.where((key_lengths > 0)[:, None, None, None], out, 0).astype(q.dtype)


def paged_attention_applies(
    q: jax.Array, k_pages: jax.Array, chunk: int = 256, sliding_window: int | None = None
) -> bool:
    """True where the kernel's static constraints hold: the dense kernel's on one chunk of keys
    (query rows, head dim, chunk, dtypes), and pages that tile the chunk in 8-row tiles."""
    _, page_size, kv_heads, h = k_pages.shape
    one_chunk = jax.ShapeDtypeStruct((1, chunk, kv_heads, h), k_pages.dtype)
    return (
        decode_attention_applies(q, one_chunk, chunk, sliding_window)
        and page_size % 8 == 0
        and chunk % page_size == 0
    )


def paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    key_lengths: jax.Array,
    query_positions: jax.Array | None = None,
    scale: float | None = None,
    *,
    chunk: int = 256,
    interpret: bool = False,
) -> jax.Array:
    """q [B,T,N,H] over k/v pages [pages, page_size, K, H] -> [B,T,N,H] in q's dtype.

    Row b sees its keys s < key_lengths[b], key s at page ``block_table[b, s // page_size]``
    (block_table int32[B, W], ``num_pages`` where the row owns no page). ``query_positions``
    int32[B,T], when given, adds causality (key s visible to token t only if s <=
    query_positions[b, t]); without it every query sees its row's whole length. A row of
    length 0 gives zeros. ``chunk`` (L) keys per program: a multiple of 64 and of page_size.
    """
    b, _, _, h = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    if not paged_attention_applies(q, k_pages, chunk):
        raise ValueError(
            f"paged_attention does not apply to q {q.shape}, pages {k_pages.shape}, {chunk=}"
        )
    scale = h**-0.5 if scale is None else float(scale)
    table = chunked_table(block_table, num_pages, chunk // page_size)
    q_rows, limit = query_rows(q, kv_heads, key_lengths, query_positions)
    run = _paged_kernel(
        b, page_size, kv_heads, h, chunk, table.shape[1], q_rows.shape[2], q.dtype, scale, interpret
    )
    partials = run(key_lengths.astype(jnp.int32), table, limit, q_rows, k_pages, v_pages)
    return attention_output(q, partials, key_lengths, chunk)


@functools.cache  # one jitted kernel per configuration: see shared_kernel
def _paged_kernel(
    b: int,
    page_size: int,
    kv_heads: int,
    h: int,
    chunk: int,
    width: int,
    rows_written: int,
    dtype: jnp.dtype,
    scale: float,
    interpret: bool,
) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """The kernel: (lengths, table, limits, q rows, k pages, v pages) -> per-chunk partials."""
    pages_per_chunk = chunk // page_size
    num_chunks = width // pages_per_chunk

    def body(
        # Inputs (GMEM).
        lengths_gmem,  # int32[B]
        table_gmem,  # int32[B, C * L / page_size], every entry in range
        limit_gmem,  # int32[B, K, P]
        q_gmem,  # [B, K, P, H]
        k_gmem,  # [pages, page_size, K, H]
        v_gmem,  # [pages, page_size, K, H]
        # Outputs (GMEM), one slot per chunk; skipped chunks are left unwritten.
        max_gmem,  # f32[B, K, C, P]
        sum_gmem,  # f32[B, K, C, P]
        out_gmem,  # f32[B, K, C, P, H]
        # Scratch (SMEM).
        smem,  # ChunkScratch
        keys_ready,  # TMA barrier of q, the limits and the chunk's K pages
        values_ready,  # TMA barrier of the chunk's V pages
    ):
        row, head, c = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("c")
        start = c * chunk

        @pl.when(start < lengths_gmem[row])
        def _visible_chunk():
            mine = pl.ds(0, rows_written)
            plgpu.copy_gmem_to_smem(q_gmem.at[row, head], smem.q.at[mine], keys_ready)
            plgpu.copy_gmem_to_smem(limit_gmem.at[row, head], smem.limit.at[mine], keys_ready)
            for i in range(pages_per_chunk):
                page = table_gmem[row, c * pages_per_chunk + i]
                keys = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_gmem.at[page, :, head], smem.k.at[keys], keys_ready)
                plgpu.copy_gmem_to_smem(v_gmem.at[page, :, head], smem.v.at[keys], values_ready)
            plgpu.barrier_wait(keys_ready)
            slots = (
                max_gmem.at[row, head, c],
                sum_gmem.at[row, head, c],
                out_gmem.at[row, head, c],
            )
            attend_chunk(smem, values_ready, slots, start, scale, interpret)

    return shared_kernel(
        plgpu.kernel(
            body,
            out_type=partial_types(b, kv_heads, num_chunks, rows_written, h),
            scratch_types=[
                ChunkScratch.types(dtype, h, chunk, interpret),
                plgpu.Barrier(num_arrivals=2 + pages_per_chunk),
                plgpu.Barrier(num_arrivals=pages_per_chunk),
            ],
            grid=(b, kv_heads, num_chunks),
            grid_names=("b", "k", "c"),
            interpret=interpret_params() if interpret else None,
        )
    )
