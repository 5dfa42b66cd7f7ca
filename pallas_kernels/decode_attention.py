"""Split-K decode attention on Mosaic GPU: few query tokens per row against a ragged KV cache.

The kernel runs one program per (batch row b, kv head k, key chunk c). A program skips its
chunk outright when the chunk starts at or past ``key_lengths[b]`` (no copy, no math, no
write); otherwise it copies the chunk's K and V (and the row's queries) into shared memory
with TMA, computes the chunk's scores for every query of the kv head's group on the tensor
cores, and writes an unnormalised partial result (row max, row sum, P @ V). A small jnp step
(``_merge_chunks``) then combines the chunks with the usual log-sum-exp rescaling, ignoring
skipped chunks. Splitting over the keys is what lets a batch of one fill the GPU: B=1, K=8,
S=4096 with 256-key chunks is 128 programs.

Queries of one kv head are laid out as the rows of one matrix: row r = t * G + g for query
token t and query head g of the group, padded to 64 rows (the wgmma M tile); the T*G <= 64
real rows cover decode (T=1) and speculative verify (T = drafts + 1) with GQA up to 8.
Each row carries its own visible-key limit (the row's length, capped by causality at the
token's position + 1), so causal verify and ragged lengths are one mask.

Interpret mode (``interpret=True``) runs the same kernel in Mosaic GPU's CPU interpreter; its
differences are layout-only (``pallas_kernels/_mosaic.py``).

Axes: B batch, T query tokens, S key slots, N query heads, K kv heads, G = N / K, H head dim,
C key chunks, L keys per chunk, R query rows per kv head (padded to 64), P rows written.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import (
    MASKED,
    interpret_params,
    iota,
    reference_attention,
    round_up,
    shared_kernel,
    smem_transforms,
    transposed_keys,
    visible_keys,
    with_layout,
)

ROWS = 64  # the wgmma M tile: query rows per program


def decode_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_lengths: jax.Array,
    query_positions: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """The jnp reference: ``reference_attention`` with the kernel's mask convention."""
    return reference_attention(q, k, v, _visible(q, k, key_lengths, query_positions), scale)


def decode_attention_applies(
    q: jax.Array, k: jax.Array, chunk: int = 256, sliding_window: int | None = None
) -> bool:
    """True where the kernel's static constraints hold (any backend; the dtype is checked by
    the caller: the tensor cores take bf16/f16, the interpreter any float)."""
    _, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    return (
        sliding_window is None
        and n % kv_heads == 0
        and t * (n // kv_heads) <= ROWS
        and h % 64 == 0
        and chunk % 64 == 0
        and s % chunk == 0
        and k.dtype == q.dtype
    )


def decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_lengths: jax.Array,
    query_positions: jax.Array | None = None,
    scale: float | None = None,
    *,
    chunk: int = 256,
    interpret: bool = False,
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] with keys s < key_lengths[b] -> [B,T,N,H] in q's dtype.

    ``query_positions`` int32[B,T], when given, adds causality (key s visible to token t only
    if s <= query_positions[b, t]); without it every query sees its row's whole length (the
    decode step, whose one query sits at the last visible key). A row of length 0 gives zeros.
    ``chunk`` (L) keys per program: a multiple of 64 dividing S.
    """
    b, _, _, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    if not decode_attention_applies(q, k, chunk):
        raise ValueError(f"decode_attention does not apply to q {q.shape}, k {k.shape}, {chunk=}")
    scale = h**-0.5 if scale is None else float(scale)
    q_rows, limit = query_rows(q, kv_heads, key_lengths, query_positions)
    run = _decode_kernel(b, s, kv_heads, h, chunk, q_rows.shape[2], q.dtype, scale, interpret)
    partials = run(key_lengths.astype(jnp.int32), limit, q_rows, k, v)
    return attention_output(q, partials, key_lengths, chunk)


def query_rows(
    q: jax.Array, kv_heads: int, key_lengths: jax.Array, query_positions: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Queries per kv head as rows r = t * G + g, and each row's visible-key limit.

    q [B,T,N,H] -> q rows [B,K,P,H] and limits int32[B,K,P], P = T*G rounded up to 8 (the
    padding rows have limit 0: every key masked, their output dropped).
    """
    b, t, n, h = q.shape
    g = n // kv_heads
    pad = round_up(t * g, 8) - t * g
    rows = q.reshape(b, t, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, -1, h)
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad), (0, 0)))
    limit = jnp.broadcast_to(key_lengths.astype(jnp.int32)[:, None], (b, t))
    if query_positions is not None:
        limit = jnp.minimum(limit, query_positions.astype(jnp.int32) + 1)
    limit = jnp.broadcast_to(limit[:, None, :, None], (b, kv_heads, t, g)).reshape(b, kv_heads, -1)
    return rows, jnp.pad(limit, ((0, 0), (0, 0), (0, pad)))


@functools.cache  # one jitted kernel per configuration: see shared_kernel
def _decode_kernel(
    b: int,
    s: int,
    kv_heads: int,
    h: int,
    chunk: int,
    rows_written: int,
    dtype: jnp.dtype,
    scale: float,
    interpret: bool,
) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
    """The Mosaic GPU kernel: (lengths, limits, q rows, k, v) -> per-chunk (max, sum, out)."""
    num_chunks = s // chunk

    def body(
        # Inputs (GMEM).
        lengths_gmem,  # int32[B]
        limit_gmem,  # int32[B, K, P]
        q_gmem,  # [B, K, P, H]
        k_gmem,  # [B, S, K, H]
        v_gmem,  # [B, S, K, H]
        # Outputs (GMEM), one slot per chunk; skipped chunks are left unwritten.
        max_gmem,  # f32[B, K, C, P]
        sum_gmem,  # f32[B, K, C, P]
        out_gmem,  # f32[B, K, C, P, H]
        # Scratch (SMEM).
        smem,  # ChunkScratch
        barriers,  # 4 TMA barriers: q, limits, k, v
    ):
        row, head, c = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("c")
        start = c * chunk

        @pl.when(start < lengths_gmem[row])
        def _visible_chunk():
            keys = pl.ds(start, chunk)
            mine = pl.ds(0, rows_written)
            plgpu.copy_gmem_to_smem(q_gmem.at[row, head], smem.q.at[mine], barriers.at[0])
            plgpu.copy_gmem_to_smem(limit_gmem.at[row, head], smem.limit.at[mine], barriers.at[1])
            plgpu.copy_gmem_to_smem(k_gmem.at[row, keys, head], smem.k, barriers.at[2])
            plgpu.copy_gmem_to_smem(v_gmem.at[row, keys, head], smem.v, barriers.at[3])
            for ready in range(3):
                plgpu.barrier_wait(barriers.at[ready])
            slots = (
                max_gmem.at[row, head, c],
                sum_gmem.at[row, head, c],
                out_gmem.at[row, head, c],
            )
            attend_chunk(smem, barriers.at[3], slots, start, scale, interpret)

    return shared_kernel(
        plgpu.kernel(
            body,
            out_type=partial_types(b, kv_heads, num_chunks, rows_written, h),
            scratch_types=[
                ChunkScratch.types(dtype, h, chunk, interpret),
                plgpu.Barrier(num_barriers=4),
            ],
            grid=(b, kv_heads, num_chunks),
            grid_names=("b", "k", "c"),
            interpret=interpret_params() if interpret else None,
        )
    )


# -------------------------------------------------------------------------------------------
# One chunk's attention and the merge of the chunks: public, for the paged kernel
# (paged_attention.py), which differs only in where a chunk's keys come from.


class ChunkScratch(NamedTuple):
    """A program's shared memory (as ``plgpu.SMEM`` types from ``types``, as refs in the body)."""

    q: Any  # [R, H]
    k: Any  # [L, H]
    v: Any  # [L, H]
    p: Any  # [R, L] probabilities in the value dtype, the PV product's A operand
    limit: Any  # int32[R]
    stat: Any  # f32[2, R] row max and row sum, staged for the copy out
    out: Any  # f32[R, H]
    kt: Any  # [H, L] K^T, interpret mode only (else None)

    @classmethod
    def types(cls, dtype: jnp.dtype, h: int, chunk: int, interpret: bool) -> ChunkScratch:
        tiled = smem_transforms(dtype)
        return cls(
            q=plgpu.SMEM((ROWS, h), dtype, transforms=tiled),
            k=plgpu.SMEM((chunk, h), dtype, transforms=tiled),
            v=plgpu.SMEM((chunk, h), dtype, transforms=tiled),
            p=plgpu.SMEM((ROWS, chunk), dtype, transforms=tiled),
            limit=plgpu.SMEM((ROWS,), jnp.int32),
            stat=plgpu.SMEM((2, ROWS), jnp.float32),
            out=plgpu.SMEM((ROWS, h), jnp.float32),
            kt=plgpu.SMEM((h, chunk), dtype) if interpret else None,
        )


def partial_types(
    b: int, kv_heads: int, num_chunks: int, rows_written: int, h: int
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The kernel's outputs: per-chunk row max f32[B,K,C,P], row sum, and P @ V f32[B,K,C,P,H]."""
    stats = jax.ShapeDtypeStruct((b, kv_heads, num_chunks, rows_written), jnp.float32)
    return stats, stats, jax.ShapeDtypeStruct((*stats.shape, h), jnp.float32)


def attend_chunk(smem: ChunkScratch, values_ready, slots, start, scale: float, interpret: bool):
    """A visible chunk whose queries, limits and keys are in ``smem``: scores on the tensor
    cores, the masked softmax, P @ V once ``values_ready``, and the partial result copied to
    ``slots`` (this program's row max f32[P], row sum f32[P] and P @ V f32[P, H] in GMEM)."""
    chunk, h = smem.k.shape
    mine = pl.ds(0, slots[0].shape[0])

    def qk(acc):
        plgpu.wgmma(acc, smem.q, transposed_keys(smem.k, smem.kt, interpret))
        return acc[...]

    scores = pl.run_scoped(qk, plgpu.ACC((ROWS, chunk), jnp.float32)) * scale
    key_ids = iota((ROWS, chunk), 1, interpret) + start
    limit = with_layout(smem.limit[...], plgpu.Layout.WGMMA.reduce(1), interpret)
    visible = key_ids < lax.broadcast_in_dim(limit, (ROWS, chunk), [0])
    scores = jnp.where(visible, scores, MASKED)
    row_max = scores.max(axis=1)
    probs = jnp.exp(scores - lax.broadcast_in_dim(row_max, scores.shape, [0]))
    smem.p[...] = probs.astype(smem.p.dtype)
    plgpu.commit_smem()
    plgpu.barrier_wait(values_ready)

    def pv(acc):
        plgpu.wgmma(acc, smem.p, smem.v)
        return acc[...]

    smem.out[...] = pl.run_scoped(pv, plgpu.ACC((ROWS, h), jnp.float32))
    smem.stat[0] = row_max
    smem.stat[1] = probs.sum(axis=1)
    plgpu.commit_smem()
    max_slot, sum_slot, out_slot = slots
    plgpu.copy_smem_to_gmem(smem.stat.at[0, mine], max_slot)
    plgpu.copy_smem_to_gmem(smem.stat.at[1, mine], sum_slot)
    plgpu.copy_smem_to_gmem(smem.out.at[mine], out_slot)
    plgpu.wait_smem_to_gmem(0)


def attention_output(
    q: jax.Array, partials: tuple[jax.Array, ...], key_lengths: jax.Array, chunk: int
) -> jax.Array:
    """The kernel's per-chunk partials merged and laid out as q [B,T,N,H], in q's dtype."""
    b, t, n, h = q.shape
    kv_heads = partials[0].shape[1]
    merged = _merge_chunks(*partials, key_lengths, chunk)  # [B, K, P, H]
    merged = merged[:, :, : t * n // kv_heads].reshape(b, kv_heads, t, -1, h)
    return merged.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def _merge_chunks(
    row_max: jax.Array, row_sum: jax.Array, out: jax.Array, key_lengths: jax.Array, chunk: int
) -> jax.Array:
    """Log-sum-exp merge of the chunks' partial results over the chunks that ran.

    row_max, row_sum f32[B,K,C,P]; out f32[B,K,C,P,H] -> f32[B,K,P,H]. Skipped chunks hold
    whatever the output buffer held (never written), so they are selected away, not scaled.
    """
    ran = (jnp.arange(row_max.shape[2]) * chunk < key_lengths[:, None])[:, None, :, None]
    row_max = jnp.where(ran, row_max, -jnp.inf)
    top = jnp.max(row_max, axis=2, keepdims=True)
    weight = jnp.where(ran, jnp.exp(row_max - top), 0.0)  # [B, K, C, P]
    total = jnp.sum(weight * jnp.where(ran, row_sum, 0.0), axis=2)
    merged = jnp.sum(weight[..., None] * jnp.where(ran[..., None], out, 0.0), axis=2)
    return merged / jnp.maximum(total, 1e-30)[..., None]


def _visible(
    q: jax.Array, k: jax.Array, key_lengths: jax.Array, query_positions: jax.Array | None
) -> jax.Array:
    """bool[B,T,S], the mask the kernel implements (no positions: every query sees its row's
    whole length)."""
    if query_positions is None:
        anywhere = jnp.zeros(q.shape[:2], jnp.int32)
        return visible_keys(anywhere, key_lengths, k.shape[1], causal=False)
    return visible_keys(query_positions, key_lengths, k.shape[1], causal=True)
