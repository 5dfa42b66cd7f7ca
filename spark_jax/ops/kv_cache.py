"""KV-state pytrees: the attention keys and values of every sequence, with explicit lengths.

A cache has a fixed number of rows (slots) and a static maximum length. Each row is an
independent sequence at its own position: ``lengths[row]`` keys are valid. Rolling back a
rejected speculative draft is lowering a length; the stale keys beyond it are never read.
One buffer per layer (a tuple), measured faster than one stacked array (DESIGN.md).

``kv_cache_dtype="fp8"`` (vLLM's name) stores K and V as E4M3 with a scale per kv head and
layer (``ScaledLayer``, or a ``PagedLayer`` with ``scale``): ``write_kv`` divides by the scale
and rounds, ``read_rows`` multiplies back into the model dtype (a producer XLA fuses into the
attention that reads it). The scales default to 1, as vLLM's do for a checkpoint without
calibrated ones: E4M3 keeps ~2 significant decimal digits from 2^-6 to 448.

Under tensor parallelism every cache is sharded by its KV heads (``shardings(mesh)``: a tree
of ``NamedSharding`` in the cache's shape, for ``jax.device_put``): each device holds the K/V
of the heads its query heads read; lengths and tables are whole on every device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Self

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from spark_jax.ops.sharding import heads_sharding, replicated

KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the model dtype
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # E4M3 "fn" has no infinity: past this a conversion gives NaN, so clip


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of "
            f"{', '.join(map(repr, KV_CACHE_DTYPES))}."
        )


def stored_dtype(kv_cache_dtype: str, dtype: jnp.dtype) -> jnp.dtype:
    """The dtype a cache holds its keys and values in: the model's (``"auto"``) or E4M3."""
    check_kv_cache_dtype(kv_cache_dtype)
    return jnp.dtype(FP8 if kv_cache_dtype == "fp8" else dtype)


def quantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x [..., K, H] / scale [K], rounded to E4M3 (saturating at +-448)."""
    scaled = x.astype(jnp.float32) / scale.astype(jnp.float32)[:, None]
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8)


def dequantize_kv(x: jax.Array, scale: jax.Array) -> jax.Array:
    """E4M3 x [..., K, H] * scale [K], in the scale's dtype (the model's)."""
    return x.astype(scale.dtype) * scale[:, None]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ScaledLayer:
    """One layer's dense K or V buffer held as E4M3: the value is ``data * scale``."""

    data: jax.Array  # [slots, S, K, H] float8_e4m3fn
    scale: jax.Array  # [K] in the model dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype reads give (the model's)."""
        return self.scale.dtype

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes


def _layer_sharding(layer: jax.Array | ScaledLayer, mesh: Mesh) -> jax.Array | ScaledLayer:
    """One K or V buffer [rows, S, K, H] (an E4M3 one with its [K] scales) by heads."""
    heads = heads_sharding(mesh, 4, 2)
    if isinstance(layer, ScaledLayer):
        return ScaledLayer(heads, heads_sharding(mesh, 1, 0))
    return heads


class _Rows:
    """What every cache has from its ``lengths`` (int32[slots]) and its ``max_len``."""

    lengths: jax.Array
    max_len: int

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    def is_full(self) -> jax.Array:
        """bool[slots]: rows that have no room for another token."""
        return self.lengths >= self.max_len

    def with_lengths(self, lengths: jax.Array) -> Self:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache(_Rows):
    """Self-attention keys and values for ``num_slots`` sequences of up to ``max_len`` tokens."""

    k: tuple[jax.Array | ScaledLayer, ...]  # per layer [slots, S, K, H]
    v: tuple[jax.Array | ScaledLayer, ...]  # per layer [slots, S, K, H]
    lengths: jax.Array  # int32[slots]: valid keys per row

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        kv_cache_dtype: str = "auto",
    ) -> KVCache:
        check_kv_cache_dtype(kv_cache_dtype)
        shape = (num_slots, max_len, num_kv_heads, head_dim)

        def layer() -> jax.Array | ScaledLayer:
            if kv_cache_dtype == "auto":
                return jnp.zeros(shape, dtype)
            return ScaledLayer(jnp.zeros(shape, FP8), jnp.ones((num_kv_heads,), dtype))

        return cls(
            k=tuple(layer() for _ in range(num_layers)),
            v=tuple(layer() for _ in range(num_layers)),
            lengths=jnp.zeros((num_slots,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v)

    def reset_rows(self, rows: jax.Array) -> KVCache:
        """Frees rows: their lengths drop to zero (the stale keys are never read)."""
        return self.with_lengths(self.lengths.at[rows].set(0))

    def shardings(self, mesh: Mesh) -> KVCache:
        """Where each array of this cache lies under tensor parallelism: K/V by heads."""
        return dataclasses.replace(
            self,
            k=tuple(_layer_sharding(x, mesh) for x in self.k),
            v=tuple(_layer_sharding(x, mesh) for x in self.v),
            lengths=replicated(mesh),
        )

    def with_layers(self, k: tuple[jax.Array, ...], v: tuple[jax.Array, ...]) -> KVCache:
        """The same cache with new per-layer buffers (what a step wrote)."""
        return dataclasses.replace(self, k=k, v=v)


def write_kv(
    cache_layer: jax.Array, new: jax.Array, slots: jax.Array | None, positions: jax.Array
) -> jax.Array:
    """Writes ``new[B, T, K, H]`` at ``positions[B, T]`` of rows ``slots[B]`` (all rows if None).

    Positions past the buffer are dropped: they belong to padding tokens of a bucketed batch.
    A ``PagedLayer`` writes through its block table instead.
    """
    if isinstance(cache_layer, PagedLayer):
        return cache_layer.write(new, slots, positions)
    if isinstance(cache_layer, ScaledLayer):
        data = write_kv(cache_layer.data, quantize_kv(new, cache_layer.scale), slots, positions)
        return dataclasses.replace(cache_layer, data=data)
    if slots is None:
        rows = jnp.arange(cache_layer.shape[0])[:, None]
    else:
        rows = slots[:, None]
    return cache_layer.at[rows, positions].set(
        new.astype(cache_layer.dtype), mode="drop", unique_indices=True
    )


def read_through(cache_layer: jax.Array, row_table: jax.Array) -> jax.Array:
    """``[B, S, K, H]``: position t of row b read from cache row ``row_table[b, t]`` (a gather;
    beam search's rows read their shared history this way instead of moving it)."""
    positions = jnp.arange(cache_layer.shape[1])[None, :]
    return cache_layer[row_table, positions]


def read_rows(cache_layer: jax.Array, slots: jax.Array | None) -> jax.Array:
    """The rows of the given slots, ``[B, S, K, H]``; no copy when every row is used in order."""
    if isinstance(cache_layer, PagedLayer):
        return cache_layer.read(slots)
    if isinstance(cache_layer, ScaledLayer):
        return dequantize_kv(read_rows(cache_layer.data, slots), cache_layer.scale)
    return cache_layer if slots is None else cache_layer[slots]


def narrow_pages(
    cache_layer: ScaledLayer | PagedLayer, slots: jax.Array | None, dense_page: int = 128
) -> tuple[jax.Array, jax.Array, jax.Array] | None:
    """An E4M3 layer as (pages [P, L, K, H], block table int32[B, W], scale [K]) for a kernel
    that reads pages in place: a paged layer's own, or a dense one's rows cut into pages of
    the largest power of two up to ``dense_page`` (at least 16) that divides its length (a
    free reshape; None where there is none)."""
    if isinstance(cache_layer, PagedLayer):
        return cache_layer.pages, cache_layer.table_rows(slots), cache_layer.scale
    num_slots, length = cache_layer.data.shape[:2]
    page = dense_page
    while page >= 16 and length % page:
        page //= 2
    if page < 16:
        return None
    per_row = length // page
    pages = cache_layer.data.reshape(num_slots * per_row, page, *cache_layer.data.shape[2:])
    rows = jnp.arange(num_slots) if slots is None else slots
    table = rows[:, None] * per_row + jnp.arange(per_row)[None, :]
    return pages, table.astype(jnp.int32), cache_layer.scale


def is_narrow(cache_layer: jax.Array | ScaledLayer | PagedLayer) -> bool:
    """True for a layer held as E4M3 with scales (reads dequantize it)."""
    if isinstance(cache_layer, PagedLayer):
        return cache_layer.scale is not None
    return isinstance(cache_layer, ScaledLayer)


# ---------------------------------------------------------------------------------------------
# The paged variant: the batching engine's cache. Keys live in a shared pool of fixed-size
# pages; each row's block table lists its pages in order. Rows then cost memory in proportion
# to their length, not to the longest sequence the cache could hold.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedLayer:
    """One layer's page pool seen through the block table; stands in for a dense buffer.

    Block-table entries of pages a row does not own hold ``num_pages`` (out of range), so
    writes there are dropped: the garbage keys of inactive rows and padding tokens land
    nowhere, never in a page another sequence owns.
    """

    pages: jax.Array  # [P, page_size, K, H]
    block_table: jax.Array  # int32[slots, max_pages]
    scale: jax.Array | None = None  # [K] in the model dtype when the pages are E4M3

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]

    def table_rows(self, slots: jax.Array | None) -> jax.Array:
        """int32[B, max_pages]: the pages of each row; slots out of range own no page."""
        if slots is None:
            return self.block_table
        return jnp.take(
            self.block_table, slots, axis=0, mode="fill", fill_value=self.pages.shape[0]
        )

    def write(self, new: jax.Array, slots: jax.Array | None, positions: jax.Array) -> PagedLayer:
        """Writes ``new[B, T, K, H]`` at ``positions[B, T]`` of rows ``slots[B]``."""
        table = self.table_rows(slots)
        index = positions // self.page_size
        page = jnp.take_along_axis(table, jnp.minimum(index, table.shape[1] - 1), axis=1)
        page = jnp.where(index < table.shape[1], page, self.pages.shape[0])
        new = new.astype(self.pages.dtype) if self.scale is None else quantize_kv(new, self.scale)
        # Each real token has a place of its own (padding's lie out of range, dropped): the
        # promise lets XLA's GPU scatter store plainly instead of updating atomically.
        pages = self.pages.at[page, positions % self.page_size].set(
            new, mode="drop", unique_indices=True
        )
        return dataclasses.replace(self, pages=pages)

    def read(self, slots: jax.Array | None) -> jax.Array:
        """Gathers each row's pages into ``[B, max_pages * page_size, K, H]`` (the fallback of
        a paged kernel); pages a row does not own read as some other page, masked by length."""
        table = self.table_rows(slots)
        b, n = table.shape
        rows = jnp.take(self.pages, table.reshape(-1), axis=0, mode="clip")
        rows = rows.reshape(b, n * self.page_size, *self.pages.shape[2:])
        return rows if self.scale is None else dequantize_kv(rows, self.scale)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedKVCache(_Rows):
    """Self-attention keys and values of ``num_slots`` sequences in a shared page pool.

    ``k`` and ``v`` give per-layer ``PagedLayer`` views, so a model written against dense
    buffers (``write_kv``/``read_rows``) runs on it unchanged. The block table's width sets
    the longest row a step can see: the engine passes a narrower table when every row is
    short, so attention gathers only the pages in use.
    """

    k_pages: tuple[jax.Array, ...]  # per layer [P, page_size, K, H]
    v_pages: tuple[jax.Array, ...]  # per layer [P, page_size, K, H]
    block_table: jax.Array  # int32[slots, max_pages]; num_pages where no page is owned
    lengths: jax.Array  # int32[slots]: valid keys per row
    k_scales: tuple[jax.Array, ...] | None = None  # per layer [K] when the pages are E4M3
    v_scales: tuple[jax.Array, ...] | None = None

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_slots: int,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        kv_cache_dtype: str = "auto",
    ) -> PagedKVCache:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        stored = stored_dtype(kv_cache_dtype, dtype)  # checks the name
        narrow = stored == FP8
        # Distinct arrays for K and V: the cache is donated, and no buffer may be given twice.
        scales = lambda: tuple(jnp.ones((num_kv_heads,), dtype) for _ in range(num_layers))
        return cls(
            k_pages=tuple(jnp.zeros(shape, stored) for _ in range(num_layers)),
            v_pages=tuple(jnp.zeros(shape, stored) for _ in range(num_layers)),
            block_table=jnp.full((num_slots, max_pages_per_seq), num_pages, jnp.int32),
            lengths=jnp.zeros((num_slots,), jnp.int32),
            k_scales=scales() if narrow else None,
            v_scales=scales() if narrow else None,
        )

    @property
    def k(self) -> tuple[PagedLayer, ...]:
        scales = self.k_scales or (None,) * len(self.k_pages)
        return tuple(self._view(p, s) for p, s in zip(self.k_pages, scales, strict=True))

    @property
    def v(self) -> tuple[PagedLayer, ...]:
        scales = self.v_scales or (None,) * len(self.v_pages)
        return tuple(self._view(p, s) for p, s in zip(self.v_pages, scales, strict=True))

    def shardings(self, mesh: Mesh) -> PagedKVCache:
        """Where each array of this cache lies under tensor parallelism: the pages by heads,
        the block table and lengths whole on every device."""
        scales = lambda s: None if s is None else tuple(heads_sharding(mesh, 1, 0) for _ in s)
        return dataclasses.replace(
            self,
            k_pages=tuple(heads_sharding(mesh, 4, 2) for _ in self.k_pages),
            v_pages=tuple(heads_sharding(mesh, 4, 2) for _ in self.v_pages),
            block_table=replicated(mesh),
            lengths=replicated(mesh),
            k_scales=scales(self.k_scales),
            v_scales=scales(self.v_scales),
        )

    def _view(self, pages: jax.Array, scale: jax.Array | None) -> PagedLayer:
        return PagedLayer(pages, self.block_table, scale)

    @property
    def num_pages(self) -> int:
        return self.k_pages[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def max_len(self) -> int:
        return self.block_table.shape[1] * self.page_size

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k_pages + self.v_pages)

    def with_block_table(self, block_table: jax.Array) -> PagedKVCache:
        return dataclasses.replace(self, block_table=block_table.astype(jnp.int32))

    def with_layers(
        self, k: tuple[PagedLayer | jax.Array, ...], v: tuple[PagedLayer | jax.Array, ...]
    ) -> PagedKVCache:
        """The same cache with the page pools a step wrote (views or bare pools)."""

        def pool(x: PagedLayer | jax.Array) -> jax.Array:
            return x.pages if isinstance(x, PagedLayer) else x

        return dataclasses.replace(self, k_pages=tuple(map(pool, k)), v_pages=tuple(map(pool, v)))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EncoderDecoderCache(_Rows):
    """The decoder state of an encoder-decoder (NLLB) for ``num_slots`` sequences.

    Self-attention keys and values grow one token per step, as in ``KVCache``. The
    cross-attention keys and values are projected from the encoder output once, at prefill,
    and only read afterwards; ``source_lengths[row]`` of them are valid (the cross mask).
    """

    k: tuple[jax.Array, ...]  # per decoder layer [slots, S, N, H]
    v: tuple[jax.Array, ...]  # per decoder layer [slots, S, N, H]
    cross_k: tuple[jax.Array, ...]  # per decoder layer [slots, S_src, N, H]
    cross_v: tuple[jax.Array, ...]  # per decoder layer [slots, S_src, N, H]
    lengths: jax.Array  # int32[slots]: valid self-attention keys per row
    source_lengths: jax.Array  # int32[slots]: valid cross-attention keys per row
    # int32[slots, S] or None: the row holding each position of a row's self-attention keys.
    # Beam search's reorder then moves this table instead of every layer's rows (see
    # ``gather_rows``); a row always writes its new keys into itself.
    row_table: jax.Array | None = None

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_slots: int,
        max_len: int,
        max_source_len: int,
        num_heads: int,
        head_dim: int,
        dtype: jnp.dtype,
        row_table: bool = False,
    ) -> EncoderDecoderCache:
        self_shape = (num_slots, max_len, num_heads, head_dim)
        cross_shape = (num_slots, max_source_len, num_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(self_shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(self_shape, dtype) for _ in range(num_layers)),
            cross_k=tuple(jnp.zeros(cross_shape, dtype) for _ in range(num_layers)),
            cross_v=tuple(jnp.zeros(cross_shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((num_slots,), jnp.int32),
            source_lengths=jnp.zeros((num_slots,), jnp.int32),
            row_table=_own_rows(num_slots, max_len) if row_table else None,
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_source_len(self) -> int:
        return self.cross_k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v + self.cross_k + self.cross_v)

    def shardings(self, mesh: Mesh) -> EncoderDecoderCache:
        """Where each array of this cache lies under tensor parallelism: self and cross K/V
        by heads, lengths and the row table whole on every device."""
        heads = lambda layers: tuple(heads_sharding(mesh, 4, 2) for _ in layers)
        return dataclasses.replace(
            self,
            k=heads(self.k),
            v=heads(self.v),
            cross_k=heads(self.cross_k),
            cross_v=heads(self.cross_v),
            lengths=replicated(mesh),
            source_lengths=replicated(mesh),
            row_table=None if self.row_table is None else replicated(mesh),
        )

    def reset_rows(self, rows: jax.Array) -> EncoderDecoderCache:
        """Frees rows: both lengths drop to zero (the stale keys are never read)."""
        return dataclasses.replace(
            self,
            lengths=self.lengths.at[rows].set(0),
            source_lengths=self.source_lengths.at[rows].set(0),
        )

    def gather_rows(self, source_rows: jax.Array, with_cross: bool) -> EncoderDecoderCache:
        """Row r becomes a copy of row ``source_rows[r]`` below its length (beam reordering).

        The cross-attention buffers are copied only ``with_cross``: beams of one request share
        their source, so reordering within a request never needs to move them.
        """
        take = lambda layers: tuple(x[source_rows] for x in layers)
        lengths = self.lengths[source_rows]
        if self.row_table is None:
            k, v = _move_prefix(source_rows, jnp.max(lengths), self.k, self.v)
            fields = {"k": k, "v": v, "lengths": lengths}
        else:
            # Row r's history is its source's: positions below the length read where the
            # source reads; the rest (where r writes next) is r's own.
            slots, size = self.row_table.shape
            below = jnp.arange(size)[None, :] < lengths[:, None]
            table = jnp.where(below, self.row_table[source_rows], _own_rows(slots, size))
            fields = {"row_table": table, "lengths": lengths}
        if with_cross:
            fields |= {
                "cross_k": take(self.cross_k),
                "cross_v": take(self.cross_v),
                "source_lengths": self.source_lengths[source_rows],
            }
        return dataclasses.replace(self, **fields)


def _own_rows(num_slots: int, size: int) -> jax.Array:
    """int32[slots, size]: every row reads its own positions (the identity row table)."""
    return jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32)[:, None], (num_slots, size))


_REORDER_CHUNK = 32  # positions a beam reorder moves per loop iteration


def _move_prefix(
    source_rows: jax.Array, used: jax.Array, *layers: tuple[jax.Array, ...]
) -> tuple[tuple[jax.Array, ...], ...]:
    """Row r of every [slots, S, ...] buffer becomes row ``source_rows[r]``, positions < used.

    Positions at or past a row's length are never read, so only the chunks below ``used``
    (a traced scalar) are moved: a beam step at length t moves ~t/S of each buffer. Each
    chunk is gathered into a small temporary and written back in place; gathering whole
    buffers wrote a full temporary that XLA then copied back, twice the bytes per step.
    """
    size = layers[0][0].shape[1]
    chunk = _REORDER_CHUNK if size % _REORDER_CHUNK == 0 else size

    def move(carry):
        start, layers = carry

        def part(x):
            piece = jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=1)[source_rows]
            return jax.lax.dynamic_update_slice_in_dim(x, piece, start, axis=1)

        return start + chunk, tuple(tuple(map(part, buffers)) for buffers in layers)

    _, layers = jax.lax.while_loop(lambda c: c[0] < used, move, (jnp.int32(0), layers))
    return layers
