"""FlashAttention prefill on Mosaic GPU: many query tokens per row against ragged keys.

The kernel runs one program per (query head n, query block i of ``block_q`` rows, batch row b).
A program copies its query block into shared memory once, then walks the key blocks of its
kv head (n // G) with an online softmax: the running row max and row sum stay in fp32
registers, the output accumulator too, and each step rescales them by the new max. QK^T and
PV run on the tensor cores (wgmma); K and V blocks arrive by TMA into ``stages`` (2-8)
shared-memory slots, the copies of the next ``stages - 1`` blocks in flight during the current
block's math, so loads overlap compute.

With ``consumers`` (1 or 2) the program's warpgroups specialise instead: a producer warpgroup
only issues the K/V copies, refilling each slot as soon as every consumer has released it,
and each consumer warpgroup computes its own query block against the shared K/V blocks (FA3's
split of roles): the copies then never wait behind a consumer's softmax, and two consumers
read each K/V block once for 2 x ``block_q`` rows. With ``pingpong`` the two consumers take
turns on the tensor cores, each issuing block j + 1's QK right behind its P V_j (FA3's order).

A program's unit of work is a tile: its query blocks of one head and batch row. By default
the grid has one program per tile. With ``programs`` (the model's prefill: one per SM) the
programs are persistent: each walks its share of the tiles, the producer running on into
the next tile's K/V blocks (a program counts its key blocks across tiles, block g in slot g
% stages) and each consumer loading its next tile's queries into a second buffer while it
walks the current one, so no tile waits for its first copies or a launch. Tiles are handed
out heaviest first, in rounds that go forward and backward over the programs (a snake), which
keeps causal work even across programs.

Ragged batches cost nothing for the padding. Row b has ``query_lengths[b]`` real queries and
``key_lengths[b]`` real keys; query t sits at position ``key_lengths[b] - query_lengths[b] +
t`` (the queries are the last keys: a fresh prefill, or a chunk appended to a cached prefix).
A program walks only the key blocks below its row's length and, if causal, at or below its
last query's position; a query block wholly past the row's query length walks none and writes
zeros. Key blocks fully visible to every query of the block skip the mask arithmetic. Query
rows past the length, and rows that see no key at all, come out as zeros, never NaN. Causal
tiles run the longest query blocks first, so the short ones fill the tail.

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
from typing import NamedTuple

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import (
    chunked_table,
    interpret_params,
    iota,
    reference_attention,
    shared_kernel,
    smem_transforms,
    transposed_keys,
    visible_keys,
    with_layout,
)

_LOG2E = math.log2(math.e)
_NO_MAX = -1e30  # the running max before any key: finite, so a row with no key stays at zero
_SMEM_LIMIT = 227 * 1024  # a Hopper thread block's dynamic shared memory
# Registers per thread of the producer and of each of two consumer warpgroups (64K per SM:
# 128 x 24 + 256 x 240 fits; the consumers hold the accumulator, scores and P). 240 measured
# 2-7% faster than 232 on the H200.
_REGISTERS = (24, 240)


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
    visible = attention_mask(q.shape[1], k.shape[1], query_lengths, key_lengths, causal)
    out = reference_attention(q, k, v, visible, scale)
    live = visible.any(axis=-1) & (jnp.arange(q.shape[1]) < query_lengths[:, None])
    return jnp.where(live[:, :, None, None], out, 0).astype(q.dtype)


def attention_mask(
    num_queries: int,
    num_keys: int,
    query_lengths: jax.Array,
    key_lengths: jax.Array,
    causal: bool,
) -> jax.Array:
    """bool[B, T, S], the mask of the kernel's convention: query t of row b at position
    ``key_lengths[b] - query_lengths[b] + t`` sees the keys below ``key_lengths[b]`` (and, if
    ``causal``, at or before its position). Rows past the query length are not masked here."""
    offset = key_lengths.astype(jnp.int32) - query_lengths.astype(jnp.int32)
    positions = offset[:, None] + jnp.arange(num_queries, dtype=jnp.int32)[None]
    return visible_keys(positions, key_lengths.astype(jnp.int32), num_keys, causal)


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


def prefill_tuning(q: jax.Array, k: jax.Array, interpret: bool) -> dict:
    """The fastest configuration measured on the H200 for a prefill of these shapes: one
    persistent program per SM, each with two consumer warpgroups of 64 rows taking turns on
    the tensor cores over 128-key blocks (602 TFLOP/s at S=8192 and 471 at 4 x 2048, against
    570 / 434 one program per tile and 481 / 405 with the defaults) where T and S are
    multiples of 128 at head dim 128; the defaults elsewhere and in the interpreter (where
    warpgroups are threads: slow, same results)."""
    _, t, _, h = q.shape
    if interpret or h != 128 or t % 128 or k.shape[1] % 128:
        return {}
    return {"block_k": 128, "stages": 2, "consumers": 2, "pingpong": True, "programs": sm_count()}


def sm_count() -> int:
    """The default device's SM count (132, an H200's, where the backend does not say)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


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
    consumers: int = 0,
    pingpong: bool = False,
    programs: int | None = None,
    block_table: jax.Array | None = None,
    interpret: bool = False,
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] -> [B,T,N,H] in q's dtype.

    Row b has ``query_lengths[b]`` queries (default T) and ``key_lengths[b]`` keys (default
    S); query t sits at key position ``key_lengths[b] - query_lengths[b] + t`` and, if
    ``causal``, sees keys up to that position. Rows past the query length and rows that see
    no key give zeros. ``block_q`` (Q, 64 or 128) divides T, ``block_k`` (L, 64 or 128;
    ``default_block_k``) divides S: pad the shapes, not the lengths. ``stages`` (2-8) K/V
    blocks are in flight per program: more hide more of the copy latency, fewer leave room
    for more programs per SM.

    ``consumers`` 0 runs one warpgroup per program, which issues its own K/V copies. 1 or 2
    specialise the warpgroups: a producer warpgroup issues the copies as soon as a slot is
    released, and each consumer warpgroup computes its own ``block_q`` query rows against the
    shared K/V blocks (a program then covers ``consumers x block_q`` rows, which must divide
    T). ``pingpong`` (2 consumers) has the consumers take turns on the tensor cores, one's
    softmax under the other's GEMMs (FA3's schedule). ``programs`` (with consumers) makes
    the programs persistent: that many (``sm_count()``, say) share the tiles (a tile: one
    program's query rows of one head and batch row), loading the next tile's queries and
    K/V blocks while the current one computes; None runs one program per tile.

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
        tables = (chunked_table(block_table, num_pages, block_k // page_size),)
        dense_k = jax.ShapeDtypeStruct((b, tables[0].shape[1] * page_size, kv_heads, h), k.dtype)
    s, kv_heads = dense_k.shape[1], dense_k.shape[2]
    block_k = default_block_k(h, s) if block_k is None else block_k
    rows_per_program = block_q * max(consumers, 1)
    if (
        not flash_attention_applies(q, dense_k, block_q, block_k)
        or not 2 <= stages <= 8
        or consumers not in (0, 1, 2)
        or t % rows_per_program
        or (pingpong and consumers != 2)
        or (programs is not None and (not consumers or programs < 1))
    ):
        raise ValueError(
            f"flash_attention does not apply to q {q.shape}, k {k.shape}, {block_q=}, "
            f"{block_k=}, {stages=}, {consumers=}, {pingpong=}, {programs=}"
        )
    smem = _shared_bytes(block_q, block_k, h, stages, consumers, programs is not None, q.dtype)
    if not interpret and smem > _SMEM_LIMIT:
        raise ValueError(
            f"{stages} stages of {block_k} keys with {max(consumers, 1)} query blocks of "
            f"{block_q} rows need {smem // 1024} KiB of shared memory, over the "
            f"{_SMEM_LIMIT // 1024} KiB of a Hopper SM: use fewer stages or smaller blocks"
        )
    query_lengths, key_lengths = _lengths(q, dense_k, query_lengths, key_lengths)
    scale = h**-0.5 if scale is None else float(scale)
    if scale <= 0:  # the kernel takes each row's max of the unscaled scores
        raise ValueError(f"flash_attention needs a positive scale, got {scale}")
    run = _flash_kernel(
        b, t, s, n, kv_heads, h, block_q, block_k, stages, consumers, pingpong, programs, q.dtype,
        causal, scale, page_size, interpret,
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
    consumers: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """A decode step through the flash kernel: q [B,1,N,H] over k/v [B,S,K,H], keys below
    ``key_lengths[b]`` -> [B,1,N,H]; a row of length 0 gives zeros. With ``block_table``
    int32[B, W], k and v are page pools [pages, page size, K, H] read in place. ``block_k``
    (default 64 keys over dense rows, 128 over pages), ``stages`` and ``consumers`` (0 or 1)
    as in ``flash_attention``.

    Each kv head's G query heads become the rows of one 64-row query block (GQA 1 inside the
    kernel), so one program per (row, kv head) walks every key of its row with the K/V copies
    pipelined, and writes the normalised output: no partials, no merge. It fills the GPU when
    B x K is a few times the SM count (B=64, K=8: 512 programs); a small batch leaves SMs idle,
    where the split-K kernel (``decode_attention``) is the one to use. Measured on the H200 at
    B=64, S=4096, GQA 32/8: 4.17 TB/s of K/V with 64-key blocks, 3.73
    with 128, cuDNN 4.59 and torch 4.47 in the same run.
    """
    b, _, n, h = q.shape
    kv_heads = k.shape[2]
    if not flash_decode_applies(q, k, paged=block_table is not None):
        raise ValueError(f"flash_decode_attention does not apply to q {q.shape}, k {k.shape}")
    group = n // kv_heads
    rows = q.reshape(b, kv_heads, group, h).transpose(0, 2, 1, 3)  # [B, G, K, H]
    rows = jnp.pad(rows, ((0, 0), (0, 64 - group), (0, 0), (0, 0)))
    query_lengths = jnp.full((b,), group, jnp.int32)
    if block_k is None:
        # Over dense rows 64-key blocks read 1-12% faster than 128 in 7 of 8 H200 runs; the
        # engine's paged walk was measured with 128 (its pages tile it).
        block_k = 64 if block_table is None else 128
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
        consumers=consumers,
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


@functools.cache  # one jitted kernel per configuration: see shared_kernel
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
    consumers: int,
    pingpong: bool,
    programs: int | None,
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
    blocks_per_program = max(consumers, 1)
    num_programs_q = t // (block_q * blocks_per_program)
    num_tiles = n * num_programs_q * b  # a tile: one program's query blocks of one head and row
    grid_size = num_tiles if programs is None else min(programs, num_tiles)
    buffers = 1 if programs is None else 2  # persistent: the next tile's queries load early
    tiled = smem_transforms(dtype)
    log2_scale = scale * _LOG2E  # the softmax in base 2

    def body(*refs):
        # Inputs (GMEM): int32[B] query and key lengths, the block table int32[B, S / page
        # size] when paged, q [B, T, N, H], k and v [B, S, K, H] or [pages, page size, K, H].
        q_lengths_gmem, k_lengths_gmem, *refs = refs
        table_gmem = None if page_size is None else refs.pop(0)
        q_gmem, k_gmem, v_gmem, *refs = refs
        (
            out_gmem,  # [B, T, N, H]
            # Scratch (SMEM), shared by the warpgroups of a program.
            q_smem,  # [buffers, C, Q, H] each query block, then its output on its way out
            k_smem,  # [stages, L, H]: block j in slot j % stages
            v_smem,  # [stages, L, H]
            kt_smem,  # [C, H, L] K^T, interpret mode only (else None)
            p_smem,  # [C, Q, L] probabilities, the PV product's A operand, interpret only
            q_barriers,  # one TMA barrier per query block and buffer
            k_barriers,  # one TMA barrier per slot (one arrival per page when paged)
            v_barriers,  # one TMA barrier per slot
            *refs,
        ) = refs
        # Warp-specialised: per slot, the consumers' K and V releases; ping-pong: the barrier
        # two consumers take turns on the tensor cores with.
        released, turns = (refs[:2], refs[2] if pingpong else None) if consumers else ((), None)

        def tile_of(index) -> Tile:
            """Tile ``index`` of a persistent program, or (None) the tile of a program of
            the (heads, query blocks, rows) grid. Query heads vary fastest (the G heads of a
            kv head run side by side and share its K/V blocks in L2), then batch rows; if
            causal, the longest (last) query blocks come first, so short ones fill the tail."""
            if index is None:
                order, head, row = (lax.axis_index(axis) for axis in ("q", "n", "b"))
            else:
                order, rest = lax.div(index, n * b), lax.rem(index, n * b)
                head, row = lax.rem(rest, n), lax.div(rest, n)
            program_q = num_programs_q - 1 - order if causal else order
            q_length, k_length = q_lengths_gmem[row], k_lengths_gmem[row]
            return Tile(head, row, program_q, lax.div(head, group), q_length, k_length)

        def fetch_keys(tile: Tile, step, slot):
            _fetch(k_gmem, k_smem, k_barriers, tile, step, slot)

        def fetch_values(tile: Tile, step, slot):
            _fetch(v_gmem, v_smem, v_barriers, tile, step, slot)

        def _fetch(pool, slots, barriers, tile: Tile, step, slot):
            """Key block ``step`` of the tile's row and kv head into ``slot``."""
            if table_gmem is None:
                keys = pl.ds(step * block_k, block_k)
                plgpu.copy_gmem_to_smem(
                    pool.at[tile.row, keys, tile.kv_head], slots.at[slot], barriers.at[slot]
                )
                return
            for i in range(pages_per_block):  # the block's pages, one after another in SMEM
                page = table_gmem[tile.row, step * pages_per_block + i]
                keys = pl.ds(i * page_size, page_size)
                plgpu.copy_gmem_to_smem(
                    pool.at[page, :, tile.kv_head], slots.at[slot, keys], barriers.at[slot]
                )

        def query_block(tile: Tile, c: int, buffer=0, first_step=0) -> QueryBlock:
            """Query block c of the tile: its rows, key blocks and shared memory; its key
            block j sits in slot (first_step + j) % stages."""
            q_start = (tile.program_q * blocks_per_program + c) * block_q
            full_steps, num_steps = _key_blocks(
                q_start, tile.q_length, tile.k_length, block_q, block_k, causal
            )
            return QueryBlock(
                tile,
                c,
                buffer,
                first_step,
                q_start,
                jnp.clip(tile.q_length - q_start, 0, block_q),
                full_steps,
                num_steps,
                q_smem.at[buffer, c],
                None if kt_smem is None else kt_smem.at[c],
                None if p_smem is None else p_smem.at[c],
                q_barriers.at[buffer * blocks_per_program + c],
            )

        def load_queries(block: QueryBlock):
            tile = block.tile
            queries = q_gmem.at[tile.row, pl.ds(block.q_start, block_q), tile.head]
            plgpu.copy_gmem_to_smem(queries, block.q, block.barrier)

        def walk(block: QueryBlock, before_step, after_keys, after_values, turns=None):
            """The block's walk over its key blocks (the copies issued elsewhere) -> the
            running (acc, row max, row sum). ``turns``: the ping-pong barrier two consumers
            hand the tensor cores over with (or None)."""
            k_length = block.tile.k_length
            offset = k_length - block.tile.q_length  # the key position of query 0

            def slot_of(j):
                return lax.rem(block.first_step + j, stages)

            def visible(j):
                """bool[Q, L]: key j * L + c lies below the row's length and, if causal, at or
                before the position of query q_start + r."""
                keys = iota((block_q, block_k), 1, interpret) + j * block_k
                seen = keys < k_length
                if causal:
                    rows = iota((block_q, block_k), 0, interpret)
                    seen &= keys <= rows + (offset + block.q_start)
                return seen

            def issue_qk(j, scores_ref):
                """Waits for K block j, starts S = Q K^T into ``scores_ref`` (asynchronous)."""
                slot = slot_of(j)
                plgpu.barrier_wait(k_barriers.at[slot])
                keys_t = transposed_keys(k_smem.at[slot], block.kt, interpret)
                plgpu.wgmma(scores_ref, block.q, keys_t)

            def scores_of(j):
                """Block j's scores, issued then awaited (with ping-pong, the turn handed over
                in between: the other consumer's GEMMs run under this one's softmax)."""

                def qk(scores_ref):
                    issue_qk(j, scores_ref)
                    if turns is not None:
                        _take_turn(turns)
                    return scores_ref[...]

                return pl.run_scoped(qk, plgpu.ACC((block_q, block_k), jnp.float32))

            def softmax(j, scores, carry, masked: bool):
                """Block j's online softmax -> (acc rescaled, row max, row sum, P in q's
                dtype), then waits for V block j (with ping-pong, for the tensor cores too)."""
                acc, row_max, row_sum = carry
                if masked:
                    scores = jnp.where(visible(j), scores, -jnp.inf)
                # Base 2 (exp2 is one instruction), the max taken of the raw scores and scaled
                # once per row: each probability is then one FMA and one exp2 (scale > 0).
                new_max = jnp.maximum(row_max, scores.max(axis=1) * log2_scale)
                rescale = jnp.exp2(row_max - new_max)
                centred = lax.broadcast_in_dim(new_max, scores.shape, [0])
                probs = jnp.exp2(scores * log2_scale - centred)
                row_sum = row_sum * rescale + probs.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(rescale, acc.shape, [0])
                probs = probs.astype(dtype)
                if turns is not None:  # the softmax done before the turn is handed over
                    acc, new_max, row_sum, probs = lax.optimization_barrier(
                        (acc, new_max, row_sum, probs)
                    )
                    plgpu.barrier_arrive(turns)
                plgpu.barrier_wait(v_barriers.at[slot_of(j)])
                if turns is not None:
                    plgpu.barrier_wait(turns)
                return acc, new_max, row_sum, probs

            def step(j, carry, masked: bool):
                """Block j: its scores, softmax, then acc += P V_j."""
                before_step(j)
                scores = scores_of(j)
                after_keys(slot_of(j))
                acc, *state, probs = softmax(j, scores, carry, masked)
                acc = _add_pv(acc, probs, v_smem.at[slot_of(j)], block.p, interpret)
                after_values(slot_of(j))
                return acc, *state

            def pv_then_next_scores(j, acc, probs):
                """acc + P V_j, with block j + 1's scores issued right behind it and the turn
                handed over before either is awaited -> (acc, block j + 1's scores)."""
                values = v_smem.at[slot_of(j)]
                if interpret:  # no run_state: one product after the other
                    return _add_pv(acc, probs, values, block.p, interpret), scores_of(j + 1)

                next_slot = slot_of(j + 1)
                keys_t = transposed_keys(k_smem.at[next_slot], block.kt, interpret)

                def gemms(refs):
                    acc_ref, scores_ref = refs
                    plgpu.wgmma(acc_ref, probs, values)
                    plgpu.barrier_wait(k_barriers.at[next_slot])
                    # The query view made in here: one made outside with a constant index is
                    # closed over as a literal, which run_state's lowering (jax 0.11) rejects.
                    plgpu.wgmma(scores_ref, q_smem.at[block.buffer, block.index], keys_t)
                    _take_turn(turns)

                return pl.run_state(gemms)((plgpu.ACC.init(acc), plgpu.ACC.init(no_scores())))

            def pv_last(j, acc, probs):
                values = v_smem.at[slot_of(j)]
                return _add_pv(acc, probs, values, block.p, interpret), no_scores()

            def pingpong_step(j, carry, masked: bool):
                """Block j's softmax and P V_j, block j + 1's QK issued behind the P V_j
                (FA3's order): the tensor cores always have this consumer's next GEMM queued
                when the turn passes. Carries block j + 1's scores."""
                *carry, scores = carry
                acc, *state, probs = softmax(j, scores, carry, masked)
                more = j + 1 < block.num_steps
                acc, scores = lax.cond(more, pv_then_next_scores, pv_last, j, acc, probs)
                after_values(slot_of(j))
                pl.when(more)(lambda: after_keys(slot_of(j + 1)))
                return acc, *state, scores

            def no_scores():
                zeros = jnp.zeros((block_q, block_k), jnp.float32)
                return with_layout(zeros, plgpu.Layout.WGMMA, interpret)

            reduced = plgpu.Layout.WGMMA.reduce(1)
            carry = (
                with_layout(jnp.zeros((block_q, h), jnp.float32), plgpu.Layout.WGMMA, interpret),
                with_layout(jnp.full((block_q,), _NO_MAX, jnp.float32), reduced, interpret),
                with_layout(jnp.zeros((block_q,), jnp.float32), reduced, interpret),
            )
            walk_step = step
            if turns is not None:  # block 0's scores before the loop, each step issues the next
                walking = block.num_steps > 0
                scores = lax.cond(walking, lambda: scores_of(0), no_scores)
                pl.when(walking)(lambda: after_keys(slot_of(0)))
                carry, walk_step = (*carry, scores), pingpong_step
            unmasked = lambda j, c: walk_step(j, c, masked=False)  # noqa: E731
            carry = lax.fori_loop(0, block.full_steps, unmasked, carry)
            masked = lambda j, c: walk_step(j, c, masked=True)  # noqa: E731
            return lax.fori_loop(block.full_steps, block.num_steps, masked, carry)[:3]

        def finish(block: QueryBlock, acc, row_sum, wait: bool = True):
            """The normalised output block, through the query block's slot, to GMEM (with
            ``wait``, the copy awaited)."""
            # A row with no visible key has acc 0 and sum 0: 0 * 1e30 = 0, never NaN.
            inverse = 1.0 / jnp.maximum(row_sum, 1e-30)
            out = acc * lax.broadcast_in_dim(inverse, acc.shape, [0])
            live = iota((block_q, h), 0, interpret) < block.live_rows
            block.q[...] = jnp.where(live, out, 0.0).astype(dtype)
            plgpu.commit_smem()
            rows = pl.ds(block.q_start, block_q)
            plgpu.copy_smem_to_gmem(block.q, out_gmem.at[block.tile.row, rows, block.tile.head])
            if wait:
                plgpu.wait_smem_to_gmem(0)

        kernels = Walkers(
            tile_of, query_block, fetch_keys, fetch_values, load_queries, walk, finish
        )
        if not consumers:
            _single_warpgroup(query_block(tile_of(None), 0), kernels)
        else:
            _split_queries((k_barriers, v_barriers), released, turns, kernels)

    def _single_warpgroup(block: QueryBlock, kernels: Walkers):
        """One warpgroup issues the copies of block j + stages - 1 at step j, then computes."""
        tile = block.tile

        @pl.when(block.num_steps > 0)
        def _prologue():
            kernels.load_queries(block)
            # Block 0 exists (num_steps > 0), the next ones may not; none past S is traced.
            for ahead in range(min(stages - 1, s // block_k)):

                @pl.when(ahead < block.num_steps)
                def _fetch(ahead=ahead):
                    kernels.fetch_keys(tile, ahead, ahead)
                    kernels.fetch_values(tile, ahead, ahead)

            plgpu.barrier_wait(block.barrier)

        # Block j + stages - 1 goes to the slot step j - 1 read, whose products are complete
        # (the wgmma results were read back into registers).
        def before_step(j):
            @pl.when(j + stages - 1 < block.num_steps)
            def _prefetch():
                slot = lax.rem(j + stages - 1, stages)
                kernels.fetch_keys(tile, j + stages - 1, slot)
                kernels.fetch_values(tile, j + stages - 1, slot)

        acc, _, row_sum = kernels.walk(block, before_step, _nothing, _nothing)
        kernels.finish(block, acc, row_sum)

    def _tiles(kernels: Walkers):
        """The program's tiles: (how many, tile i, its key blocks: the most any of its query
        blocks walks). Round i hands the P programs tiles i P .. i P + P - 1, in turn forward
        and backward (a snake): heavy-first tiles then even out, where plain turns leave
        the first programs ~6% more work (causal S=8192 over 132 programs)."""

        def steps(tile: Tile):
            blocks = [kernels.query_block(tile, c) for c in range(blocks_per_program)]
            return functools.reduce(jnp.maximum, [block.num_steps for block in blocks])

        if programs is None:  # one tile, the program's place in the grid
            return 1, lambda _: kernels.tile_of(None), steps
        program = lax.axis_index("t")
        rounds, rest = divmod(num_tiles, grid_size)

        def place(i):  # program's place in round i
            return jnp.where(lax.rem(i, 2) == 0, program, grid_size - 1 - program)

        count = rounds + (place(rounds) < rest).astype(jnp.int32)

        def tile(i) -> Tile:
            return kernels.tile_of(i * grid_size + place(i))

        return count, tile, steps

    def _produce(released, kernels: Walkers):
        """The producer warpgroup: the program's key blocks, tile after tile, block g (g
        counts the program's blocks) into slot g % stages once the consumers released the
        block ``stages`` before it."""
        keys_released, values_released = released
        if consumers == 2 and not interpret:
            plgpu.set_max_registers(_REGISTERS[0], action="decrease")
        count, tile_at, steps_of = _tiles(kernels)

        def await_release(step, barriers):
            @pl.when(step >= stages)
            def _():
                plgpu.barrier_wait(barriers.at[lax.rem(step, stages)])

        def issue(i, first_step):
            tile = tile_at(i)
            steps = steps_of(tile)

            @pl.loop(0, steps)
            def _issue(j):
                step = first_step + j
                await_release(step, keys_released)
                kernels.fetch_keys(tile, j, lax.rem(step, stages))
                await_release(step, values_released)
                kernels.fetch_values(tile, j, lax.rem(step, stages))

            return first_step + steps

        program_steps = lax.fori_loop(0, count, issue, jnp.int32(0))

        # The last blocks' releases, awaited too: the slots are free when the program ends
        # (and the interpreter checks that a barrier's waiter saw every phase).
        @pl.loop(program_steps, program_steps + stages)
        def _drain(step):
            await_release(step, keys_released)
            await_release(step, values_released)

    def _consume():
        if consumers == 2 and not interpret:
            plgpu.set_max_registers(_REGISTERS[1], action="increase")

    def _split_queries(copied, released, turns, kernels: Walkers):
        """Warpgroups 0..C-1 consume, each its own query block of the tile over every key
        block it sees; warpgroup C produces. A slot is refilled once every consumer released
        it. With persistent programs (two query buffers), a consumer loads its next tile's
        queries while it walks the current one, and its output copy runs under the next."""
        keys_copied, values_copied = copied
        keys_released, values_released = released
        wg = lax.axis_index("wg")
        pl.when(wg == consumers)(lambda: _produce(released, kernels))
        count, tile_at, steps_of = _tiles(kernels)

        def release_unread(slot):
            # Arrivals only count: released before its copy lands, a slot could collect this
            # consumer's arrivals for two blocks while another consumer still reads the first.
            plgpu.barrier_wait(keys_copied.at[slot])
            plgpu.barrier_arrive(keys_released.at[slot])
            plgpu.barrier_wait(values_copied.at[slot])
            plgpu.barrier_arrive(values_released.at[slot])

        def consume_tile(c, i, first_step):
            tile = tile_at(i)
            buffer = lax.rem(i, buffers) if buffers > 1 else 0
            block = kernels.query_block(tile, c, buffer, first_step)
            program_steps = steps_of(tile)
            if buffers == 1:
                # Only for a block that walks keys: loaded and awaited for every block, the
                # one-tile ping-pong kernel measured 30% slower (on the H200; the
                # cause, somewhere in the compiled code, not traced).
                @pl.when(block.num_steps > 0)
                def _():
                    kernels.load_queries(block)
                    plgpu.barrier_wait(block.barrier)

            else:  # the other buffer, once the last output copy read it
                plgpu.barrier_wait(block.barrier)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                @pl.when(i + 1 < count)
                def _():
                    kernels.load_queries(kernels.query_block(tile_at(i + 1), c, 1 - buffer))

            # Ping-pong: consumer 1 starts a turn behind, consumer 0 ends one behind;
            # between, each step hands the turn over twice (after the softmax, after its
            # P V and next QK are issued), so one consumer's softmax runs under the other's
            # GEMMs.
            if turns is not None and c == 1:
                _take_turn(turns)
            acc, _, row_sum = kernels.walk(
                block,
                _nothing,
                lambda slot: plgpu.barrier_arrive(keys_released.at[slot]),
                lambda slot: plgpu.barrier_arrive(values_released.at[slot]),
                turns,
            )

            # Blocks another consumer still reads: released unread, so the producer
            # can refill their slots (and, with ping-pong, their turns passed on).
            @pl.loop(block.num_steps, program_steps)
            def _(j):
                if turns is not None:
                    _take_turn(turns)
                    _take_turn(turns)
                release_unread(lax.rem(first_step + j, stages))

            if turns is not None and c == 0:
                _take_turn(turns)
            kernels.finish(block, acc, row_sum, wait=buffers == 1)
            return first_step + program_steps

        for c in range(consumers):

            @pl.when(wg == c)
            def _consumer(c=c):
                _consume()
                if buffers > 1:  # the first tile's queries
                    pl.when(count > 0)(
                        lambda: kernels.load_queries(kernels.query_block(tile_at(0), c))
                    )
                lax.fori_loop(0, count, functools.partial(consume_tile, c), jnp.int32(0))
                plgpu.wait_smem_to_gmem(0)

    c = blocks_per_program
    scratch = [
        plgpu.SMEM((buffers, c, block_q, h), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_k, h), dtype, transforms=tiled),
        plgpu.SMEM((stages, block_k, h), dtype, transforms=tiled),
        plgpu.SMEM((c, h, block_k), dtype) if interpret else None,
        plgpu.SMEM((c, block_q, block_k), dtype, transforms=tiled) if interpret else None,
        plgpu.Barrier(num_barriers=buffers * c),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
        plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=stages),
    ]
    threads = {}
    if consumers:  # a slot is released by every consumer
        scratch += [plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)] * 2
        threads = {"num_threads": consumers + 1, "thread_name": "wg"}
    if pingpong:  # both consumers arrive at each hand-over
        scratch += [plgpu.Barrier(num_arrivals=2)]
    return shared_kernel(
        plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((b, t, n, h), dtype),
            scratch_types=scratch,
            grid=(n, num_programs_q, b) if programs is None else (grid_size,),
            grid_names=("n", "q", "b") if programs is None else ("t",),
            compiler_params=None if interpret else plgpu.CompilerParams(approx_math=True),
            interpret=interpret_params() if interpret else None,
            **threads,
        )
    )


class Tile(NamedTuple):
    """One program's unit of work: query block ``program_q`` (of C x Q rows) of query head
    ``head`` in batch row ``row``, with the row's lengths."""

    head: jax.Array
    row: jax.Array
    program_q: jax.Array
    kv_head: jax.Array
    q_length: jax.Array
    k_length: jax.Array


class QueryBlock(NamedTuple):
    """One consumer's query block: its tile, index in the program, query buffer, the
    program's count of key blocks before it (its block j sits in slot (first_step + j) %
    stages), first row, live rows, key blocks, and its shared memory (query/output block,
    interpret-mode K^T and P slots) and query-copy barrier."""

    tile: Tile
    index: int
    buffer: object
    first_step: object
    q_start: jax.Array
    live_rows: jax.Array
    full_steps: jax.Array
    num_steps: jax.Array
    q: object
    kt: object
    p: object
    barrier: object


class Walkers(NamedTuple):
    """A program's pieces, shared by its warpgroup arrangements: a tile by its index, a query
    block of a tile, the K and V copies of a tile's key block j into a slot, the query copy,
    the walk over key blocks and the output write."""

    tile_of: Callable
    query_block: Callable
    fetch_keys: Callable
    fetch_values: Callable
    load_queries: Callable
    walk: Callable
    finish: Callable


def _nothing(*_) -> None:
    """A walk hook that does nothing."""


def _take_turn(turns) -> None:
    """Arrives at the ping-pong barrier and waits for the other consumer to arrive too."""
    plgpu.barrier_arrive(turns)
    plgpu.barrier_wait(turns)


def _shared_bytes(
    block_q: int,
    block_k: int,
    h: int,
    stages: int,
    consumers: int,
    persistent: bool,
    dtype: jnp.dtype,
) -> int:
    """Shared memory of one program on the GPU: its query blocks (two buffers of them when
    persistent) and the K/V slots."""
    size = jnp.dtype(dtype).itemsize
    query_rows = (1 + persistent) * max(consumers, 1) * block_q
    return (query_rows + 2 * stages * block_k) * h * size


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
