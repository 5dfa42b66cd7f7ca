"""Multi-adapter LoRA in PEFT format: many adapters resident, each batch row its own.

Every adapter lives in a fixed-size pool, so adding, removing or mixing adapters never
changes an array shape and never recompiles. For one linear layer of the model the pool is two
dense arrays: ``a [in, p*n*R]`` and ``b [K, n*R, c]``; n adapter slots, p the projections fused
into that layer (3 for qkv, 2 for gate/up, else 1), R the pool rank. An adapter of rank r < R
is zero-padded (exact) and its scaling folded into ``b``. ``a``'s columns are part-major
(part, slot, rank). The layer's output columns are cut into K chunks of one width c (the gcd
of the parts' widths: Llama's qkv 4+1+1 chunks of the kv width, gate/up 1+1), and ``b`` holds
each chunk's rows of every slot, so each projection only sees its own update with no
block-diagonal zeros. A step computes

    y = x W + concat_k( (h[part(k)] * row_mask) b[k] ),    h = x a  [B, p, n*R]

one batched GEMM over the chunks, where ``row_mask [B, n*R]`` keeps only the columns of the
row's adapter: no gathers of weights per row, and a base row (mask all zero) adds an exact zero.

``x a`` as a GEMM of its own is thin (one launch per adapted layer, with few output tiles to
spread over the GPU). ``LoraPool.fused_params`` stores ``a`` beside ``W`` instead, as the extra
columns of one kernel ``[in, out + p*n*R]``: the base GEMM then yields ``x W`` and ``x a``
together, and a step's ``LoraBatch`` (``batch(rows, fused=True)``) carries only ``b``. It
returns a new params tree (the given one stays intact and valid); ``spark_jax.model.Model``
builds it when LoRA is enabled and at every adapter add or remove, so steps only read params.
Once fused, kernels stay fused (``Linear`` slices a widened kernel's output when a step has no
adapter). The decoder fuses; NLLB runs the pool path.

Adapters are also trained here in JAX: ``init_lora_weights`` starts one as PEFT does,
``merge_lora`` folds it into the params differentiably (a loss over the model's forward then
has its gradient), and ``save_peft_adapter`` writes it back in PEFT's format.
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

from spark_jax.ops.sharding import fused_columns, replicated

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


def save_peft_adapter(
    path: str | Path,
    adapter: LoraAdapter,
    base_model_name_or_path: str | None = None,
    task_type: str = "CAUSAL_LM",
) -> Path:
    """Writes ``adapter`` as a PEFT LoRA directory (``adapter_config.json`` +
    ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` and
    ``read_peft_adapter`` load.

    ``target_modules`` lists the full module names, so PEFT adapts exactly those (an adapter of
    a few layers stays one). ``task_type``: PEFT's, "SEQ_2_SEQ_LM" for an NLLB adapter.
    """
    from safetensors.numpy import save_file

    if not adapter.weights:
        raise ValueError(f"adapter {adapter.name!r} has no weights to save; train some modules.")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for module, (a, b) in sorted(adapter.weights.items()):
        if a.shape[0] != adapter.rank or b.shape[1] != adapter.rank:
            raise ValueError(
                f"adapter {adapter.name!r} module {module}: lora_A {a.shape} / lora_B {b.shape} "
                f"are not of its rank {adapter.rank} (A [r, in], B [out, r])."
            )
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b, np.float32)
    alpha = adapter.scale * adapter.rank
    config = {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": adapter.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(adapter.weights),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


# ---------------------------------------------------------------------------------------------
# Training: adapter weights as a pytree of jnp arrays, folded into the params differentiably.


def init_lora_weights(
    targets: Mapping[str, LoraTarget], modules: list[str], rank: int, key: jax.Array
) -> dict[str, tuple[jax.Array, jax.Array]]:
    """PEFT's initial LoRA of ``modules``: per module (A [r, in], B [out, r]), A drawn as
    PEFT's kaiming-uniform (a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zero, so training
    starts from the base model."""
    unknown = [m for m in modules if m not in targets]
    if unknown:
        raise ValueError(
            f"modules {unknown[:3]} cannot be adapted in this model; pick from its LoRA targets "
            f"(e.g. {sorted(targets)[:2]})."
        )
    keys = jax.random.split(key, len(modules))
    weights = {}
    for k, module in zip(keys, modules, strict=True):
        t = targets[module]
        bound = 1.0 / math.sqrt(t.in_dim)
        a = jax.random.uniform(k, (rank, t.in_dim), jnp.float32, -bound, bound)
        weights[module] = (a, jnp.zeros((t.out_dim, rank), jnp.float32))
    return weights


def merge_lora(
    params: Mapping,
    targets: Mapping[str, LoraTarget],
    weights: Mapping[str, tuple[jax.Array, jax.Array]],
    scale: float,
) -> dict:
    """``params`` with each module's ``scale * (B A)`` added to its part of our (fused) kernel:
    a new tree, differentiable in ``weights`` (what a training step takes the gradient of).
    ``params`` must be plain (not ``LoraPool.fused_params``)."""
    updates: dict[tuple[str, ...], jax.Array] = {}
    for module, (a, b) in weights.items():
        t = targets[module]
        key = t.path + ("kernel",)
        kernel = updates.get(key, _get(params, key))
        if kernel.shape[1] != t.total_out:
            raise ValueError(
                f"{module}: its kernel is fused with adapter columns; merge plain params."
            )
        delta = (scale * (a.T @ b.T)).astype(kernel.dtype)  # [in, out]
        updates[key] = kernel.at[:, t.out_start : t.out_start + t.out_dim].add(delta)
    return _replace(params, updates)


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


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _replace(tree: Mapping, updates: Mapping[tuple[str, ...], Any]) -> dict:
    """A copy of ``tree`` with the leaves at ``updates``' paths replaced.

    Only the dicts on those paths are new; every other node and leaf is shared, and ``tree``
    itself is left as it was.
    """
    out = dict(tree)
    below: dict[str, dict[tuple[str, ...], Any]] = {}
    for path, value in updates.items():
        if len(path) == 1:
            out[path[0]] = value
        else:
            below.setdefault(path[0], {})[path[1:]] = value
    for key, sub in below.items():
        out[key] = _replace(tree[key], sub)
    return out


@jax.jit
def _write_columns(kernel: jax.Array, a: jax.Array) -> jax.Array:
    """A new fused kernel: ``kernel`` ``[W | a']`` with its last columns replaced by ``a``."""
    return jax.lax.dynamic_update_slice(kernel, a, (0, kernel.shape[1] - a.shape[1]))


@jax.jit
def _widen(kernel: jax.Array, a: jax.Array) -> jax.Array:
    """``[W | a]`` from a plain kernel: a new, wider array (``kernel`` is left as it was)."""
    return jnp.concatenate([kernel, a], axis=1)


class LoraPool:
    """Up to ``max_adapters`` resident adapters of rank <= ``max_rank``, addressed by name."""

    def __init__(
        self,
        targets: Mapping[str, LoraTarget],
        max_adapters: int = 8,
        max_rank: int = 16,
        dtype: Any = jnp.float32,
        layouts: Mapping[tuple[str, ...], tuple] | None = None,
        mesh: Any = None,
    ):
        """``layouts`` and ``mesh``: a tensor-parallel model's (``Declaration.lora_layouts``
        of its checkpoint's declaration): each update, made in the checkpoint's column order,
        is put in the sharded layer's, and the pool is held whole on every device."""
        self.targets = dict(targets)
        self.layouts = dict(layouts or {})
        self.mesh = mesh
        self.max_adapters = max_adapters
        self.max_rank = max_rank
        self.dtype = dtype
        self.names: list[str | None] = [None] * max_adapters
        self.version = 0  # bumped by every add / remove (fused params of an older one are stale)
        parts: dict[tuple[str, ...], dict[int, LoraTarget]] = {}
        for t in self.targets.values():
            parts.setdefault(t.path, {})[t.part] = t
        # Per Linear path: its chunk width and each part's number of chunks (static), and the
        # host copies of its pool arrays.
        self._chunks: dict[tuple[str, ...], tuple[int, tuple[int, ...]]] = {}
        self._layers: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        for path, by_part in parts.items():
            ordered = [by_part[i] for i in range(len(by_part))]
            starts = np.cumsum([0] + [t.out_dim for t in ordered])
            if [t.out_start for t in ordered] != list(starts[:-1]) or starts[-1] != ordered[
                0
            ].total_out:
                raise ValueError(f"{path}: the fused parts do not tile the layer's output columns.")
            width = math.gcd(*(t.out_dim for t in ordered))
            counts = tuple(t.out_dim // width for t in ordered)
            self._chunks[path] = (width, counts)
            slots = max_adapters * max_rank
            self._layers[path] = {
                "a": np.zeros((ordered[0].in_dim, len(counts) * slots), np.float32),
                "b": np.zeros((sum(counts), slots, width), np.float32),
            }
        # Device trees of the pool arrays, per tuple of keys (cleared by every change).
        self._device: dict[tuple[str, ...], dict] = {}

    @property
    def num_loaded(self) -> int:
        return sum(n is not None for n in self.names)

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
        rows = slice(slot * self.max_rank, slot * self.max_rank + adapter.rank)
        for module, (a, b) in adapter.weights.items():
            t = self.targets[module]
            layer = self._layers[t.path]
            width, counts = self._chunks[t.path]
            col = (t.part * self.max_adapters + slot) * self.max_rank
            layer["a"][:, col : col + adapter.rank] = a.T
            first = sum(counts[: t.part])
            scaled = (b.T * adapter.scale).reshape(adapter.rank, counts[t.part], width)
            layer["b"][first : first + counts[t.part], rows] = scaled.transpose(1, 0, 2)
        self.names[slot] = adapter.name
        self._changed()
        return slot

    def remove(self, name: str) -> None:
        slot = self.index(name)
        self._clear_slot(slot)
        self.names[slot] = None
        self._changed()

    def _changed(self) -> None:
        self._device = {}
        self.version += 1

    def _clear_slot(self, slot: int) -> None:
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for layer in self._layers.values():
            for part in range(layer["a"].shape[1] // (self.max_adapters * self.max_rank)):
                layer["a"][:, self._columns(part, slot)] = 0.0
            layer["b"][:, rows] = 0.0

    def _columns(self, part: int, slot: int) -> slice:
        """The columns of ``a`` that hold one slot's A of one fused part."""
        col = (part * self.max_adapters + slot) * self.max_rank
        return slice(col, col + self.max_rank)

    def device_weights(self, keys: tuple[str, ...] = ("a", "b")) -> dict:
        """The pool as a params-shaped tree of {"a", "b"} device arrays (cached until changed).

        ``keys``: the arrays to upload; a fused step needs only ``("b",)`` (its A's are in the
        kernels, so A is not resident twice).
        """
        if keys not in self._device:
            tree: dict = {}
            for path, layer in self._layers.items():
                _set(tree, path, {k: jnp.asarray(layer[k], self.dtype) for k in keys})
            if self.mesh is not None:
                tree = jax.device_put(tree, replicated(self.mesh))
            self._device[keys] = tree
        return self._device[keys]

    def batch(self, adapter_slots: np.ndarray, fused: bool = False) -> LoraBatch:
        """The per-step input: the pool and each row's adapter slot (-1 = base).

        ``fused``: for params fused by ``fused_params``, whose kernels hold the A's; the batch then
        carries only the B's.
        """
        rows = jnp.asarray(adapter_slots, jnp.int32)
        weights = self.device_weights(("b",) if fused else ("a", "b"))
        chunks = tuple((path, counts) for path, (_, counts) in self._chunks.items())
        layouts = tuple(self.layouts.items())
        return LoraBatch(weights, rows, self.max_adapters, chunks, layouts)

    def fused_params(self, params: Mapping) -> dict:
        """A new params tree whose adapted kernels hold the pool's A beside W.

        A plain kernel ``[in, out]`` becomes ``[W | a]`` (``[in, out + p*n*R]``); a fused one
        gets its A columns rewritten, so after the first fuse no shape changes. The result
        shares every other leaf with ``params``; ``params`` is left intact and valid (nothing
        is deleted or donated), so a caller holding it, or a tree sharing its dicts, keeps
        the weights it had. Steps then take ``batch(rows, fused=True)``, or no adapter input at
        all (``Linear`` drops the A columns of the output).
        """
        updates = {
            path + ("kernel",): self._fused_kernel(path, _get(params, path)["kernel"])
            for path in self._layers
        }
        return _replace(params, updates)

    def fuse_into(self, params: dict) -> None:
        """``fused_params`` written into ``params``' own dicts, for a caller that owns the tree.

        Each old kernel is only dropped from its dict, never deleted: it is freed once nothing
        else holds it, so a sole owner needs no second copy of the weights. ``Model`` never
        uses this (it keeps the trees it handed out intact).
        """
        for path in self._layers:
            node = _get(params, path)
            node["kernel"] = self._fused_kernel(path, node["kernel"])

    def _fused_kernel(self, path: tuple[str, ...], kernel: Any) -> jax.Array:
        a = jnp.asarray(self._layers[path]["a"], kernel.dtype)
        if kernel.shape[1] == self._out_dim(path):
            kernel = _widen(kernel, a)
        # Also after widening (rewriting the same columns): the first fuse, when LoRA is
        # enabled (before an engine's warm-up), then compiles the rewrite too, and a later add
        # or remove compiles nothing.
        return _write_columns(kernel, a)

    def merged_params(self, params: Any, name: str) -> Any:
        """``params`` with one adapter folded into the weights (single-adapter deployments).

        ``params`` may be plain or fused (``fused_params``); the result is a new, plain tree either
        way (the A columns of a fused kernel are dropped), fit to save or to serve alone.
        """
        slot = self.index(name)
        for path in self._layers:
            if jnp.dtype(_get(params, path)["kernel"].dtype).itemsize == 1:
                raise ValueError(
                    f"adapter {name!r} cannot be merged into a quantized model's narrow kernels; "
                    "serve it per request (SamplingParams.adapter) or merge into the float model."
                )
        merged = jax.tree_util.tree_map(lambda x: x, params)
        rows = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for path, layer in self._layers.items():
            _, counts = self._chunks[path]
            parts = np.repeat(np.arange(len(counts)), counts)
            delta = np.concatenate(
                [
                    layer["a"][:, self._columns(p, slot)] @ layer["b"][k, rows]
                    for k, p in enumerate(parts)
                ],
                axis=1,
            )
            node = _get(merged, path)
            kernel = node["kernel"][:, : self._out_dim(path)]
            node["kernel"] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
        return merged

    def _out_dim(self, path: tuple[str, ...]) -> int:
        return self._layers[path]["b"].shape[0] * self._chunks[path][0]


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["weights", "rows"],
    meta_fields=["num_adapters", "chunks", "layouts"],
)
@dataclass(frozen=True)
class LoraBatch:
    """The adapter pool's weights and, per batch row, which slot applies (-1 = none)."""

    weights: dict  # params-shaped tree: Linear path -> {"a": [in, p*n*R], "b": [K, n*R, c]}
    rows: jax.Array  # int32[B]
    num_adapters: int
    chunks: tuple = ()  # (Linear path under this scope, chunks of each fused part) pairs
    layouts: tuple = ()  # (Linear path, its tensor-parallel column layout) pairs, if any

    def scope(self, *keys: str) -> LoraBatch | None:
        """The part of the pool under a params path (None when nothing there is adapted)."""
        node = self.weights
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                return None
            node = node[key]
        n = len(keys)
        chunks = tuple((path[n:], c) for path, c in self.chunks if path[:n] == keys)
        layouts = tuple((path[n:], c) for path, c in self.layouts if path[:n] == keys)
        return LoraBatch(node, self.rows, self.num_adapters, chunks, layouts)

    @property
    def part_chunks(self) -> tuple[int, ...]:
        """At a Linear's scope: how many output chunks each of its fused parts has."""
        return dict(self.chunks)[()]

    @property
    def kernel_columns(self) -> int:
        """Columns of A stored beside W in this scope's Linear kernel (0: A is in the pool)."""
        b = self.weights["b"]
        return 0 if "a" in self.weights else len(self.part_chunks) * b.shape[1]

    def delta(self, x: jax.Array) -> jax.Array:
        """The adapters' update for x [B, T, in] at a Linear's scope; zero for base rows.

        x a accumulates in fp32 and rounds once to the pool's dtype (the model's), as the base
        Linear does; masking after that rounding is exact (it keeps a value or zeroes it). The
        ·b GEMM returns fp32 (``project``).
        """
        a, b = self.weights["a"], self.weights["b"]
        return self.project(jnp.einsum("btd,dr->btr", x, a, preferred_element_type=b.dtype))

    def project(self, h: jax.Array) -> jax.Array:
        """The update from h = x a [B, T, p*n*R] (from the pool or a fused kernel): each part's
        h masked to the row's slot, then one GEMM batched over the output chunks.

        The GEMM returns fp32 and the caller's add rounds once: measured on the H200 (Llama-3-8B
        shapes, B=32, 8 adapters) +14.0% -> +10.6% over no adapters, against a bf16 result
        (XLA then adds it in a kernel of its own instead of the consumer's fusion).
        """
        b = self.weights["b"]  # [K, n*R, c]
        counts = self.part_chunks
        width = b.shape[1] // self.num_adapters
        mask = (jnp.arange(b.shape[1]) // width)[None, :] == self.rows[:, None]  # [B, n*R]
        h = h.astype(b.dtype).reshape(*h.shape[:2], len(counts), b.shape[1])
        h = jnp.where(mask[:, None, None, :], h, jnp.zeros((), b.dtype))
        # A part of several chunks (q over its 4 chunks at Llama's GQA 4): its h feeds each.
        h = jnp.repeat(h, np.asarray(counts), axis=2, total_repeat_length=b.shape[0])
        out = jnp.einsum("btkr,krc->btkc", h, b, preferred_element_type=jnp.float32)
        out = out.reshape(*out.shape[:2], -1)
        layout = dict(self.layouts).get(())
        order = None if layout is None else fused_columns(*layout)
        # Under tensor parallelism the layer's columns are shard-major: the update follows.
        return out if order is None else jnp.take(out, order, axis=-1)


def scope(lora: LoraBatch | None, *keys: str) -> LoraBatch | None:
    """``lora.scope(*keys)``, passing None through (no adapters in this step)."""
    return None if lora is None else lora.scope(*keys)


def adapter_slot(lora_pool: LoraPool | None, name: str | None) -> int:
    """The pool slot of an adapter name (-1: the base model); unknown names are refused."""
    if name is None:
        return -1
    if lora_pool is None:
        raise ValueError(f"adapter {name!r} is not loaded; add it with Model.add_adapter.")
    return lora_pool.index(name)
