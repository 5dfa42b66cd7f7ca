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
  same, so the Flax param calls cannot drift from the declaration).

``linear``, ``norm`` and ``embedding`` build the ``Param``s of one layer of each kind.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spark_jax.ops.lora import LoraTarget


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
    """

    path: tuple[str, ...]
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    transpose: bool = False
    lora: bool = False
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.hf or len(self.hf) != len(self.shapes):
            raise ValueError(f"{self.path}: give one HF shape per HF tensor (and at least one).")
        if len({s[1:] for s in self.shapes}) != 1:
            raise ValueError(f"{self.path}: fused parts must agree on all but their first axis.")

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape of the fused tensor in HF's layout (parts stacked on the first axis)."""
        return (sum(s[0] for s in self.shapes), *self.shapes[0][1:])

    @property
    def shape(self) -> tuple[int, ...]:
        """The leaf's shape in the params tree."""
        return self.hf_shape[::-1] if self.transpose else self.hf_shape

    def from_hf(self, tensors: Mapping[str, Any]) -> np.ndarray:
        """This leaf from HF tensors (a view when it is a single part)."""
        parts = [np.asarray(tensors[name]) for name in self.hf]
        value = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return value.T if self.transpose else value


def linear(
    path: tuple[str, ...],
    modules: Sequence[str],
    in_dim: int,
    out_dims: Sequence[int],
    bias: bool = False,
    lora: bool = True,
) -> list[Param]:
    """A ``Linear`` (kernel [in, out], optional bias) fusing the HF linear ``modules``.

    ``out_dims``: each module's output width, in the order their columns are concatenated.
    """
    if len(modules) != len(out_dims):
        raise ValueError(f"{path}: give one output width per HF module.")
    params = [
        Param(
            path + ("kernel",),
            tuple(m + ".weight" for m in modules),
            tuple((o, in_dim) for o in out_dims),
            transpose=True,
            lora=lora,
        )
    ]
    if bias:
        params.append(
            Param(
                path + ("bias",), tuple(m + ".bias" for m in modules), tuple((o,) for o in out_dims)
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
    """An ``nn.Embed`` table [vocab, dim] from HF tensor ``tensor`` (and its tied copies)."""
    return [Param(path + ("embedding",), (tensor,), ((vocab, dim),), aliases=tuple(aliases))]


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

    def weight_spec(self) -> WeightSpec:
        """The HF tensors a checkpoint holds: every part required, every alias optional."""
        required = {n: s for p in self.params for n, s in zip(p.hf, p.shapes, strict=True)}
        optional = {a: p.hf_shape for p in self.params for a in p.aliases}
        return WeightSpec(required=required, optional=optional)

    def from_hf(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """HF tensors (torch layout) → the params tree (numpy arrays, kernels [in, out])."""
        tree: dict[str, Any] = {}
        for p in self.params:
            _set(tree, p.path, p.from_hf(tensors))
        return tree

    def shapes(self) -> dict[str, Any]:
        """The params tree with each leaf's shape (a tuple) in place of its array."""
        tree: dict[str, Any] = {}
        for p in self.params:
            _set(tree, p.path, p.shape)
        return tree

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


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    if path[-1] in tree:
        raise ValueError(f"{path} is declared twice.")
    tree[path[-1]] = value
