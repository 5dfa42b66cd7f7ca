"""Multi-adapter LoRA in PEFT format: many adapters resident, each batch row its own.

Every adapter lives in a fixed-size pool, so adding, removing or mixing adapters never
changes an array shape and never recompiles. For one linear layer of the model the pool is two
dense matrices, ``a [in, n*p*R]`` and ``b [n*p*R, out]``: n adapter slots, p the projections
fused into that layer (3 for qkv, 2 for gate/up, else 1), R the pool rank. An adapter of rank
r < R is zero-padded (exact), its scaling folded into ``b``, and for fused layers ``b`` is
block-diagonal so each projection only sees its own low-rank update. A step computes

    y = x W + ((x a) * row_mask) b

where ``row_mask [B, n*p*R]`` keeps only the columns of the row's adapter: no gathers of
weights per row, and a base row (mask all zero) adds an exact zero.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTarget:
    """Where a PEFT module's update lands: a linear layer of ours and, if fused, its part."""

    path: tuple[str, ...]  # params path of our Linear, e.g. ("layers_0", "attn", "qkv_proj")
    part: int  # which fused projection (q=0, k=1, v=2 / gate=0, up=1)
    num_parts: int
    in_dim: int
    out_start: int  # the part's output columns in our fused layer
    out_dim: int
    total_out: int


@dataclass
class LoraAdapter:
    """One PEFT adapter read from disk: per PEFT module name, A [r, in] and B [out, r]."""

    name: str
    rank: int
    scale: float
    weights: dict[str, tuple[np.ndarray, np.ndarray]]


_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters with modules_to_save (fully trained extra modules)",
    "layers_to_transform": "adapters restricted with layers_to_transform",
    "rank_pattern": "adapters with a per-module rank_pattern",
    "alpha_pattern": "adapters with a per-module alpha_pattern",
}


def read_peft_adapter(path: str | Path, name: str | None = None) -> LoraAdapter:
    """Reads ``adapter_config.json`` + ``adapter_model.safetensors``; refuses what we can't run."""
    from safetensors.numpy import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"{path} is not a PEFT adapter directory: it needs adapter_config.json and "
            "adapter_model.safetensors (save the adapter with PeftModel.save_pretrained)."
        )
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(
            f"{path}: peft_type {config.get('peft_type')!r} is not supported; only LORA."
        )
    for flag, what in _UNSUPPORTED_FLAGS.items():
        if config.get(flag):
            raise ValueError(f"{path}: {what} are not supported; retrain or merge without {flag}.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: LoRA bias={config['bias']!r} is not supported; use bias='none'.")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = load_file(str(weights_file))
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for key in tensors:
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0].removeprefix(PEFT_PREFIX)
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise ValueError(
                f"{path}: {key} has no matching lora_B tensor; the file is incomplete."
            )
        weights[module] = (tensors[key].astype(np.float32), tensors[b_key].astype(np.float32))
    extra = [k for k in tensors if ".lora_A." not in k and ".lora_B." not in k]
    if extra:
        raise ValueError(
            f"{path}: tensors {extra[:3]} are not LoRA A/B matrices (trained extra modules); "
            "they are not supported."
        )
    return LoraAdapter(name or path.name, rank, scale, weights)


def _check_adapter(adapter: LoraAdapter, targets: Mapping[str, LoraTarget], max_rank: int) -> None:
    if adapter.rank > max_rank:
        raise ValueError(
            f"adapter {adapter.name!r} has rank {adapter.rank}, above the pool's max rank "
            f"{max_rank}; create the pool with max_lora_rank >= {adapter.rank}."
        )
    for module, (a, b) in adapter.weights.items():
        target = targets.get(module)
        if target is None:
            raise ValueError(
                f"adapter {adapter.name!r} targets module {module!r}, which this model cannot "
                "adapt; supported modules end in "
                f"{sorted({t.rsplit('.', 1)[-1] for t in targets})}."
            )
        expected_a, expected_b = (adapter.rank, target.in_dim), (target.out_dim, adapter.rank)
        if a.shape != expected_a or b.shape != expected_b:
            raise ValueError(
                f"adapter {adapter.name!r} module {module}: lora_A {a.shape} / lora_B {b.shape} "
                f"do not fit this model ({expected_a} / {expected_b}); it was trained for "
                "another base model."
            )


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


class LoraPool:
    """Up to ``max_adapters`` resident adapters of rank <= ``max_rank``, addressed by name."""

    def __init__(
        self,
        targets: Mapping[str, LoraTarget],
        max_adapters: int = 8,
        max_rank: int = 16,
        dtype: Any = jnp.float32,
    ):
        self.targets = dict(targets)
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.dtype = dtype
        self.names: list[str | None] = [None] * max_adapters
        # Host copies of every layer's pool matrices, keyed by our Linear's path.
        self._layers: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        for t in self.targets.values():
            if t.path not in self._layers:
                width = max_adapters * t.num_parts * max_rank
                self._layers[t.path] = {
                    "a": np.zeros((t.in_dim, width), np.float32),
                    "b": np.zeros((width, t.total_out), np.float32),
                }
        self._device: dict | None = None

    def index(self, name: str | None) -> int:
        """The slot of an adapter (-1 for the base model); unknown names are refused."""
        if name is None:
            return -1
        if name not in self.names:
            loaded = [n for n in self.names if n is not None]
            raise ValueError(f"adapter {name!r} is not loaded; loaded adapters: {loaded}.")
        return self.names.index(name)

    def add(self, adapter: LoraAdapter) -> int:
        """Copies an adapter into a free slot (validated first: a bad one changes nothing)."""
        if adapter.name in self.names:
            raise ValueError(
                f"an adapter named {adapter.name!r} is already loaded; remove it first."
            )
        _check_adapter(adapter, self.targets, self.max_rank)
        if None not in self.names:
            raise ValueError(
                f"all {self.max_adapters} adapter slots are in use; remove one or raise "
                "max_adapters."
            )
        slot = self.names.index(None)
        self._clear_slot(slot)
        for module, (a, b) in adapter.weights.items():
            t = self.targets[module]
            col = (slot * t.num_parts + t.part) * self.max_rank
            layer = self._layers[t.path]
            layer["a"][:, col : col + adapter.rank] = a.T
            rows = slice(col, col + adapter.rank)
            layer["b"][rows, t.out_start : t.out_start + t.out_dim] = b.T * adapter.scale
        self.names[slot] = adapter.name
        self._device = None
        return slot

    def remove(self, name: str) -> None:
        slot = self.index(name)
        self._clear_slot(slot)
        self.names[slot] = None
        self._device = None

    def _clear_slot(self, slot: int) -> None:
        for layer in self._layers.values():
            width = layer["a"].shape[1] // self.max_adapters
            layer["a"][:, slot * width : (slot + 1) * width] = 0.0
            layer["b"][slot * width : (slot + 1) * width] = 0.0

    def device_weights(self) -> dict:
        """The pool as a params-shaped tree of {"a", "b"} device arrays (cached until changed)."""
        if self._device is None:
            tree: dict = {}
            for path, layer in self._layers.items():
                _set(tree, path, {k: jnp.asarray(v, self.dtype) for k, v in layer.items()})
            self._device = tree
        return self._device

    def batch(self, adapter_slots: np.ndarray) -> LoraBatch:
        """The per-step input: the pool and each row's adapter slot (-1 = base)."""
        rows = jnp.asarray(adapter_slots, jnp.int32)
        return LoraBatch(self.device_weights(), rows, self.max_adapters)

    def merged_params(self, params: Any, name: str) -> Any:
        """``params`` with one adapter folded into the weights (single-adapter deployments)."""
        slot = self.index(name)
        merged = jax.tree_util.tree_map(lambda x: x, params)
        for path, layer in self._layers.items():
            width = layer["a"].shape[1] // self.max_adapters
            cols = slice(slot * width, (slot + 1) * width)
            delta = layer["a"][:, cols] @ layer["b"][cols]
            node = merged
            for key in path:
                node = node[key]
            node["kernel"] = (node["kernel"].astype(jnp.float32) + delta).astype(
                node["kernel"].dtype
            )
        return merged


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["weights", "rows"],
    meta_fields=["num_adapters"],
)
@dataclass(frozen=True)
class LoraBatch:
    """The adapter pool's weights and, per batch row, which slot applies (-1 = none)."""

    weights: dict  # params-shaped tree: Linear path -> {"a": [in, n*p*R], "b": [n*p*R, out]}
    rows: jax.Array  # int32[B]
    num_adapters: int

    def scope(self, *keys: str) -> LoraBatch | None:
        """The part of the pool under a params path (None when nothing there is adapted)."""
        node = self.weights
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                return None
            node = node[key]
        return LoraBatch(node, self.rows, self.num_adapters)

    def delta(self, x: jax.Array) -> jax.Array:
        """((x a) * row_mask) b for x [B, T, in] at a Linear's scope; zero for base rows.

        Both GEMMs accumulate in fp32 and round once to the pool's dtype (the model's), as the
        base Linear does: an fp32 output and a convert after cost a kernel per GEMM on the GPU,
        while a same-dtype result can be added to the base GEMM inside cuBLAS. Masking after
        the first rounding is exact (it keeps a value or zeroes it).
        """
        a, b = self.weights["a"], self.weights["b"]
        width = a.shape[1] // self.num_adapters
        slot_of_column = jnp.arange(a.shape[1]) // width
        mask = slot_of_column[None, None, :] == self.rows[:, None, None]
        h = jnp.einsum("btd,dr->btr", x, a, preferred_element_type=b.dtype)
        h = jnp.where(mask, h, jnp.zeros((), b.dtype))
        return jnp.einsum("btr,ro->bto", h, b, preferred_element_type=b.dtype)


def scope(lora: LoraBatch | None, *keys: str) -> LoraBatch | None:
    """``lora.scope(*keys)``, passing None through (no adapters in this step)."""
    return None if lora is None else lora.scope(*keys)
