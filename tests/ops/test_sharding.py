"""The shard-major layout of fused kernels: each shard holds whole heads of every part, and the
split after the matmul gives the plain parts back (KV heads copied where fewer than shards)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from spark_jax.ops.sharding import fused_columns, partition_spec, split_fused


def test_qkv_columns_put_each_shards_heads_of_every_part_together():
    # 4 query heads and 2 KV heads of width 1 over 2 shards: [q0 q1 k0 v0 | q2 q3 k1 v1]
    columns = fused_columns((4, 2, 2), (1, 1, 1), 2)
    assert columns.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]


def test_kv_heads_fewer_than_shards_are_copied_one_per_shard():
    # 4 query heads over 1 KV head, 4 shards: each shard [q_s k0 v0]
    columns = fused_columns((4, 1, 1), (2, 2, 2), 4)
    assert columns.reshape(4, 6)[:, 2:].tolist() == [[8, 9, 10, 11]] * 4


def test_split_fused_of_shard_major_columns_gives_the_plain_parts():
    plain = np.arange(2 * 12, dtype=np.float32).reshape(2, 12)  # q 8 | k 2 | v 2, width 2
    columns = fused_columns((4, 1, 1), (2, 2, 2), 2)
    q, k, v = split_fused(jnp.asarray(plain[:, columns]), (8, 4, 4), shards=2)
    np.testing.assert_array_equal(q, plain[:, :8])
    np.testing.assert_array_equal(k, np.concatenate([plain[:, 8:10]] * 2, axis=1))  # copied
    np.testing.assert_array_equal(v, np.concatenate([plain[:, 10:12]] * 2, axis=1))


def test_a_single_part_that_divides_keeps_its_order():
    assert fused_columns((8,), (1,), 4) is None


def test_shards_must_divide_the_heads_or_be_a_multiple_of_them():
    with pytest.raises(ValueError, match="tensor_parallel=4 must divide 6"):
        fused_columns((6, 6), (1, 1), 4)


def test_a_vocab_the_mesh_does_not_divide_is_sharded_by_model_dim():
    class Mesh:  # partition_spec reads only the axis sizes
        shape = {"tp": 8}

    assert tuple(partition_spec((300, 32), ("vocab", "embed"), Mesh())) == (None, "tp")
