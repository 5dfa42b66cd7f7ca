"""Parameter declarations: each parameter of a model, said once, and all that derives from it.

A family lists its parameters for a config (``declare(config) -> Declaration``), one ``Param``
per leaf of the params tree: its path, the HF tensors fused into it (in order, with their HF
shapes) and whether HF stores it transposed. From that one list come

- ``Declaration.weight_spec()``: the HF names and shapes a checkpoint holds (the converter's
  check), tied copies (``aliases``) optional;
- ``Declaration.from_hf(tensors)``: the params tree, fused parts concatenated along HF's
  output axis and [out, in] kernels transposed to our [in, out];
- ``Declaration.lora_targets()``: PEFT module name → ``LoraTarget``, the offsets of each part
  summed from the parts' sizes;
- ``Declaration.shapes()``: the params tree's shapes (tests check the Flax modules build the
  same, so the Flax param calls cannot drift from the declaration);
- ``Declaration.shardings(mesh)``: a ``NamedSharding`` per leaf from each param's logical
  ``axes`` (spark_jax.ops.sharding), and ``Declaration.shard_major(params, shards, ...)``: the
  tree with its fused kernels' columns in the shard-major order tensor parallelism reads
  (each shard whole heads of every part; KV heads copied where fewer than the shards).

A kernel declared with a ``quantization`` scheme (spark_jax.config.QuantizationConfig) is held
narrow (fp8 / int8, spark_jax.ops.quant) with a ``kernel_scale`` leaf beside it: ``from_hf``
quantizes a float checkpoint's tensors, or reads a compressed-tensors checkpoint's narrow
``weight`` and its ``weight_scale`` (``weight_spec(prequantized=True)`` then requires them);
``quantize`` does the same to a float params tree (random init); ``cast`` changes the float
leaves' dtype and leaves narrow kernels and scales alone.

``linear``, ``norm`` and ``embedding`` build the ``Param``s of one layer of each kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spark_jax.config import QuantizationConfig
from spark_jax.ops.lora import LoraTarget
from spark_jax.ops.quant import quantize
from spark_jax.ops.sharding import (
    DEFAULT_RULES,
    TP_AXIS,
    ShardingRules,
    fused_columns,
    named_sharding,
    replicated,
)

SCALE = "kernel_scale"  # the leaf beside a quantized kernel
HF_SCALE_SUFFIX = "_scale"  # compressed-tensors: ``<module>.weight`` + ``<module>.weight_scale``


@dataclass(frozen=True)
class WeightSpec:
    """HF tensor names and shapes a checkpoint must hold (``required``) or may hold."""

    required: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def check(self, found: dict[str, tuple[int, ...]]) -> list[str]:
        """Every problem with the found tensors: missing, unexpected and misshapen names."""
        problems = []
        missing = sorted(set(self.required) - set(found))
        if missing:
            problems.append(f"missing tensors: {', '.join(missing)}")
        known = self.required | self.optional
        unexpected = sorted(set(found) - set(known))
        if unexpected:
            problems.append(f"unexpected tensors: {', '.join(unexpected)}")
        for name, shape in sorted(found.items()):
            if name in known and tuple(shape) != tuple(known[name]):
                problems.append(
                    f"tensor {name} has shape {tuple(shape)}, expected {tuple(known[name])}"
                )
        return problems


@dataclass(frozen=True)
class Param:
    """One leaf of the params tree and the HF tensors it is made of.

    ``hf``/``shapes``: the HF tensors fused into this leaf, in order, and their HF shapes;
    several parts are concatenated along HF's first (output) axis. ``transpose``: HF stores
    the leaf [out, in], we store [in, out]. ``lora``: a kernel whose parts PEFT can adapt (the
    PEFT module of a part is its HF name less ``.weight``). ``aliases``: HF names that may
    hold a tied copy of this tensor (read never; a checkpoint may store them or not).
    ``quantization``: a [in, out] kernel held narrow, with its scales at ``scale_path``.
    ``axes``: the logical axis of each dim of the leaf (spark_jax.ops.sharding), whence its
    sharding; None: replicated. ``units``: the heads of each part along the output axis, the
    grain a shard holds whole (default: a column).
    """

    path: tuple[str, ...]
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    transpose: bool = False
    lora: bool = False
    aliases: tuple[str, ...] = ()
    quantization: QuantizationConfig | None = None
    axes: tuple[str | None, ...] | None = None
    units: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not self.hf or len(self.hf) != len(self.shapes):
            raise ValueError(f"{self.path}: give one HF shape per HF tensor (and at least one).")
        if len({s[1:] for s in self.shapes}) != 1:
            raise ValueError(f"{self.path}: fused parts must agree on all but their first axis.")
        if self.quantization is not None and not (self.transpose and len(self.hf_shape) == 2):
            raise ValueError(f"{self.path}: only [in, out] kernels of linear layers quantize.")
        if self.axes is not None and len(self.axes) != len(self.shape):
            raise ValueError(f"{self.path}: give one logical axis per dim of {self.shape}.")
        if self.units is not None and len(self.units) != len(self.hf):
            raise ValueError(f"{self.path}: give one unit count per HF tensor.")

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of the fused tensor in HF's layout (parts stacked on the first axis)."""
        return (sum(s[0] for s in self.shapes), *self.shapes[0][1:])

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape in the params tree."""
        return self.hf_shape[::-1] if self.transpose else self.hf_shape

    @property
    def scale_path(self) -> tuple[str, ...]:
        return self.path[:-1] + (SCALE,)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """A quantized kernel's scales: [out], or [in / group_size, out]."""
        in_dim, out_dim = self.shape
        group = self.quantization.group_size if self.quantization else None
        return (out_dim,) if group is None else (in_dim // group, out_dim)

    @property
    def leaf_axes(self) -> tuple[str | None, ...]:
        return self.axes if self.axes is not None else (None,) * len(self.shape)

    @property
    def scale_axes(self) -> tuple[str | None, ...]:
        return self.leaf_axes[-1:] if len(self.scale_shape) == 1 else self.leaf_axes

    def column_layout(self, shards: int) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
        """(units, unit widths, shards): the arguments of ``fused_columns`` for this leaf under
        ``shards``-way tensor parallelism; None when its columns are not reordered."""
        if shards == 1 or self.units is None:
            return None
        widths = tuple(s[0] // u for s, u in zip(self.shapes, self.units, strict=True))
        return tuple(self.units), widths, shards

    def shard_major_columns(self, shards: int) -> np.ndarray | None:
        """The order of this leaf's output columns (its last axis) under ``shards``-way tensor
        parallelism (``spark_jax.ops.sharding.fused_columns``); None: unchanged."""
        layout = self.column_layout(shards)
        return None if layout is None else fused_columns(*layout)

    def hf_scale_names(self) -> tuple[str, ...]:
        """The compressed-tensors scale of each part (``weight_scale [out, 1]``)."""
        return tuple(name + HF_SCALE_SUFFIX for name in self.hf)

    def from_hf(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """This leaf from HF tensors (a view when it is a single part), as stored there."""
        parts = [np.asarray(tensors[name]) for name in self.hf]
        value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return value.T if self.transpose else value

    def leaves(self, tensors: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
        """This param's leaves from HF tensors: the leaf, and a quantized kernel's scales,
        read from the checkpoint where it holds them (compressed-tensors), else computed."""
        value = self.from_hf(tensors)
        if self.quantization is None:
            return {self.path: value}
        names = self.hf_scale_names()
        if all(name in tensors for name in names):
            scale = np.concatenate(
                [np.asarray(tensors[name], np.float32).reshape(-1) for name in names]
            )
            return {self.path: value, self.scale_path: scale}
        return self.quantized(value)

    def quantized(self, kernel: Any) -> dict[tuple[str, ...], Any]:
        """The narrow kernel and its scales of a float ``kernel`` [in, out]."""
        q, scale = quantize(kernel, self.quantization.weights, self.quantization.group_size)
        return {self.path: q, self.scale_path: scale}


def linear(
    path: tuple[str, ...],
    modules: Sequence[str],
    in_dim: int,
    out_dims: Sequence[int],
    bias: bool = False,
    lora: bool = True,
    quantization: QuantizationConfig | None = None,
    axes: tuple[str | None, str | None] = (None, None),
    units: Sequence[int] | None = None,
) -> list[Param]:
    """A ``Linear`` (kernel [in, out], optional bias) fusing the HF linear ``modules``.

    ``out_dims``: each module's output width, in the order their columns are concatenated.
    ``quantization``: hold the kernel narrow, with its scales (the bias stays float).
    ``axes``: the kernel's logical (in, out) axes; ``units``: each module's heads (a fused
    kernel sharded along its output keeps each head whole on one shard).
    """
    if units is None and len(modules) > 1:
        units = tuple(out_dims)
    units = None if units is None else tuple(units)
    if len(modules) != len(out_dims):
        raise ValueError(f"{path}: give one output width per HF module.")
    params = [
        Param(
            path + ("kernel",),
            tuple(m + ".weight" for m in modules),
            tuple((o, in_dim) for o in out_dims),
            transpose=True,
            lora=lora,
            quantization=quantization,
            axes=axes,
            units=units,
        )
    ]
    if bias:
        params.append(
            Param(
                path + ("bias",),
                tuple(m + ".bias" for m in modules),
                tuple((o,) for o in out_dims),
                axes=axes[1:],
                units=units,
            )
        )
    return params


def norm(path: tuple[str, ...], module: str, dim: int, bias: bool = False) -> list[Param]:
    """An RMSNorm (``scale``) or, with ``bias``, a LayerNorm of HF module ``module``."""
    params = [Param(path + ("scale",), (module + ".weight",), ((dim,),))]
    if bias:
        params.append(Param(path + ("bias",), (module + ".bias",), ((dim,),)))
    return params


def embedding(
    path: tuple[str, ...], tensor: str, vocab: int, dim: int, aliases: Sequence[str] = ()
) -> list[Param]:
    """An ``nn.Embed`` table [vocab, dim] from HF tensor ``tensor`` (and its tied copies),
    vocab-parallel under tensor parallelism."""
    return [
        Param(
            path + ("embedding",),
            (tensor,),
            ((vocab, dim),),
            aliases=tuple(aliases),
            axes=("vocab", "embed"),
        )
    ]


@dataclass(frozen=True)
class Declaration:
    """Every parameter of one model config; the tree, checkpoint layout and LoRA targets."""

    params: tuple[Param, ...]

    def __post_init__(self) -> None:
        paths = [p.path for p in self.params]
        if len(set(paths)) != len(paths):
            raise ValueError("a params path is declared twice.")
        names = [n for p in self.params for n in (*p.hf, *p.aliases)]
        if len(set(names)) != len(names):
            raise ValueError("an HF tensor is declared twice.")

    @classmethod
    def of(cls, *groups: Iterable[Param]) -> Declaration:
        return cls(tuple(p for group in groups for p in group))

    @property
    def quantized(self) -> tuple[Param, ...]:
        return tuple(p for p in self.params if p.quantization is not None)

    def weight_spec(self, prequantized: bool = False) -> WeightSpec:
        """The HF tensors a checkpoint holds: every part required, every alias optional.

        ``prequantized``: a compressed-tensors checkpoint, whose quantized parts each have a
        ``weight_scale [out, 1]`` beside the (narrow) weight.
        """
        required = {n: s for p in self.params for n, s in zip(p.hf, p.shapes, strict=True)}
        if prequantized:
            for p in self.quantized:
                for name, shape in zip(p.hf_scale_names(), p.shapes, strict=True):
                    required[name] = (shape[0], 1)
        optional = {a: p.hf_shape for p in self.params for a in p.aliases}
        return WeightSpec(required=required, optional=optional)

    def from_hf(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """HF tensors (torch layout) → the params tree (kernels [in, out]); quantized kernels
        as ``Param.leaves`` reads them."""
        tree: dict[str, Any] = {}
        for p in self.params:
            for path, value in p.leaves(tensors).items():
                _set(tree, path, value)
        return tree

    def quantize(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A float params tree with every quantized kernel made narrow (its scales beside it);
        the other leaves are shared. A tree already quantized is returned as it is."""
        tree = jax.tree.map(lambda leaf: leaf, dict(params))
        for p in self.quantized:
            node = _get(tree, p.path[:-1])
            if SCALE in node:
                continue
            node.update({path[-1]: v for path, v in p.quantized(node[p.path[-1]]).items()})
        return tree

    def cast(self, params: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
        """The tree with its float leaves in ``dtype``; quantized kernels and scales kept."""
        kept = {p.path for p in self.quantized} | {p.scale_path for p in self.quantized}
        tree: dict[str, Any] = jax.tree.map(lambda leaf: leaf, dict(params))
        for p in self.params:
            if p.path not in kept:
                node = _get(tree, p.path[:-1])
                node[p.path[-1]] = np.asarray(node[p.path[-1]]).astype(dtype)
        for path in kept:
            node = _get(tree, path[:-1])
            node[path[-1]] = np.ascontiguousarray(node[path[-1]])
        return tree

    def shapes(self) -> dict[str, Any]:
        """The params tree with each leaf's shape (a tuple) in place of its array."""
        tree: dict[str, Any] = {}
        for p in self.params:
            _set(tree, p.path, p.shape)
            if p.quantization is not None:
                _set(tree, p.scale_path, p.scale_shape)
        return tree

    def shardings(self, mesh: Any, rules: ShardingRules = DEFAULT_RULES) -> dict[str, Any]:
        """The params tree with each leaf's ``NamedSharding`` on ``mesh`` in its place."""
        tree: dict[str, Any] = {}
        for p in self.params:
            _set(tree, p.path, named_sharding(mesh, p.shape, p.leaf_axes, rules))
            if p.quantization is not None:
                _set(tree, p.scale_path, named_sharding(mesh, p.scale_shape, p.scale_axes, rules))
        return tree

    def load_shardings(self, mesh: Any, rules: ShardingRules = DEFAULT_RULES) -> dict[str, Any]:
        """Shardings to restore this (one-shard) tree with before ``shard_major`` reorders it:
        a kernel whose columns move is split by rows, so its reordering moves no data off a
        device; vectors that move (fused biases, scales) are whole on every device; every
        other leaf is read straight into its final sharding."""
        shards = mesh.shape[TP_AXIS]
        tree = self.shardings(mesh, rules)
        for p in self.params:
            if p.shard_major_columns(shards) is None:
                continue
            leaves = [(p.path, p.shape)]
            if p.quantization is not None:
                leaves.append((p.scale_path, p.scale_shape))
            for path, shape in leaves:
                by_rows = len(shape) == 2 and shape[0] % shards == 0
                rows = NamedSharding(mesh, PartitionSpec(TP_AXIS, None))
                _get(tree, path[:-1])[path[-1]] = rows if by_rows else replicated(mesh)
        return tree

    def shard_major(
        self, params: Mapping[str, Any], shards: int, shardings: Mapping[str, Any]
    ) -> dict[str, Any]:
        """``params`` (this one-shard declaration's tree) for ``shards``-way tensor
        parallelism, placed at ``shardings`` (the tensor-parallel declaration's): every fused
        leaf's columns reordered shard-major (``Param.shard_major_columns``), the reorder run
        where each row block already lies, then moved to its column shards."""
        tree = jax.tree.map(lambda leaf: leaf, dict(params))
        for p in self.params:
            columns = p.shard_major_columns(shards)
            paths = [p.path] + ([p.scale_path] if p.quantization is not None else [])
            for path in paths:
                node = _get(tree, path[:-1])
                if columns is not None:
                    node[path[-1]] = jnp.take(node[path[-1]], columns, axis=-1)
        return jax.tree.map(jax.device_put, tree, dict(shardings))

    def lora_layouts(self, shards: int) -> dict[tuple[str, ...], tuple]:
        """Each adapted layer's output column layout under ``shards``-way tensor parallelism
        (``Param.column_layout``), by its Linear's path: where the adapters' updates, made in
        this (the checkpoint's) column order, go in the sharded layer's output."""
        layouts = {}
        for p in self.params:
            layout = p.column_layout(shards) if p.lora else None
            if layout is not None:
                layouts[p.path[:-1]] = layout
        return layouts

    def lora_targets(self) -> dict[str, LoraTarget]:
        """PEFT module names → where their low-rank updates land in our (fused) kernels."""
        targets = {}
        for p in self.params:
            if not p.lora:
                continue
            (total, in_dim), start = p.hf_shape, 0
            for i, (name, (out_dim, _)) in enumerate(zip(p.hf, p.shapes, strict=True)):
                module = name.removesuffix(".weight")
                targets[module] = LoraTarget(
                    p.path[:-1], i, len(p.hf), in_dim, start, out_dim, total
                )
                start += out_dim
        return targets


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if path[-1] in tree:
        raise ValueError(f"{path} is declared twice.")
    tree[path[-1]] = value
