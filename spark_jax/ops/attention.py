"""Attention dispatch: the jnp reference (any backend), cuDNN for decode on GPU, our one-query
kernel for an MHA decode step over a short cache on GPU (``one_query_picked``), our flash
kernel for prefill on Hopper (``FLASH_PREFILL_BY_DEFAULT``), and our decode kernels on request.

Every caller describes what it wants with an ``AttentionMask`` of positions and lengths; the
mask itself is built here, once, so the model files never build masks by hand. Models attend
over their cache with ``cache_attention``: on the GPU a decode step over a paged cache reads
the pages in place (cuDNN's paged attention); elsewhere the rows are read out first.
``cache_step_attention`` writes the step's keys first (in the one-query kernel itself where
it runs) and can read rows through a row table (beam search).

Axes: B batch, T query length, S key length, N query heads, K kv heads, G = N / K, H head dim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from spark_jax.ops.kv_cache import PagedLayer, read_rows, read_through, write_kv

_MASKED = -1e30  # finite, so a fully masked (padding) row gives a uniform softmax, not NaN


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["query_positions", "key_lengths"],
    meta_fields=["causal"],
)
@dataclass(frozen=True)
class AttentionMask:
    """Which keys each query may see.

    A key at position s is visible to the query at position p when s < key_lengths[b] and,
    if causal, s <= p, and, with a sliding window w, s > p - w.
    """

    query_positions: jax.Array  # int32[B, T]
    key_lengths: jax.Array  # int32[B]
    causal: bool = True

    def dense(self, num_keys: int, sliding_window: int | None = None) -> jax.Array:
        """bool[B, T, S]."""
        keys = jnp.arange(num_keys)[None, None, :]
        visible = keys < self.key_lengths[:, None, None]
        q = self.query_positions[:, :, None]
        if self.causal:
            visible &= keys <= q
        if sliding_window is not None:
            visible &= keys > q - sliding_window
        return visible


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention in fp32: q [B,T,N,H], k/v [B,S,K,H] -> [B,T,N,H] in q's dtype."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask.dense(k.shape[1], sliding_window)[:, None, None, :, :]
    scores = jnp.where(visible, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum(
        "bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype)


def split_kv_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
    chunk: int = 256,
) -> jax.Array:
    """Flash-decoding in plain XLA: keys in chunks, a partial softmax per chunk, then a merge.

    For few query rows (decode at small batch) the reference's batched dots have only B*K
    independent products to spread over the GPU; here every (chunk, key, head) is its own
    work item, and each product is an elementwise multiply-reduce that reads K and V once,
    in place, with no transposed copy of the cache. Needs S to be a multiple of ``chunk``.
    """
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    c, g = s // chunk, n // kv_heads
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, 1, 1, kv_heads, g, h).astype(jnp.float32) * scale
    kc = k.reshape(b, 1, c, chunk, kv_heads, 1, h)
    vc = v.reshape(b, 1, c, chunk, kv_heads, 1, h)
    visible = mask.dense(s, sliding_window).reshape(b, t, c, chunk, 1, 1)
    scores = jnp.sum(qg * kc.astype(jnp.float32), axis=-1)  # [B, T, C, L, K, G]
    scores = jnp.where(visible, scores, _MASKED)
    chunk_max = jnp.max(scores, axis=3)  # [B, T, C, K, G]
    probs = jnp.where(visible, jnp.exp(scores - chunk_max[:, :, :, None]), 0.0)
    chunk_sum = jnp.sum(probs, axis=3)
    chunk_out = jnp.sum(probs[..., None] * vc.astype(jnp.float32), axis=3)  # [B,T,C,K,G,H]
    weight = jnp.exp(chunk_max - jnp.max(chunk_max, axis=2, keepdims=True))
    total = jnp.sum(weight * chunk_sum, axis=2)  # [B, T, K, G]
    out = jnp.sum(weight[..., None] * chunk_out, axis=2) / jnp.maximum(total, 1e-30)[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)


def cudnn_decode_applies(q: jax.Array, k: jax.Array, sliding_window: int | None) -> bool:
    """True for one query per row, no window, bf16/f16 operands, on a GPU backend."""
    return (
        q.shape[1] == 1
        and sliding_window is None
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and k.dtype == q.dtype
        and jax.default_backend() == "gpu"
    )


def cudnn_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, scale: float | None = None
) -> jax.Array:
    """q [B,1,N,H] over k/v [B,S,K,H] with cuDNN's fused attention, keys < key_lengths[b].

    Only for a query at or past its row's last visible key (the decode step): causality then
    adds nothing to the length mask. XLA's reference makes a transposed copy of every layer's
    K and V (and copies them back) when B > 1, 5x the cache bytes per step; cuDNN reads them
    once in place. Measured on the H200, Llama-3-8B shapes, whole decode step, context 2k:
    bs=64 29.0 -> 8.85 ms (25% -> 83% of the HBM floor), bs=1 at 4k 5.15 -> 4.94 ms.
    """
    lengths = jnp.maximum(mask.key_lengths, 1)  # an idle row of length 0 would divide by zero
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=lengths, implementation="cudnn"
    )


def cudnn_paged_applies(
    q: jax.Array, k_cache: PagedLayer, rows: int, sliding_window: int | None
) -> bool:
    """True where cuDNN's paged attention takes this decode step (see ``cudnn_page_table``):
    the dense decode conditions, and a pool that splits evenly into ``rows`` tables at least
    as wide as the block table."""
    num_pages = k_cache.pages.shape[0]
    return (
        cudnn_decode_applies(q, k_cache.pages, sliding_window)
        and num_pages % rows == 0
        and num_pages // rows >= k_cache.block_table.shape[1]
    )


def cudnn_page_table(table: jax.Array, num_pages: int) -> jax.Array:
    """The block table ``int32[B, W]`` as cuDNN's page table ``int32[B, 1, P / B, 1]``.

    JAX's cuDNN binding requires the pool's page count to equal B times the table's width, so
    each row's table is padded to ``P / B`` entries. Padding and the pages a row does not own
    (``num_pages``, out of range) become page 0: they lie past the row's length, never read.
    """
    b, width = table.shape
    table = jnp.where(table < num_pages, table, 0)
    table = jnp.pad(table, ((0, 0), (0, num_pages // b - width)))
    return table[:, None, :, None]


def cudnn_paged_decode_attention(
    q: jax.Array,
    k_cache: PagedLayer,
    v_cache: PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
    scale: float | None = None,
) -> jax.Array:
    """q [B,1,N,H] over the pages of rows ``slots`` (all rows if None), keys < key_lengths[b].

    Reads each row's pages in place: no ``[B, S, K, H]`` copy of the rows. The gather it
    replaces writes and reads every row's whole table width per layer, which made a 128-row
    decode step of the batching engine cost ~2-3x its weight reads on the H200.
    """
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, paged_attention

    b, _, _, h = q.shape
    table = cudnn_page_table(k_cache.table_rows(slots), k_cache.pages.shape[0])
    lengths = jnp.maximum(mask.key_lengths, 1)  # an idle row of length 0 would divide by zero
    return paged_attention(
        q,
        k_cache.pages,
        v_cache.pages,
        jnp.ones((b,), jnp.int32),
        lengths.astype(jnp.int32),
        table,
        table,
        scale=h**-0.5 if scale is None else scale,
        mask_type=MaskType.PADDING,
    )


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
) -> tuple[jax.Array, jax.Array | PagedLayer, jax.Array | PagedLayer]:
    """Writes the step's k/v [B,T,K,H] at ``positions`` [B,T] of rows ``slots`` (all rows if
    None), then attends q over the rows as ``cache_attention``: (out, k_cache, v_cache).

    ``row_table`` int32[B, S] (a dense cache, every row in order): row b reads position t from
    cache row ``row_table[b, t]`` (beam search moves this table, not the rows). Where the
    one-query kernel takes the step (one token per row, every row in order, a dense MHA cache:
    ``one_query_picked``) the write and the attention are one kernel; each row then sees its
    own new key even where the mask hides it (an inactive row, whose output no caller reads).
    """
    dense = not isinstance(k_cache, PagedLayer)
    if dense and slots is None and one_query_picked(q, k_cache, sliding_window):
        return _one_query(q, k_cache, v_cache, positions[:, 0], k, v, row_table)
    k_cache = write_kv(k_cache, k, slots, positions)
    v_cache = write_kv(v_cache, v, slots, positions)
    if row_table is None:
        return cache_attention(q, k_cache, v_cache, slots, mask, sliding_window), k_cache, v_cache
    keys, values = read_through(k_cache, row_table), read_through(v_cache, row_table)
    return attention(q, keys, values, mask, sliding_window), k_cache, v_cache


def packed_cache_step_attention(
    qkv: jax.Array,
    k_cache: jax.Array | PagedLayer,
    v_cache: jax.Array | PagedLayer,
    slots: jax.Array | None,
    positions: jax.Array,
    mask: AttentionMask,
    row_table: jax.Array | None = None,
    sliding_window: int | None = None,
) -> tuple[jax.Array, jax.Array | PagedLayer, jax.Array | PagedLayer]:
    """``cache_step_attention`` of a fused projection's output: qkv [B,T,3N,H] holds the
    queries, keys and values side by side (MHA). The one-query kernel reads them in place,
    elsewhere they are split. (On the H200 this did not cut a kernel: the split-K reduction
    that wrote the three slices now writes qkv with its bias; run b6 in BENCHMARKS.md.)"""
    q, k, v = jnp.split(qkv, 3, axis=2)
    dense = not isinstance(k_cache, PagedLayer)
    if dense and slots is None and one_query_picked(q, k_cache, sliding_window):
        return _one_query(qkv, k_cache, v_cache, positions[:, 0], None, None, row_table, None, True)
    return cache_step_attention(
        q, k, v, k_cache, v_cache, slots, positions, mask, row_table, sliding_window
    )


def cache_attention(
    q: jax.Array,
    k_cache: jax.Array | PagedLayer,
    v_cache: jax.Array | PagedLayer,
    slots: jax.Array | None,
    mask: AttentionMask,
    sliding_window: int | None = None,
) -> jax.Array:
    """Attention of q [B,T,N,H] over the cache rows ``slots`` (all rows if None).

    A paged decode step on the GPU reads the pages in place with cuDNN, or with our Pallas
    paged kernel under ``forced_implementation("pallas")``; everything else reads the rows
    out (a view of a dense cache, a gather of a paged one) and goes through ``attention``.
    """
    paged = isinstance(k_cache, PagedLayer)
    if paged and _FORCED[0] == "pallas" and pallas_paged_applies(q, k_cache, sliding_window):
        return pallas_paged_attention(q, k_cache, v_cache, slots, mask)
    if (
        _FORCED[0] in (None, "cudnn")
        and paged
        and cudnn_paged_applies(q, k_cache, q.shape[0], sliding_window)
    ):
        return cudnn_paged_decode_attention(q, k_cache, v_cache, slots, mask)
    keys, values = read_rows(k_cache, slots), read_rows(v_cache, slots)
    return attention(q, keys, values, mask, sliding_window)


# ---------------------------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernels. The default dispatch can run the flash kernel for prefill on
# Hopper (``FLASH_PREFILL_BY_DEFAULT``); the decode kernels run on request
# (``implementation="pallas"`` or ``forced_implementation("pallas")``): against cuDNN in the
# same H200 runs they are 0.95-1.13x (dense) and 1.05x (paged), within the device's noise.

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


# The flash kernel for prefill on Hopper in the default dispatch. Measured on the H200 (runs k
# and o of BENCHMARKS.md): a 4 x 2048 prefill 268 -> 186 ms (95% of the matmul rate). Its
# first cost, an 8B serving engine's warm-up 33 -> 118 s, came from each of the 32 layers'
# calls compiling its own copy of the kernel; with the kernels shared per configuration
# (``_shared`` in pallas_kernels/decode_attention.py) run v measured warm-up 31.6 s, startup
# 44.7 s in all. False keeps XLA's reference for prefill.
FLASH_PREFILL_BY_DEFAULT = True

# A one-token step with at least this many (row, kv head) programs walks its keys through the
# flash kernel (measured at B=64, K=8: 2.55 TB/s against split-K's 1.42-1.92, run l of
# BENCHMARKS.md; e7: 4.17 against 2.45-2.92); fewer leave SMs idle (B=1, K=8: 0.07-0.11 TB/s
# against 0.16-0.18, run l), where the keys are split instead.
FLASH_DECODE_MIN_PROGRAMS = 256


def pallas_decode_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, scale: float | None = None
) -> jax.Array:
    """q [B,T,N,H] over k/v [B,S,K,H] with our kernels (interpreted off the GPU): the flash
    walk for a one-token step over many rows, else the split-K kernel."""
    from pallas_kernels.decode_attention import decode_attention, decode_attention_applies
    from pallas_kernels.flash_attention import flash_decode_applies, flash_decode_attention

    interpret = jax.default_backend() != "gpu"
    if q.shape[0] * k.shape[2] >= FLASH_DECODE_MIN_PROGRAMS and flash_decode_applies(q, k):
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

    t = q.shape[1]
    interpret = jax.default_backend() != "gpu"
    if mask.causal:
        query_lengths = jnp.clip(mask.key_lengths - mask.query_positions[:, 0], 0, t)
    else:
        query_lengths = jnp.full_like(mask.key_lengths, t)
    return flash_attention(
        q,
        k,
        v,
        query_lengths,
        mask.key_lengths,
        causal=mask.causal,
        scale=scale,
        interpret=interpret,
        **prefill_tuning(q, k, interpret),
    )


# The paged walk's copies (one per page) issued by a producer warpgroup into 3 slots: 3.50
# TB/s against 3.37 with the defaults, the dense walk 3.53 (run c7 of BENCHMARKS.md, B=64,
# 16-key pages); the interpreter keeps the defaults (warpgroups are threads there: slow).
PAGED_WALK_TUNING = {"stages": 3, "consumers": 1}
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
) -> jax.Array:
    """q [B,T,N,H] over the pages of rows ``slots`` with our kernels, in place: the flash
    walk for a one-token step over many rows (as ``pallas_decode_attention``), else the
    split-K paged kernel."""
    from pallas_kernels.flash_attention import flash_decode_applies, flash_decode_attention
    from pallas_kernels.paged_attention import paged_attention, paged_attention_applies

    interpret = jax.default_backend() != "gpu"
    if q.shape[0] * k_cache.pages.shape[2] >= FLASH_DECODE_MIN_PROGRAMS and flash_decode_applies(
        q, k_cache.pages, paged=True
    ):
        return flash_decode_attention(
            q,
            k_cache.pages,
            v_cache.pages,
            _one_query_lengths(mask),
            scale,
            block_table=k_cache.table_rows(slots),
            interpret=interpret,
            **({} if interpret else PAGED_WALK_TUNING),
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


# The one-query kernel (``pallas_kernels/one_query_attention.py``, Triton) for a decode step of
# an MHA model over a short cache: measured on the H200 at NLLB-600M's step (run a2 of
# BENCHMARKS.md), the 24 attentions of a step 284 -> 152-162 us at 32 rows and 590 -> 224-234
# us at 128 rows against cuDNN (the cache writes included). It walks each row's keys in one
# program, so a long cache over few rows would leave the GPU idle: past this many positions
# the split kernels (cuDNN's, ours) keep the step.
ONE_QUERY_MAX_KEYS = 256


def one_query_picked(
    q: jax.Array, k: jax.Array, sliding_window: int | None, implementation: str | None = None
) -> bool:
    """True where the dispatch runs the one-query kernel: one query per row of an MHA model
    over at most ``ONE_QUERY_MAX_KEYS`` positions, no window, for ``implementation`` None on a
    GPU (bf16/f16) or "pallas" (interpreted off the GPU); ``forced_implementation`` overrides
    None."""
    from pallas_kernels.one_query_attention import one_query_attention_applies

    if sliding_window is not None or k.shape[1] > ONE_QUERY_MAX_KEYS:
        return False
    if not one_query_attention_applies(q, k):
        return False
    implementation = implementation or _FORCED[0]
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


_FORCED: list[str | None] = [None]  # the override of ``forced_implementation``


@contextlib.contextmanager
def forced_implementation(name: str | None) -> Iterator[None]:
    """Every attention traced inside runs ``name`` ("xla", "cudnn", "pallas"); None restores
    the dispatch. It acts at trace time: programs already compiled keep what they traced
    (``jax.clear_caches()`` first to re-trace them). For checks of one path against another.
    """
    if name not in (None, "xla", "cudnn", "pallas"):
        raise ValueError(f"unknown implementation {name!r}: None, xla, cudnn or pallas")
    previous, _FORCED[0] = _FORCED[0], name
    try:
        yield
    finally:
        _FORCED[0] = previous


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    sliding_window: int | None = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """The attention entry point of every model; picks the implementation for the backend.

    ``implementation`` None picks: cuDNN for a decode step on the GPU, our flash kernel for a
    prefill on Hopper where it applies if ``FLASH_PREFILL_BY_DEFAULT`` (measured on the H200,
    causal GQA 32/8: 359 TFLOP/s at S=8192 and 262 at S=2048 against the reference's 47 and
    43), else the reference;
    "xla" forces the reference, "cudnn" and "pallas" force those kernels and raise where they
    do not apply. ``forced_implementation`` overrides None.
    """
    implementation = implementation or _FORCED[0]
    picked = one_query_picked(q, k, sliding_window, implementation)
    if implementation in (None, "pallas") and picked:
        return _one_query(q, k, v, _one_query_lengths(mask), scale=scale)[0]
    if implementation is None:
        if cudnn_decode_applies(q, k, sliding_window):
            return cudnn_decode_attention(q, k, v, mask, scale)
        if (
            FLASH_PREFILL_BY_DEFAULT
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
                "sliding window; pass implementation=None to let the dispatch choose."
            )
        return cudnn_decode_attention(q, k, v, mask, scale)
    if implementation == "pallas":
        if pallas_decode_applies(q, k, mask, sliding_window):
            return pallas_decode_attention(q, k, v, mask, scale)
        if pallas_prefill_applies(q, k, sliding_window):
            return pallas_prefill_attention(q, k, v, mask, scale)
        raise ValueError(
            "implementation='pallas' needs no sliding window, bf16/f16 on Hopper, and either "
            "T*G <= 64 query rows per kv head with head dim and key length multiples of 64 "
            "(decode) or T and S multiples of 64 with head dim 64 or 128 (flash prefill); "
            "pass implementation=None to let the dispatch choose."
        )
    raise ValueError(f"unknown implementation {implementation!r}: None, xla, cudnn or pallas")
