"""Attention dispatch: which implementation runs each call, as ``KernelOptions`` say.

The jnp reference (``spark_jax.ops.reference``) runs anywhere; cuDNN (``spark_jax.ops.cudnn``)
takes a decode step on the GPU; our one-query kernel an MHA decode step over a short cache on
the GPU (``one_query_picked``); our flash kernel a prefill on Hopper
(``KernelOptions.flash_prefill``); our decode kernels run on request
(``KernelOptions(implementation="pallas")``). Models attend over their cache with
``cache_attention``: on the GPU a decode step over a paged cache reads the pages in place
(cuDNN's paged attention, or our paged kernel where cuDNN's does not apply: ``paged_kernel``);
elsewhere the rows are read out first. ``cache_step_attention``
writes the step's keys first (in the one-query kernel itself where it runs) and can read rows
through a row table (beam search).

An fp8 cache (``kv_cache.is_narrow``): a decode step can read the E4M3 pages in place with our
Triton kernel (``scaled_paged_picked``: ``KernelOptions.pallas_fp8_cache`` on the GPU, or
``implementation="pallas"``); every other path reads the rows out dequantized, XLA fusing the
dequantization into the attention's reads; a decode step on the GPU then takes XLA's split-K
form (it reads K and V once in place; the reference's batched dots copy them transposed).

The options are plain arguments of every entry point, static under jit: a model passes its own
to each step, so two models with different options trace and compile their own programs.

Axes: B batch, T query length, S key length, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from spark_jax.ops.cudnn import (
    cudnn_decode_applies,
    cudnn_decode_attention,
    cudnn_paged_applies,
    cudnn_paged_decode_attention,
)
from spark_jax.ops.kv_cache import (
    PagedLayer,
    ScaledLayer,
    is_narrow,
    narrow_pages,
    read_rows,
    read_through,
    write_kv,
)
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask, reference_attention, split_kv_attention
from spark_jax.ops.sharding import TP_AXIS

# ---------------------------------------------------------------------------------------------
# Tensor parallelism: with ``options.mesh`` the entry points below run per shard under
# ``shard_map``, each device attending with its own heads through the same dispatch.

_BY_HEADS = PartitionSpec(None, None, TP_AXIS, None)  # [B, T | S | L, N | K, H]
_WHOLE = PartitionSpec()


def _cache_spec(cache: jax.Array | ScaledLayer | PagedLayer) -> Any:
    """A cache layer split by its KV heads (its scales with them; tables whole)."""
    if isinstance(cache, PagedLayer):
        scale = None if cache.scale is None else PartitionSpec(TP_AXIS)
        return PagedLayer(_BY_HEADS, _WHOLE, scale)
    if isinstance(cache, ScaledLayer):
        return ScaledLayer(_BY_HEADS, PartitionSpec(TP_AXIS))
    return _BY_HEADS


def _per_shard(
    fn: Callable[..., Any], options: KernelOptions, args: tuple, specs: tuple, out_specs: Any
) -> Any:
    """``fn(*args, options)`` on every device of ``options.mesh`` with its shard of each
    argument (``specs``), the options' mesh cleared inside."""
    inner = dataclasses.replace(options, mesh=None)
    mapped = jax.shard_map(
        lambda *a: fn(*a, inner),
        mesh=options.mesh,
        in_specs=specs,
        out_specs=out_specs,
        check_vma=False,  # custom calls (our kernels, cuDNN's) declare no replication
    )
    return mapped(*args)


def _sharded(options: KernelOptions) -> bool:
    return options.mesh is not None and options.implementation != "xla"


def cache_step_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array | PagedLayer,
    v_cache: jax.Array | PagedLayer,
    slots: jax.Array | None,
    positions: jax.Array,
    mask: AttentionMask,
    row_table: jax.Array | None = None,
    sliding_window: int | None = None,
    options: KernelOptions = KernelOptions(),
) -> tuple[jax.Array, jax.Array | PagedLayer, jax.Array | PagedLayer]:
    """Writes the step's k/v [B,T,K,H] at ``positions`` [B,T] of rows ``slots`` (all rows if
    None), then attends q over the rows as ``cache_attention``: (out, k_cache, v_cache).

    ``row_table`` int32[B, S] (a dense cache, every row in order): row b reads position t from
    cache row ``row_table[b, t]`` (beam search moves this table, not the rows). Where the
    one-query kernel takes the step (one token per row, every row in order, a dense MHA cache:
    ``one_query_picked``) the write and the attention are one kernel; each row then sees its
    own new key even where the mask hides it (an inactive row, whose output no caller reads).
    """
    if _sharded(options):
        step = lambda q, k, v, kc, vc, sl, pos, m, rt, o: cache_step_attention(
            q, k, v, kc, vc, sl, pos, m, rt, sliding_window, o
        )
        args = (q, k, v, k_cache, v_cache, slots, positions, mask, row_table)
        caches = (_cache_spec(k_cache), _cache_spec(v_cache))
        specs = (_BY_HEADS,) * 3 + caches + (_WHOLE,) * 4
        return _per_shard(step, options, args, specs, (_BY_HEADS, *caches))
    dense = not isinstance(k_cache, PagedLayer) and not is_narrow(k_cache)
    if dense and slots is None and one_query_picked(q, k_cache, sliding_window, options):
        return _one_query(q, k_cache, v_cache, positions[:, 0], k, v, row_table)
    k_cache = write_kv(k_cache, k, slots, positions)
    v_cache = write_kv(v_cache, v, slots, positions)
    if row_table is None:
        out = cache_attention(q, k_cache, v_cache, slots, mask, sliding_window, options)
        return out, k_cache, v_cache
    keys, values = read_through(k_cache, row_table), read_through(v_cache, row_table)
    return attention(q, keys, values, mask, sliding_window, options=options), k_cache, v_cache


def packed_cache_step_attention(
    qkv: jax.Array,
    k_cache: jax.Array | PagedLayer,
    v_cache: jax.Array | PagedLayer,
    slots: jax.Array | None,
    positions: jax.Array,
    mask: AttentionMask,
    row_table: jax.Array | None = None,
    sliding_window: int | None = None,
    options: KernelOptions = KernelOptions(),
) -> tuple[jax.Array, jax.Array | PagedLayer, jax.Array | PagedLayer]:
    """``cache_step_attention`` of a fused projection's output: qkv [B,T,3N,H] holds the
    queries, keys and values side by side (MHA). The one-query kernel reads them in place,
    elsewhere they are split. (On the H200 this did not cut a kernel: the split-K reduction
    that wrote the three slices now writes qkv with its bias.)"""
    q, k, v = jnp.split(qkv, 3, axis=2)
    dense = not isinstance(k_cache, PagedLayer) and not is_narrow(k_cache)
    if dense and slots is None and one_query_picked(q, k_cache, sliding_window, options):
        return _one_query(qkv, k_cache, v_cache, positions[:, 0], None, None, row_table, None, True)
    return cache_step_attention(
        q, k, v, k_cache, v_cache, slots, positions, mask, row_table, sliding_window, options
    )


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array | PagedLayer,
    v_cache: jax.Array | PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
    sliding_window: int | None = None,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """Attention of q [B,T,N,H] over the cache rows ``slots`` (all rows if None).

    A paged step reads the pages in place where ``paged_kernel`` names a kernel; everything
    else reads the rows out (a view of a dense cache, a gather of a paged one) and goes
    through ``attention``.
    """
    if _sharded(options):
        read = lambda q, kc, vc, sl, m, o: cache_attention(q, kc, vc, sl, m, sliding_window, o)
        args = (q, k_cache, v_cache, slots, mask)
        specs = (_BY_HEADS, _cache_spec(k_cache), _cache_spec(v_cache), _WHOLE, _WHOLE)
        return _per_shard(read, options, args, specs, _BY_HEADS)
    if is_narrow(k_cache):
        if scaled_paged_picked(q, k_cache, sliding_window, options):
            return scaled_paged_attention(q, k_cache, v_cache, slots, mask)
        keys, values = read_rows(k_cache, slots), read_rows(v_cache, slots)
        return narrow_cache_attention(q, keys, values, mask, sliding_window, options)
    kernel = paged_kernel(q, k_cache, sliding_window, options)
    if kernel == "pallas":
        return pallas_paged_attention(q, k_cache, v_cache, slots, mask, options=options)
    if kernel == "cudnn":
        return cudnn_paged_decode_attention(q, k_cache, v_cache, slots, mask)
    if kernel == "flash":
        return pallas_paged_prefill_attention(q, k_cache, v_cache, slots, mask)
    keys, values = read_rows(k_cache, slots), read_rows(v_cache, slots)
    return attention(q, keys, values, mask, sliding_window, options=options)


def paged_kernel(
    q: jax.Array | jax.ShapeDtypeStruct,
    k_cache: Any,
    sliding_window: int | None = None,
    options: KernelOptions = KernelOptions(),
) -> str | None:
    """The kernel that reads a paged cache in place for ``cache_attention`` of ``q``:
    "cudnn", "pallas", "flash" (our flash kernel for a chunk of queries, as a prefill over
    gathered rows runs it), or None where the rows are gathered first (not a paged cache, or
    no kernel takes the call).

    ``implementation="pallas"`` takes our paged kernels wherever they run, "cudnn" cuDNN's
    paged decode attention. The default dispatch takes cuDNN's where it applies and, for a
    one-token step on Hopper where it does not, ours: cuDNN needs a pool of at least rows x
    table-width pages, which an 80 GB H100's pool beside Llama-3-8B is not at 256 rows. There
    the gathered rows made the engine's 256-row decode step 39.1 ms against our kernel's
    12.7; at 64 and 128 rows cuDNN's was the faster (7.26 / 8.52 ms against 7.79 / 9.51).
    A chunk of queries (the engine's prefills, which append to their rows' pages) on Hopper
    takes the flash kernel over the pages in place under ``options.paged_flash_prefill``,
    where it would otherwise run over a gathered copy of every row's pages.
    """
    if not isinstance(k_cache, PagedLayer):
        return None
    implementation = options.implementation
    if implementation == "pallas" and pallas_paged_applies(q, k_cache, sliding_window):
        return "pallas"
    if implementation in (None, "cudnn") and cudnn_paged_applies(
        q, k_cache, q.shape[0], sliding_window
    ):
        return "cudnn"
    if (
        implementation is None
        and q.shape[1] == 1
        and _pallas_compiles(q)
        and pallas_paged_applies(q, k_cache, sliding_window)
    ):
        return "pallas"
    if (
        implementation is None
        and options.flash_prefill
        and options.paged_flash_prefill
        and _pallas_compiles(q)
        and pallas_paged_prefill_applies(q, k_cache, sliding_window)
    ):
        return "flash"
    return None


_SPLIT_CHUNK = 256  # keys per chunk of XLA's split-K form


def scaled_paged_picked(
    q: jax.Array,
    k_cache: ScaledLayer | PagedLayer,
    sliding_window: int | None,
    options: KernelOptions,
) -> bool:
    """Our kernel reads an fp8 cache in place: a one-token step without a window, on the GPU
    under ``options.pallas_fp8_cache``, and wherever ``implementation="pallas"`` (interpreted
    off the GPU)."""
    from pallas_kernels.scaled_paged_attention import scaled_paged_attention_applies

    wanted = options.implementation == "pallas" or (
        options.implementation is None
        and options.pallas_fp8_cache
        and jax.default_backend() == "gpu"
    )
    if not wanted or sliding_window is not None:
        return False
    view = narrow_pages(k_cache, None)
    return view is not None and scaled_paged_attention_applies(q, view[0])


def scaled_paged_attention(
    q: jax.Array,
    k_cache: ScaledLayer | PagedLayer,
    v_cache: ScaledLayer | PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
) -> jax.Array:
    """q [B,1,N,H] over the fp8 rows ``slots`` read in place by our kernel (interpreted off
    the GPU). A dense cache's rows are cut into pages that follow one another, so the kernel
    takes each row's page ids from its first entry (``consecutive_pages``)."""
    from pallas_kernels.scaled_paged_attention import scaled_paged_attention as kernel

    k_pages, table, k_scale = narrow_pages(k_cache, slots)
    v_pages, _, v_scale = narrow_pages(v_cache, slots)
    lengths = _one_query_lengths(mask)
    interpret = jax.default_backend() != "gpu"
    return kernel(
        q,
        k_pages,
        v_pages,
        k_scale,
        v_scale,
        table,
        lengths,
        consecutive_pages=isinstance(k_cache, ScaledLayer),
        interpret=interpret,
    )


def narrow_cache_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """Attention over rows read out of an fp8 cache (k/v dequantized lazily, [B,S,K,H]).

    A one-token step on the GPU runs XLA's split-K form where the keys split into its chunks,
    so XLA fuses the dequantization into one read of the E4M3 rows; everything else (and
    ``implementation="xla"``) runs the reference.
    """
    split = (
        options.implementation != "xla"
        and jax.default_backend() == "gpu"
        and q.shape[1] == 1
        and k.shape[1] % _SPLIT_CHUNK == 0
    )
    if split:
        return split_kv_attention(q, k, v, mask, sliding_window, chunk=_SPLIT_CHUNK)
    return reference_attention(q, k, v, mask, sliding_window)


# ---------------------------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernels. The default dispatch can run the flash kernel for prefill on
# Hopper (``KernelOptions.flash_prefill``); the decode kernels run on request
# (``KernelOptions(implementation="pallas")``): against cuDNN in the same H200 runs they are
# 0.95-1.13x (dense) and 1.05x (paged), within the device's noise.

_PALLAS_CHUNKS = (256, 128, 64)  # keys per program, largest first


def pallas_decode_applies(
    q: jax.Array, k: jax.Array, mask: AttentionMask, sliding_window: int | None
) -> bool:
    """True where the split-K kernel runs: T*G <= 64 query rows per kv head, no window, head
    dim a multiple of 64, S a multiple of 64; bf16/f16 on Hopper, or the CPU interpreter."""
    from pallas_kernels.decode_attention import decode_attention_applies

    del mask  # any positions and lengths: causality is per query row in the kernel
    if not _pallas_runs(q):
        return False
    return any(decode_attention_applies(q, k, c, sliding_window) for c in _PALLAS_CHUNKS)


def pallas_decode_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    scale: float | None = None,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] with our kernels (interpreted off the GPU): the flash
    walk for a one-token step over at least ``options.flash_decode_min_programs`` (row, kv
    head) programs, else the split-K kernel."""
    from pallas_kernels.decode_attention import decode_attention, decode_attention_applies
    from pallas_kernels.flash_attention import flash_decode_applies, flash_decode_attention

    interpret = jax.default_backend() != "gpu"
    many_programs = q.shape[0] * k.shape[2] >= options.flash_decode_min_programs
    if many_programs and flash_decode_applies(q, k):
        lengths = _one_query_lengths(mask)
        return flash_decode_attention(q, k, v, lengths, scale, interpret=interpret)
    chunk = next(c for c in _PALLAS_CHUNKS if decode_attention_applies(q, k, c))
    positions = mask.query_positions if mask.causal else None
    return decode_attention(
        q, k, v, mask.key_lengths, positions, scale, chunk=chunk, interpret=interpret
    )


def pallas_prefill_applies(q: jax.Array, k: jax.Array, sliding_window: int | None) -> bool:
    """True where the flash-attention kernel runs: no window, T and S multiples of its blocks,
    head dim 64 or 128; bf16/f16 on Hopper, or the CPU interpreter."""
    from pallas_kernels.flash_attention import flash_attention_applies

    if not _pallas_runs(q):
        return False
    return sliding_window is None and flash_attention_applies(q, k)


def pallas_prefill_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, scale: float | None = None
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] with the flash-attention kernel (interpreted off the GPU).

    The models' masks put query t of row b at ``query_positions[b, 0] + t`` and its keys below
    ``key_lengths[b]``: the kernel's convention with ``key_lengths - query_positions[:, 0]``
    real queries (the rest is padding, whose output is zeros). Without causality the queries'
    positions do not matter: every query is real.
    """
    from pallas_kernels.flash_attention import flash_attention, prefill_tuning

    interpret = jax.default_backend() != "gpu"
    return flash_attention(
        q,
        k,
        v,
        _flash_query_lengths(mask, q.shape[1]),
        mask.key_lengths,
        causal=mask.causal,
        scale=scale,
        interpret=interpret,
        **prefill_tuning(q, k, interpret),
    )


def _flash_query_lengths(mask: AttentionMask, t: int) -> jax.Array:
    """The flash kernel's real queries per row of a model's mask (``pallas_prefill_attention``)."""
    if mask.causal:
        return jnp.clip(mask.key_lengths - mask.query_positions[:, 0], 0, t)
    return jnp.full_like(mask.key_lengths, t)


def _paged_rows(q: jax.Array, k_cache: PagedLayer) -> jax.ShapeDtypeStruct:
    """The [B, S, K, H] rows the flash kernel sees in a page pool read in place: the block
    table's pages, in whole key blocks (``flash_attention`` with ``block_table``)."""
    from pallas_kernels.flash_attention import default_block_k

    pages, width = k_cache.pages, k_cache.block_table.shape[1]
    keys = width * k_cache.page_size
    block_k = default_block_k(q.shape[3], keys)
    keys = -(-keys // block_k) * block_k
    return jax.ShapeDtypeStruct((q.shape[0], keys, *pages.shape[2:]), pages.dtype)


def pallas_paged_prefill_applies(
    q: jax.Array | jax.ShapeDtypeStruct, k_cache: PagedLayer, sliding_window: int | None
) -> bool:
    """True where the flash kernel reads a page pool in place for a chunk of queries (T > 1):
    its constraints over the rows the pages make up, with pages a multiple of 8 keys that
    divide its key blocks; bf16/f16 on Hopper, or the CPU interpreter."""
    from pallas_kernels.flash_attention import (
        default_block_k,
        flash_attention_applies,
        prefill_tuning,
    )

    if q.shape[1] < 2 or sliding_window is not None or not _pallas_runs(q):
        return False
    rows = _paged_rows(q, k_cache)
    interpret = jax.default_backend() != "gpu"
    tuned = prefill_tuning(q, rows, interpret).get("block_k")
    block_k = tuned or default_block_k(q.shape[3], rows.shape[1])
    page = k_cache.page_size
    return (
        flash_attention_applies(q, rows, block_k=block_k) and page % 8 == 0 and block_k % page == 0
    )


def pallas_paged_prefill_attention(
    q: jax.Array,
    k_cache: PagedLayer,
    v_cache: PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
    scale: float | None = None,
) -> jax.Array:
    """q [B,T,N,H], a chunk of queries per row, over the pages of rows ``slots`` with the flash
    kernel reading the pool in place (a TMA copy per page into each key block): the gather of
    every row's pages into a dense copy, which the kernel would then read again, is skipped.
    The same kernel and tuning as ``pallas_prefill_attention`` over the gathered rows."""
    from pallas_kernels.flash_attention import flash_attention, prefill_tuning

    interpret = jax.default_backend() != "gpu"
    return flash_attention(
        q,
        k_cache.pages,
        v_cache.pages,
        _flash_query_lengths(mask, q.shape[1]),
        mask.key_lengths,
        causal=mask.causal,
        scale=scale,
        block_table=k_cache.table_rows(slots),
        interpret=interpret,
        **prefill_tuning(q, _paged_rows(q, k_cache), interpret),
    )


# Queries per attention row of a ragged prefill's block layout: the tuned prefill kernel's
# rows per tile (``prefill_tuning``: two consumer warpgroups of 64), so each row is one tile
# of the persistent kernel and every layout meets the tuning's multiple of 128.
RAGGED_QUERY_BLOCK = 128


def ragged_query_block(
    num_tokens: int,
    num_rows: int,
    q_heads: int,
    head_dim: int,
    dtype: Any,
    k_cache: Any,
    windowed: bool,
    options: KernelOptions = KernelOptions(),
) -> int | None:
    """The queries per attention row of a ragged prefill of ``num_tokens`` over ``num_rows``
    rows appending to ``k_cache`` (``options.ragged_query_blocks``): the option's where it
    gives one, else ``RAGGED_QUERY_BLOCK`` where the flash kernel reads the pages in place
    for that layout (no layer ``windowed``); None: one row per chunk, as long as the
    stream."""
    if options.ragged_query_blocks is not None:
        return options.ragged_query_blocks or None
    paged = isinstance(k_cache, PagedLayer) and not is_narrow(k_cache)  # bf16/f16 pages
    if windowed or options.mesh is not None or not paged:
        return None
    block = RAGGED_QUERY_BLOCK
    rows = (num_tokens + num_rows * (block - 1)) // block
    q = jax.ShapeDtypeStruct((rows, block, q_heads, head_dim), dtype)
    in_place = dataclasses.replace(options, paged_flash_prefill=True)
    return block if paged_kernel(q, k_cache, None, in_place) == "flash" else None


_PAGED_CHUNKS = (256, 128, 64)  # keys per program of the paged kernel, largest first


def pallas_paged_applies(q: jax.Array, k_cache: PagedLayer, sliding_window: int | None) -> bool:
    """True where the Pallas paged kernel runs (its constraints as the split-K kernel's, plus
    a page size dividing the chunk); bf16/f16 on Hopper, or the CPU interpreter."""
    from pallas_kernels.paged_attention import paged_attention_applies

    if not _pallas_runs(q):
        return False
    return any(paged_attention_applies(q, k_cache.pages, c, sliding_window) for c in _PAGED_CHUNKS)


def pallas_paged_attention(
    q: jax.Array,
    k_cache: PagedLayer,
    v_cache: PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
    scale: float | None = None,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """q [B,T,N,H] over the pages of rows ``slots`` with our kernels, in place: the flash
    walk for a one-token step over many rows (as ``pallas_decode_attention``; its copies
    tuned by ``options.paged_walk_stages`` and ``paged_walk_consumers``), else the split-K
    paged kernel."""
    from pallas_kernels.flash_attention import flash_decode_applies, flash_decode_attention
    from pallas_kernels.paged_attention import paged_attention, paged_attention_applies

    interpret = jax.default_backend() != "gpu"
    many_programs = q.shape[0] * k_cache.pages.shape[2] >= options.flash_decode_min_programs
    if many_programs and flash_decode_applies(q, k_cache.pages, paged=True):
        tuning = {"stages": options.paged_walk_stages, "consumers": options.paged_walk_consumers}
        return flash_decode_attention(
            q,
            k_cache.pages,
            v_cache.pages,
            _one_query_lengths(mask),
            scale,
            block_table=k_cache.table_rows(slots),
            interpret=interpret,
            **({} if interpret else tuning),
        )
    chunk = next(c for c in _PAGED_CHUNKS if paged_attention_applies(q, k_cache.pages, c))
    return paged_attention(
        q,
        k_cache.pages,
        v_cache.pages,
        k_cache.table_rows(slots),
        mask.key_lengths,
        mask.query_positions if mask.causal else None,
        scale,
        chunk=chunk,
        interpret=interpret,
    )


def one_query_picked(
    q: jax.Array,
    k: jax.Array,
    sliding_window: int | None,
    options: KernelOptions = KernelOptions(),
) -> bool:
    """True where the dispatch runs the one-query kernel (``pallas_kernels/
    one_query_attention.py``, Triton): one query per row of an MHA model over at most
    ``options.one_query_max_keys`` positions, no window, for ``options.implementation`` None
    on a GPU (bf16/f16) or "pallas" (interpreted off the GPU)."""
    from pallas_kernels.one_query_attention import one_query_attention_applies

    if sliding_window is not None or k.shape[1] > options.one_query_max_keys:
        return False
    if not one_query_attention_applies(q, k):
        return False
    implementation = options.implementation
    on_gpu = jax.default_backend() == "gpu"
    half = q.dtype in (jnp.bfloat16, jnp.float16)
    if implementation == "pallas":
        return not on_gpu or half
    return implementation is None and on_gpu and half


def _one_query(
    q, k_cache, v_cache, lengths, k_new=None, v_new=None, row_table=None, scale=None, packed=False
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    from pallas_kernels.one_query_attention import one_query_attention

    interpret = jax.default_backend() != "gpu"
    return one_query_attention(
        q,
        k_cache,
        v_cache,
        lengths,
        k_new,
        v_new,
        row_table,
        scale,
        packed=packed,
        interpret=interpret,
    )


def _one_query_lengths(mask: AttentionMask) -> jax.Array:
    """Each row's visible keys for one query per row: causality only shortens the row."""
    if not mask.causal:
        return mask.key_lengths
    return jnp.minimum(mask.key_lengths, mask.query_positions[:, 0] + 1)


def _pallas_runs(q: jax.Array) -> bool:
    """Our Mosaic GPU kernels run here: bf16/f16 on a Hopper GPU, or any float interpreted."""
    return jax.default_backend() != "gpu" or _pallas_compiles(q)


def _pallas_compiles(q: jax.Array) -> bool:
    """Our Mosaic GPU kernels compile for this device and dtype: bf16/f16 on Hopper."""
    return (
        jax.default_backend() == "gpu" and _is_hopper() and q.dtype in (jnp.bfloat16, jnp.float16)
    )


def _is_hopper() -> bool:
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


# ---------------------------------------------------------------------------------------------
# The entry point.


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """The attention entry point of every model; picks the implementation for the backend.

    ``options.implementation`` None picks: the one-query kernel for an MHA decode step over a
    short cache on the GPU, cuDNN for any other decode step on the GPU, our flash kernel for
    a prefill on Hopper where it applies if ``options.flash_prefill`` (measured on the H200,
    causal GQA 32/8: 359 TFLOP/s at S=8192 and 262 at S=2048 against the reference's 47 and
    43), else the reference; "xla" forces the reference, "cudnn" and "pallas" force those
    kernels and raise where they do not apply.
    """
    if _sharded(options):
        attend = lambda q, k, v, m, o: attention(q, k, v, m, sliding_window, scale, o)
        specs = (_BY_HEADS,) * 3 + (_WHOLE,)
        return _per_shard(attend, options, (q, k, v, mask), specs, _BY_HEADS)
    implementation = options.implementation
    picked = one_query_picked(q, k, sliding_window, options)
    if implementation in (None, "pallas") and picked:
        return _one_query(q, k, v, _one_query_lengths(mask), scale=scale)[0]
    if implementation is None:
        if cudnn_decode_applies(q, k, sliding_window):
            return cudnn_decode_attention(q, k, v, mask, scale)
        if (
            options.flash_prefill
            and q.shape[1] > 1
            and _pallas_compiles(q)
            and pallas_prefill_applies(q, k, sliding_window)
        ):
            return pallas_prefill_attention(q, k, v, mask, scale)
        return reference_attention(q, k, v, mask, sliding_window, scale)
    if implementation == "xla":
        return reference_attention(q, k, v, mask, sliding_window, scale)
    if implementation == "cudnn":
        if not cudnn_decode_applies(q, k, sliding_window):
            raise ValueError(
                "implementation='cudnn' needs one bf16/f16 query per row on a GPU and no "
                "sliding window; use KernelOptions(implementation=None) to let the dispatch "
                "choose."
            )
        return cudnn_decode_attention(q, k, v, mask, scale)
    # "pallas" (KernelOptions validated the name)
    if pallas_decode_applies(q, k, mask, sliding_window):
        return pallas_decode_attention(q, k, v, mask, scale, options)
    if pallas_prefill_applies(q, k, sliding_window):
        return pallas_prefill_attention(q, k, v, mask, scale)
    raise ValueError(
        "implementation='pallas' needs no sliding window, bf16/f16 on Hopper, and either "
        "T*G <= 64 query rows per kv head with head dim and key length multiples of 64 "
        "(decode) or T and S multiples of 64 with head dim 64 or 128 (flash prefill); use "
        "KernelOptions(implementation=None) to let the dispatch choose."
    )
