"""KV-state pytrees: the attention keys and values of every sequence, with explicit lengths.

A cache has a fixed number of rows (slots) and a static maximum length. Each row is an
independent sequence at its own position: ``lengths[row]`` keys are valid. Rolling back a
rejected speculative draft is lowering a length; the stale keys beyond it are never read.
One buffer per layer (a tuple), measured faster than one stacked array (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Self-attention keys and values for ``num_slots`` sequences of up to ``max_len`` tokens."""

    k: tuple[jax.Array, ...]  # per layer [slots, S, K, H]
    v: tuple[jax.Array, ...]  # per layer [slots, S, K, H]
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
    ) -> KVCache:
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((num_slots,), jnp.int32),
        )

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v)

    def is_full(self) -> jax.Array:
        """bool[slots]: rows that have no room for another token."""
        return self.lengths >= self.max_len

    def with_lengths(self, lengths: jax.Array) -> KVCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def reset_rows(self, rows: jax.Array) -> KVCache:
        """Frees rows: their lengths drop to zero (the stale keys are never read)."""
        return self.with_lengths(self.lengths.at[rows].set(0))


def write_kv(
    cache_layer: jax.Array, new: jax.Array, slots: jax.Array | None, positions: jax.Array
) -> jax.Array:
    """Writes ``new[B, T, K, H]`` at ``positions[B, T]`` of rows ``slots[B]`` (all rows if None).

    Positions past the buffer are dropped: they belong to padding tokens of a bucketed batch.
    """
    if slots is None:
        rows = jnp.arange(cache_layer.shape[0])[:, None]
    else:
        rows = slots[:, None]
    return cache_layer.at[rows, positions].set(new.astype(cache_layer.dtype), mode="drop")


def read_rows(cache_layer: jax.Array, slots: jax.Array | None) -> jax.Array:
    """The rows of the given slots, ``[B, S, K, H]``; no copy when every row is used in order."""
    return cache_layer if slots is None else cache_layer[slots]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EncoderDecoderCache:
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
        )

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_source_len(self) -> int:
        return self.cross_k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.k + self.v + self.cross_k + self.cross_v)

    def is_full(self) -> jax.Array:
        """bool[slots]: rows that have no room for another token."""
        return self.lengths >= self.max_len

    def with_lengths(self, lengths: jax.Array) -> EncoderDecoderCache:
        return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

    def reset_rows(self, rows: jax.Array) -> EncoderDecoderCache:
        """Frees rows: both lengths drop to zero (the stale keys are never read)."""
        return dataclasses.replace(
            self,
            lengths=self.lengths.at[rows].set(0),
            source_lengths=self.source_lengths.at[rows].set(0),
        )

    def gather_rows(self, source_rows: jax.Array, with_cross: bool) -> EncoderDecoderCache:
        """Row r becomes a copy of row ``source_rows[r]`` (beam reordering).

        The cross-attention buffers are copied only ``with_cross``: beams of one request share
        their source, so reordering within a request never needs to move them.
        """
        take = lambda layers: tuple(x[source_rows] for x in layers)
        fields = {"k": take(self.k), "v": take(self.v), "lengths": self.lengths[source_rows]}
        if with_cross:
            fields |= {
                "cross_k": take(self.cross_k),
                "cross_v": take(self.cross_v),
                "source_lengths": self.source_lengths[source_rows],
            }
        return dataclasses.replace(self, **fields)
