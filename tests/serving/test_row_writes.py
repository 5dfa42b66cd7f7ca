"""The executor's writes of a step's rows into the slots' state (counts, last tokens, sampler
settings): each row at its slot, padding rows (slot S) dropped, the indices promised unique."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import scatters_promise_unique

from spark_jax.serving.executor import put_rows


def test_put_rows_writes_each_row_at_its_slot_and_drops_padding() -> None:
    whole = np.arange(5 * 4, dtype=np.int32).reshape(5, 4)
    rows = -np.arange(3 * 4, dtype=np.int32).reshape(3, 4) - 1
    slots = np.array([3, 5, 0], np.int32)  # 5 = S: a padding row
    out = np.asarray(jax.jit(put_rows)(jnp.asarray(whole), slots, jnp.asarray(rows)))
    expected = whole.copy()
    expected[3], expected[0] = rows[0], rows[2]
    np.testing.assert_array_equal(out, expected)


def test_put_rows_promises_unique_indices() -> None:
    lowered = jax.jit(put_rows).lower(
        jnp.zeros((5, 4), jnp.int32), jnp.asarray([3, 5, 0]), jnp.zeros((3, 4), jnp.int32)
    )
    assert scatters_promise_unique(lowered)
