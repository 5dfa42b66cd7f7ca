"""The layouts a ragged prefill's queries take for attention (``decoder.chunk_rows`` and
``decoder.block_rows``), checked against a plain Python walk of the stream."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from spark_jax.models import decoder


def _expected_blocks(lengths, starts, slots, block):
    """(place of each real token, then each used row's (slot, start, length)), in order."""
    places, rows = [], []
    for length, start, slot in zip(lengths, starts, slots, strict=True):
        for b in range(-(-length // block)):
            first = len(rows) * block
            count = min(block, length - b * block)
            places += range(first, first + count)
            rows.append((slot, start + b * block, count))
    return places, rows


@pytest.mark.parametrize("seed", range(6))
def test_block_rows_place_every_token_once_in_rows_of_its_own_chunk(seed):
    rng = np.random.default_rng(seed)
    r, block = int(rng.integers(1, 6)), int(rng.choice([3, 4, 8]))
    lengths = rng.integers(0, 3 * block, r)
    if seed == 0:  # the layout's worst case: every chunk one past a whole number of rows
        lengths = np.full(r, block + 1)
    n = int(lengths.sum() + rng.integers(0, block))
    starts, slots = rng.integers(0, 50, r), rng.permutation(16)[:r]
    got = decoder.block_rows(
        jnp.asarray(lengths, jnp.int32), jnp.asarray(starts, jnp.int32),
        jnp.asarray(slots, jnp.int32), n, block,
    )  # fmt: skip
    count = (n + r * (block - 1)) // block
    places, rows = _expected_blocks(lengths.tolist(), starts.tolist(), slots.tolist(), block)
    assert got.width == block and got.slots.shape == (count,) and len(rows) <= count
    real = int(lengths.sum())
    np.testing.assert_array_equal(np.asarray(got.places)[:real], places)
    assert (np.asarray(got.places)[real:] == count * block).all()  # padding: out of range
    used = np.stack([got.slots, got.starts, got.lengths], axis=1)[: len(rows)]
    np.testing.assert_array_equal(np.asarray(used), np.asarray(rows).reshape(-1, 3))
    assert (np.asarray(got.lengths)[len(rows) :] == 0).all()  # spare rows see nothing


def test_chunk_rows_give_each_chunk_one_row_as_long_as_the_stream():
    lengths = jnp.asarray([2, 0, 3], jnp.int32)
    got = decoder.chunk_rows(lengths, jnp.asarray([5, 0, 1]), jnp.asarray([7, 8, 9]), 6)
    assert got.width == 6
    np.testing.assert_array_equal(got.places, [0, 1, 12, 13, 14, 18])
    np.testing.assert_array_equal(got.starts, [5, 0, 1])
