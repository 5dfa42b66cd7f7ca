"""FlashAttention prefill on Mosaic GPU: many query tokens per row against ragged keys.

The kernel runs one program per (query head n, query block i of ``block_q`` rows, batch row b).
A program copies its query block into shared memory once, then walks the key blocks of its
kv head (n // G) with an online softmax: the running row max and row sum stay in fp32
registers, the output accumulator too, and each step rescales them by the new max. QK^T and
PV run on the tensor cores (wgmma); K and V blocks arrive by TMA into ``stages`` (2-4)
shared-memory slots, the copies of the next ``stages - 1`` blocks in flight during the current
block's math, so loads overlap compute.

Ragged batches cost nothing for the padding. Row b has ``query_lengths[b]`` real queries and
``key_lengths[b]`` real keys; query t sits at position ``key_lengths[b] - query_lengths[b] +
t`` (the queries are the last keys: a fresh prefill, or a chunk appended to a cached prefix).
A program walks only the key blocks below its row's length and, if causal, at or below its
last query's position; a query block wholly past the row's query length walks none and writes
zeros. Key blocks fully visible to every query of the block skip the mask arithmetic. Query
rows past the length, and rows that see no key at all, come out as zeros, never NaN. Causal
programs run the longest query blocks first, so the short ones fill the tail.

Non-causal with query lengths T covers encoder self-attention and NLLB's cross-attention
(padded source lengths as ``key_lengths``).

Interpret mode (``interpret=True``) runs the same kernel in Mosaic GPU's CPU interpreter. Its
differences, all layout-only, are shared with ``decode_attention`` (K^T materialised in shared
memory, no register layouts), plus two here: its wgmma takes no register operand, so P goes
through shared memory, and it has no ``run_state``, so PV lands in a fresh accumulator that is
then added to the running one.

Axes: B batch, T query tokens, S key slots, N query heads, K kv heads, G = N / K, H head dim,
Q rows per query block, L keys per key block.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels.decode_attention import (
    _interpret_params,
    _iota,
    _shared,
    _smem_transforms,
    _transposed_keys,
    _with_layout,
)
from pallas_kernels.paged_attention import _chunked_table
from spark_jax.attention import AttentionMask, reference_attention

_LOG2E = math.log2(math.e)
_NO_MAX = -1e30  # the running max before any key: finite, so a row with no key stays at zero


def flash_attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_lengths: jax.Array | None = None,
    key_lengths: jax.Array | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """The jnp reference: ``reference_attention`` with the kernel's mask convention, rows
    past the query length or without a visible key set to zero."""
    query_lengths, key_lengths = _lengths(q, k, query_lengths, key_lengths)
    mask = attention_mask(q.shape[1], query_lengths, key_lengths, causal)
    out = reference_attention(q, k, v, mask, scale=scale)
    live = mask.dense(k.shape[1]).any(axis=-1) & (jnp.arange(q.shape[1]) < query_lengths[:, None])
    return jnp.where(live[:, :, None, None], out, 0).astype(q.dtype)


def attention_mask(
    num_queries: int, query_lengths: jax.Array, key_lengths: jax.Array, causal: bool
) -> AttentionMask:
    """The AttentionMask of the kernel's convention: query t of row b at position
    ``key_lengths[b] - query_lengths[b] + t``."""
    offset = key_lengths.astype(jnp.int32) - query_lengths.astype(jnp.int32)
    positions = offset[:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None]
    return AttentionMask(positions, key_lengths.astype(jnp.int32), causal=causal)


def flash_attention_applies(
    q: jax.Array, k: jax.Array, block_q: int = 64, block_k: int | None = None
) -> bool:
    """True where the kernel's static constraints hold (any backend; the dtype is checked by
    the caller: the tensor cores take bf16/f16, the interpreter any float)."""
    _, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    block_k = default_block_k(h, s) if block_k is None else block_k
    return (
        n % kv_heads == 0
        and h in (64, 128)
        and block_q in (64, 128)
        and block_k in (64, 128)
        and t % block_q == 0
        and s % block_k == 0
        and k.dtype == q.dtype
    )


def default_block_k(h: int, s: int) -> int:
    """Keys per block: 64 at head dim 128 keeps a program's shared memory (Q, two K and two V
    slots: 80 KiB in bf16) small enough for two programs per SM, whose softmax and tensor-core
    phases then interleave; at head dim 64, 128 keys fit three (64 where S is not a multiple
    of 128)."""
    return 128 if h == 64 and s % 128 == 0 else 64


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_lengths: jax.Array | None = None,
    key_lengths: jax.Array | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    block_q: int = 64,
    block_k: int | None = None,
    stages: int = 2,
    block_table: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] -> [B,T,N,H] in q's dtype.

    Row b has ``query_lengths[b]`` queries (default T) and ``key_lengths[b]`` keys (default
    S); query t sits at key position ``key_lengths[b] - query_lengths[b] + t`` and, if
    ``causal``, sees keys up to that position. Rows past the query length and rows that see
    no key give zeros. ``block_q`` (Q, 64 or 128) divides T, ``block_k`` (L, 64 or 128;
    ``default_block_k``) divides S: pad the shapes, not the lengths. ``stages`` (2-4) K/V
    blocks are in flight per program: more hide more of the copy latency, fewer leave room
    for more programs per SM.

    With ``block_table`` int32[B, W], k and v are a page pool [pages, page_size, K, H] read in
    place: row b's key s at ``pool[block_table[b, s // page_size], s % page_size]``, S = W x
    page_size (entries past a row's pages may hold anything: they are never walked, or masked
    and pointed at the row's first page). Each key block then arrives as one TMA copy per page.
    """
    b, t, n, h = q.shape
    dense_k, tables, page_size = k, (), None  # dense_k: what the checks see
    if block_table is not None:  # the [B, S, K, H] rows the pages make up, in whole blocks
        num_pages, page_size, kv_heads, _ = k.shape
        if block_k is None:
            block_k = default_block_k(h, block_table.shape[1] * page_size)
        if block_k % page_size or page_size % 8:
            raise ValueError(
                f"pages of {page_size} keys must be a multiple of 8 that divides {block_k=}"
            )
        tables = (_chunked_table(block_table, num_pages, block_k // page_size),)
        dense_k = jax.ShapeDtypeStruct((b, tables[0].shape[1] * page_size, kv_heads, h), k.dtype)
    s, kv_heads = dense_k.shape[1], dense_k.shape[2]
    block_k = default_block_k(h, s) if block_k is None else block_k
    if not flash_attention_applies(q, dense_k, block_q, block_k) or stages not in (2, 3, 4):
        raise ValueError(
            f"flash_attention does not apply to q {q.shape}, k {k.shape}, {block_q=}, "
            f"{block_k=}, {stages=}"
        )
    query_lengths, key_lengths = _lengths(q, dense_k, query_lengths, key_lengths)
    scale = h**-0.5 if scale is None else float(scale)
    run = _flash_kernel(
        b, t, s, n, kv_heads, h, block_q, block_k, stages, q.dtype, causal, scale, page_size,
        interpret,
    )  # fmt: skip
    return run(query_lengths, key_lengths, *tables, q, k, v)


def flash_decode_applies(q: jax.Array, k: jax.Array, paged: bool = False) -> bool:
    """True where ``flash_decode_attention`` runs: one query token per row, at most 64 query
    heads per kv head, head dim 64 or 128, and rows of whole 64-key blocks (k [B, S, K, H]) or
    pages of a multiple of 8 keys dividing 128 (``paged``: k [pages, page size, K, H])."""
    _, t, n, h = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    return (
        t == 1
        and n % kv_heads == 0
        and n // kv_heads <= 64
        and h in (64, 128)
        and (keys % 8 == 0 and 128 % keys == 0 if paged else keys % 64 == 0)
        and k.dtype == q.dtype
    )


def flash_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    key_lengths: jax.Array,
    scale: float | None = None,
    *,
    block_table: jax.Array | None = None,
    block_k: int | None = None,
    stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """A decode step through the flash kernel: q [B,1,N,H] over k/v [B,S,K,H], keys below
    ``key_lengths[b]`` -> [B,1,N,H]; a row of length 0 gives zeros. With ``block_table``
    int32[B, W], k and v are page pools [pages, page size, K, H] read in place. ``block_k``
    (default 128 keys where they tile the rows) and ``stages`` as in ``flash_attention``.

    Each kv head's G query heads become the rows of one 64-row query block (GQA 1 inside the
    kernel), so one program per (row, kv head) walks every key of its row with the K/V copies
    pipelined, and writes the normalised output: no partials, no merge. It fills the GPU when
    B x K is a few times the SM count (B=64, K=8: 512 programs); a small batch leaves SMs idle,
    where the split-K kernel (``decode_attention``) is the one to use. Measured on the H200 at
    B=64, S=4096, GQA 32/8: 2.55 TB/s with 128-key blocks, cuDNN 2.45 in the same run.
    """
    b, _, n, h = q.shape
    kv_heads = k.shape[2]
    if not flash_decode_applies(q, k, paged=block_table is not None):
        raise ValueError(f"flash_decode_attention does not apply to q {q.shape}, k {k.shape}")
    s = k.shape[1] if block_table is None else 128
    group = n // kv_heads
    rows = q.reshape(b, kv_heads, group, h).transpose(0, 2, 1, 3)  # [B, G, K, H]
    rows = jnp.pad(rows, ((0, 0), (0, 64 - group), (0, 0), (0, 0)))
    query_lengths = jnp.full((b,), group, jnp.int32)
    if block_k is None:  # 128: one program per SM, but measured faster than 64
        block_k = 128 if s % 128 == 0 else 64
    out = flash_attention(
        rows,
        k,
        v,
        query_lengths,
        key_lengths,
        causal=False,
        scale=scale,
        block_k=block_k,
        stages=stages,
        block_table=block_table,
        interpret=interpret,
    )
    return out[:, :group].transpose(0, 2, 1, 3).reshape(b, 1, n, h)


def _lengths(
    q: jax.Array, k: jax.Array, query_lengths: jax.Array | None, key_lengths: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    b = q.shape[0]
    if query_lengths is None:
        query_lengths = jnp.full((b,), q.shape[1])
    if key_lengths is None:
        key_lengths = jnp.full((b,), k.shape[1])
    return query_lengths.astype(jnp.int32), key_lengths.astype(jnp.int32)


@functools.cache  # one jitted kernel per configuration: see _shared
def _flash_kernel(
    b: int,
    t: int,
    s: int,
    n: int,
    kv_heads: int,
    h: int,
    block_q: int,
    block_k: int,
    stages: int,
    dtype: jnp.dtype,
    causal: bool,
    scale: float,
    page_size: int | None,
    interpret: bool,
) -> Callable[..., jax.Array]:
    """The Mosaic GPU kernel: (query lengths, key lengths, [block table,] q, k, v) -> out
    [B,T,N,H]; with ``page_size``, k and v are page pools and a block table comes before q."""
    group = n // kv_heads
    pages_per_block = 1 if page_size is None else block_k // page_size
    num_q_blocks = t // block_q
    tiled = _smem_transforms(dtype)

    def body(*refs):
        # Inputs (GMEM): int32[B] query and key lengths, the block table int32[B, S / page
        # size] when paged, q [B, T, N, H], k and v [B, S, K, H] or [pages, page size, K, H].
        q_lengths_gmem, k_lengths_gmem, *refs = refs
        table_gmem = None if page_size is None else refs.pop(0)
        q_gmem, k_gmem, v_gmem, *refs = refs
        (
            out_gmem,  # [B, T, N, H]
            # Scratch (SMEM).
            q_smem,  # [Q, H] the query block, then the output block on its way out
            k_smem,  # [stages, L, H]: block j in slot j % stages
            v_smem,  # [stages, L, H]
            kt_smem,  # [H, L] K^T, interpret mode only (else None)
            p_smem,  # [Q, L] probabilities, the PV product's A operand, interpret mode only
            q_barrier,  # 1 TMA barrier
            k_barriers,  # one TMA barrier per slot (one arrival per page when paged)
            v_barriers,  # one TMA barrier per slot
        ) = refs
        head, row = lax.axis_index("n"), lax.axis_index("b")
        q_block = lax.axis_index("q")
        if causal:  # the longest (last) query blocks first
            q_block = num_q_blocks - 1 - q_block
        kv_head = lax.div(head, group)
        q_start = q_block * block_q
        q_length, k_length = q_lengths_gmem[row], k_lengths_gmem[row]
        offset = k_length - q_length  # the key position of query 0
        live_rows = jnp.clip(q_length - q_start, 0, block_q)
        full_steps, num_steps = _key_blocks(q_start, q_length, k_length, block_q, block_k, causal)

        def fetch(step):
            slot = lax.rem(step, stages)
            if table_gmem is None:
                keys = pl.ds(step * block_k, block_k)
                plgpu.copy_gmem_to_smem(
                    k_gmem.at[row, keys, kv_head], k_smem.at[slot], k_barriers.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_gmem.at[row, keys, kv_head], v_smem.at[slot], v_barriers.at[slot]
                )
                return
            for i in range(pages_per_block):  # the block's pages, one after another in SMEM
                page = table_gmem[row, step * pages_per_block + i]
                keys = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(
                    k_gmem.at[page, :, kv_head], k_smem.at[slot, keys], k_barriers.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    v_gmem.at[page, :, kv_head], v_smem.at[slot, keys], v_barriers.at[slot]
                )

        @pl.when(num_steps > 0)
        def _prologue():
            queries = q_gmem.at[row, pl.ds(q_start, block_q), head]
            plgpu.copy_gmem_to_smem(queries, q_smem, q_barrier.at[0])
            # Block 0 exists (num_steps > 0), the next ones may not; none past S is traced.
            for ahead in range(min(stages - 1, s // block_k)):
                pl.when(ahead < num_steps)(functools.partial(fetch, ahead))

            plgpu.barrier_wait(q_barrier.at[0])

        def visible(j):
            """bool[Q, L]: key j * L + c lies below the row's length and, if causal, at or
            before the position of query q_start + r."""
            keys = _iota((block_q, block_k), 1, interpret) + j * block_k
            seen = keys < k_length
            if causal:
                seen &= keys <= _iota((block_q, block_k), 0, interpret) + (offset + q_start)
            return seen

        def step(j, carry, masked: bool):
            acc, row_max, row_sum = carry
            slot = lax.rem(j, stages)

            # Block j + stages - 1 goes to the slot step j - 1 read, whose products are
            # complete (the wgmma results were read back into registers).
            @pl.when(j + stages - 1 < num_steps)
            def _prefetch():
                fetch(j + stages - 1)

            plgpu.barrier_wait(k_barriers.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, _transposed_keys(k_smem.at[slot], kt_smem, interpret))
                return acc_ref[...]

            scores = pl.run_scoped(qk, plgpu.ACC((block_q, block_k), jnp.float32))
            scores = scores * (scale * _LOG2E)  # base-2 softmax: exp2 is one instruction
            if masked:
                scores = jnp.where(visible(j), scores, -jnp.inf)
            new_max = jnp.maximum(row_max, scores.max(axis=1))
            rescale = jnp.exp2(row_max - new_max)
            probs = jnp.exp2(scores - lax.broadcast_in_dim(new_max, scores.shape, [0]))
            row_sum = row_sum * rescale + probs.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
            plgpu.barrier_wait(v_barriers.at[slot])
            acc = _add_pv(acc, probs.astype(dtype), v_smem.at[slot], p_smem, interpret)
            return acc, new_max, row_sum

        reduced = plgpu.Layout.WGMMA.reduce(1)
        carry = (
            _with_layout(jnp.zeros((block_q, h), jnp.float32), plgpu.Layout.WGMMA, interpret),
            _with_layout(jnp.full((block_q,), _NO_MAX, jnp.float32), reduced, interpret),
            _with_layout(jnp.zeros((block_q,), jnp.float32), reduced, interpret),
        )
        carry = lax.fori_loop(0, full_steps, lambda j, c: step(j, c, masked=False), carry)
        acc, _, row_sum = lax.fori_loop(
            full_steps, num_steps, lambda j, c: step(j, c, masked=True), carry
        )

        # A row with no visible key has acc 0 and sum 0: 0 * 1e30 = 0, never NaN.
        inverse = 1.0 / jnp.maximum(row_sum, 1e-30)
        out = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
        live = _iota((block_q, h), 0, interpret) < live_rows
        q_smem[...] = jnp.where(live, out, 0.0).astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, out_gmem.at[row, pl.ds(q_start, block_q), head])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((block_q, h), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_k, h), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_k, h), dtype, transforms=tiled),
        plgpu.SMEM((h, block_k), dtype) if interpret else None,
        plgpu.SMEM((block_q, block_k), dtype, transforms=tiled) if interpret else None,
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
    ]
    return _shared(
        plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((b, t, n, h), dtype),
            scratch_types=scratch,
            # Heads vary fastest: the G heads of one kv head run side by side and share its K/V
            # blocks in L2.
            grid=(n, num_q_blocks, b),
            grid_names=("n", "q", "b"),
            compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
            interpret=_interpret_params() if interpret else None,
        )
    )


def _key_blocks(
    q_start: jax.Array,
    q_length: jax.Array,
    k_length: jax.Array,
    block_q: int,
    block_k: int,
    causal: bool,
) -> tuple[jax.Array, jax.Array]:
    """(full, total) key blocks of the query block at ``q_start``: blocks [0, total) hold a
    key visible to one of its live queries, and blocks [0, full) only keys visible to all
    of them (no mask needed). A block with no live query walks none."""
    offset = k_length - q_length  # the key position of query 0
    live_rows = jnp.clip(q_length - q_start, 0, block_q)
    if causal:
        key_end = jnp.minimum(k_length, offset + q_start + live_rows)
        full_end = jnp.minimum(k_length, offset + q_start + 1)
    else:
        key_end = full_end = k_length
    total = jnp.where(live_rows > 0, pl.cdiv(jnp.maximum(key_end, 0), block_k), 0)
    return jnp.minimum(lax.div(jnp.maximum(full_end, 0), block_k), total), total


def _add_pv(acc: jax.Array, probs: jax.Array, v_slot, p_smem, interpret: bool) -> jax.Array:
    """acc + P @ V on the tensor cores. On the GPU P stays in registers and the product
    accumulates into acc in place; the interpreter's wgmma reads P from shared memory and
    has no ``run_state``, so the product lands in a fresh accumulator and is added."""
    if not interpret:

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, probs, v_slot)

        return pl.run_state(pv)(plgpu.ACC.init(acc))

    p_smem[...] = probs
    plgpu.commit_smem()

    def pv_fresh(acc_ref):
        plgpu.wgmma(acc_ref, p_smem, v_slot)
        return acc_ref[...]

    return acc + pl.run_scoped(pv_fresh, plgpu.ACC(acc.shape, jnp.float32))
