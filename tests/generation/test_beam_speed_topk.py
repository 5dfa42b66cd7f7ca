"""The beam step's top log-probs, taken on the logits, against top-k of the full log-softmax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation import beam


def _reference(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)


def test_top_log_probs_equal_top_k_of_log_softmax():
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 3.0, size=(16, 1000)).astype(np.float32)
    logits[3, [7, 400, 999]] = logits[3].max() + 1.0  # exact ties: the lowest index first
    logits[5] = np.round(logits[5])  # many ties at every rank
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(logits, dtype)
        values, ids = beam._top_log_probs(x, 8)
        ref_values, ref_ids = _reference(x, 8)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
        np.testing.assert_allclose(np.asarray(values), np.asarray(ref_values), rtol=0, atol=1e-6)
    assert np.asarray(ids)[3, :3].tolist() == [7, 400, 999]


def test_prefill_top_lands_in_first_rows():
    values = jnp.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    ids = jnp.asarray(np.arange(6, dtype=np.int32).reshape(2, 3) + 10)
    placed_values, placed_ids = beam._in_first_rows(values, ids, np.asarray([4, 1], np.int32), 6)
    expected = np.full((6, 3), -np.inf, np.float32)
    expected[4], expected[1] = [0, 1, 2], [3, 4, 5]
    np.testing.assert_array_equal(np.asarray(placed_values), expected)
    assert np.asarray(placed_ids)[[4, 1]].tolist() == [[10, 11, 12], [13, 14, 15]]
    assert not np.asarray(placed_ids)[[0, 2, 3, 5]].any()


def test_top_log_probs_compiles_to_top_k_not_a_full_sort():
    """XLA turns top-k into sort + slice and back into its top-k kernel; reading the max off
    the picks the wrong way leaves a sort of the whole [rows, V] (seconds at NLLB's vocab)."""
    logits = jnp.zeros((4, 5000), jnp.float32)
    hlo = beam._top_log_probs.lower(logits, k=8).compile().as_text()
    full_sorts = [line for line in hlo.splitlines() if " sort(" in line and "5000]" in line]
    assert not full_sorts, full_sorts
