"""One-buffer uploads (``spark_jax.serving.packing``): a tree of host arrays packed into one
int32 buffer comes back bit for bit inside a jitted program, and the layout is a static
argument that compiles once per shape set."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spark_jax.serving.packing import pack, unpack


def _tree(rows: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    floats = rng.standard_normal((rows, 3)).astype(np.float32)
    floats[0, 0], floats[0, 1], floats[0, 2] = np.nan, -np.inf, -0.0  # bits, not values
    return {
        "slots": rng.integers(-5, 100, (rows,)).astype(np.int32),
        "mask": rng.random((rows, 4)) < 0.5,
        "keys": rng.integers(0, 2**32, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "floats": floats,
        "absent": None,  # an empty subtree, as SampleRows' prompt mask is
        "empty": np.zeros((0,), np.int32),
        "scalar": np.float32(2.5),
    }


def test_a_packed_tree_unpacks_bit_for_bit_inside_a_program():
    tree = _tree(5, seed=0)
    buffer, packing = pack(tree)
    assert buffer.dtype == np.int32 and buffer.ndim == 1
    assert buffer.size == 5 + 5 * 4 + 5 * 2 + 5 * 3 + 0 + 1
    got = jax.jit(unpack, static_argnums=1)(jax.device_put(buffer), packing)
    assert got["absent"] is None
    for name in ("slots", "mask", "keys", "floats", "empty", "scalar"):
        want = np.asarray(tree[name])
        have = np.asarray(got[name])
        assert have.dtype == want.dtype and have.shape == want.shape, name
        np.testing.assert_array_equal(
            have.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8), err_msg=name
        )


def test_equal_layouts_share_one_compile():
    compiles = []
    fn = jax.jit(lambda b, p: jax.tree.map(jnp.sum, unpack(b, p)), static_argnums=1)
    for seed in range(3):  # same shapes, other values: one program
        buffer, packing = pack(_tree(4, seed))
        compiles.append(fn._cache_size())
        fn(jax.device_put(buffer), packing)
    buffer, packing = pack(_tree(6, 0))  # other shapes: a program of their own
    fn(jax.device_put(buffer), packing)
    assert fn._cache_size() == 2 and compiles == [0, 1, 1]


@pytest.mark.parametrize("dtype", [np.int64, np.float16, np.int8])
def test_types_that_do_not_fit_a_word_are_refused(dtype):
    with pytest.raises(TypeError, match="only bool and 4-byte types"):
        pack({"x": np.zeros((3,), dtype)})
