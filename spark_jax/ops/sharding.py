"""Tensor parallelism on ``jax.sharding``: the mesh, logical axes and the fused layout.

One model runs over N devices of a one-axis ``Mesh`` (axis ``"tp"``). Every parameter
declares a logical axis per dimension (``spark_jax.models.params.Param.axes``); the rules here
map logical axes to mesh axes, and a ``NamedSharding`` per leaf follows. XLA's SPMD
partitioner then inserts the collectives: the all-reduce after the attention output and the
MLP down projection (row-parallel kernels), the gathers of the vocab-parallel embedding and LM
head. Axis vocabulary of the logical axes:

    "embed"    the model dim D          (never sharded: activations stay whole between layers)
    "heads"    query heads N (columns of Q, rows of the attention output projection)
    "kv_heads" key/value heads K        (replicated across shards when K < N_shards: each shard
                                          holds a copy of the one KV head its queries read)
    "mlp"      the FFN dim F            (gate/up columns, down rows)
    "vocab"    the vocabulary V         (embedding rows, LM head columns)
    None       a dimension never sharded (norm scales, head_dim)

A kernel fusing several parts along its output axis (Q/K/V, gate/up) is held *shard-major*
under TP: the columns of shard s are [part 0 of s | part 1 of s | ...], so each device holds
whole heads of every part and the split after the matmul is local (``split_fused``).
``fused_columns`` gives that column order from the parts' unit counts (heads, or columns).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis → mesh axis; an axis not listed is replicated. Frozen: passed in, never
    switched."""

    rules: tuple[tuple[str, str], ...] = (
        ("heads", TP_AXIS),
        ("kv_heads", TP_AXIS),
        ("mlp", TP_AXIS),
        ("vocab", TP_AXIS),
    )

    def mesh_axis(self, logical: str | None) -> str | None:
        return dict(self.rules).get(logical) if logical is not None else None


DEFAULT_RULES = ShardingRules()


def make_mesh(tensor_parallel: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis ``("tp",)`` mesh over the first ``tensor_parallel`` devices (all processes'
    devices under ``jax.distributed``)."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be at least 1, got {tensor_parallel}.")
    if tensor_parallel > len(devices):
        raise ValueError(
            f"tensor_parallel={tensor_parallel} asks for more devices than the {len(devices)} "
            "this process sees."
        )
    return Mesh(np.asarray(devices[:tensor_parallel]), (TP_AXIS,))


def partition_spec(
    shape: Sequence[int],
    axes: Sequence[str | None],
    mesh: Mesh,
    rules: ShardingRules = DEFAULT_RULES,
) -> PartitionSpec:
    """The spec of an array of ``shape`` with logical ``axes``.

    A dimension the rules shard but whose size the mesh axis does not divide (a vocabulary of
    256,206 over 4 devices) is left whole, and the largest other dimension the axis divides is
    sharded instead: no weight ends up replicated because its vocab is odd.
    """
    if len(axes) != len(shape):
        raise ValueError(f"{len(axes)} logical axes given for an array of shape {tuple(shape)}.")
    spec: list[str | None] = [rules.mesh_axis(a) for a in axes]
    for dim, mesh_axis in enumerate(spec):
        if mesh_axis is None or shape[dim] % mesh.shape[mesh_axis] == 0:
            continue
        spec[dim] = None
        others = [d for d in range(len(shape)) if spec[d] is None and d != dim]
        others = [d for d in others if shape[d] % mesh.shape[mesh_axis] == 0]
        if others and mesh_axis not in spec:
            spec[max(others, key=lambda d: shape[d])] = mesh_axis
    return PartitionSpec(*spec)


def named_sharding(
    mesh: Mesh,
    shape: Sequence[int],
    axes: Sequence[str | None],
    rules: ShardingRules = DEFAULT_RULES,
) -> NamedSharding:
    """The ``NamedSharding`` of an array of ``shape`` with logical ``axes`` on ``mesh``."""
    return NamedSharding(mesh, partition_spec(shape, axes, mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array."""
    return NamedSharding(mesh, PartitionSpec())


def heads_sharding(mesh: Mesh, rank: int, heads_axis: int) -> NamedSharding:
    """A cache buffer of ``rank`` dims sharded along its heads dim ``heads_axis``."""
    spec: list[str | None] = [None] * rank
    spec[heads_axis] = TP_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def shards_for(units: int, shards: int) -> int:
    """Units (heads, columns) of a part each shard holds: units / shards, or one copy of a
    unit when there are fewer units than shards (each unit then serves shards / units)."""
    if units % shards == 0:
        return units // shards
    if shards % units == 0:
        return 1
    raise ValueError(
        f"tensor_parallel={shards} must divide {units} (heads or columns), or be a multiple of it."
    )


def fused_columns(units: Sequence[int], widths: Sequence[int], shards: int) -> np.ndarray | None:
    """The column order of a fused kernel held shard-major, as indices into its plain
    [part 0 | part 1 | ...] columns (None when that is already the order).

    Part p has ``units[p]`` units (heads) of ``widths[p]`` columns each. Shard s holds, for
    each part in order, units [s u/N, (s+1) u/N), or, when the part has u < N units, the one
    unit ``s u // N`` (a copy: KV heads replicated for the query heads of shard s).
    """
    if shards == 1 or (len(units) == 1 and units[0] % shards == 0):
        return None
    starts = np.cumsum([0, *(u * w for u, w in zip(units, widths, strict=True))])
    columns = []
    for s in range(shards):
        for start, u, w in zip(starts, units, widths, strict=False):
            held = shards_for(u, shards)
            first = s * held if u % shards == 0 else s * u // shards
            columns.append(start + np.arange(first * w, (first + held) * w))
    return np.concatenate(columns)


def split_fused(y: jax.Array, sizes: Sequence[int], shards: int = 1) -> list[jax.Array]:
    """The parts of a fused projection's output y [..., sum(sizes)] held shard-major over
    ``shards`` (``fused_columns``), each [..., size] in plain order of its heads.

    With one shard this is ``jnp.split``. Otherwise each shard's block is split locally: the
    reshape puts the (sharded) shard index on an axis of its own, so no data moves.
    """
    if shards == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    per_shard = [size // shards for size in sizes]
    blocks = y.reshape(*y.shape[:-1], shards, sum(per_shard))
    parts = jnp.split(blocks, np.cumsum(per_shard)[:-1].tolist(), axis=-1)
    return [part.reshape(*y.shape[:-1], size) for part, size in zip(parts, sizes, strict=True)]


def device_bytes(array: jax.Array) -> dict[jax.Device, int]:
    """Bytes of ``array`` each of its (addressable) devices holds."""
    held: dict[jax.Device, int] = {}
    for shard in array.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def holds_full_copy(array: jax.Array) -> bool:
    """True when some device holds as many bytes of ``array`` as the whole array."""
    return any(n >= array.nbytes for n in device_bytes(array).values())


def host_array(array: jax.Array) -> np.ndarray:
    """``array`` as numpy on this host, gathered from every process when it spans devices of
    others (``jax.distributed``: each host runs the same program and reads the same value)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
