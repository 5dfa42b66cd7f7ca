"""Draft heads: one transformer block that guesses the token after next from the target's state.

The layout of DeepSeek-V3's multi-token-prediction (MTP) module. At position p, with the
target's final hidden state h_p (which the target's LM head turns into token p + 1) and the
embedding of that next token t_{p+1}:

    x      = eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])      # Linear 2D -> D
    x      = block(x)                                           # one decoder layer, own KV cache
    h_next = shared_head.norm(x)                                # ~ h_{p+1}, the target's next state
    logits = the target's LM head(h_next)                       # the guess of t_{p+2}

The embedding and the LM head are the target's (shared, never stored here). ``h_next`` is
trained towards the target's own h_{p+1} beside the token loss, so the head can be chained:
its ``h_next`` and its draft are the next position's inputs (K drafts from one head, as
EAGLE chains its draft model). The block's attention reads the head's own KV cache: entries at
positions p hold the block's keys for (h_p, t_{p+1}).

Checkpoints hold the head's tensors under DeepSeek-V3's names relative to its MTP layer
(``eh_proj.weight``, ``enorm.weight``, ``hnorm.weight``, ``shared_head.norm.weight``,
``self_attn.q_proj.weight``, ... ``mlp.down_proj.weight``), as safetensors with the block's
shape in the metadata (``save_draft_head`` / ``load_draft_head``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import ModelConfig
from spark_jax.models.common import random_params
from spark_jax.models.decoder import DecoderLayer, DecoderLM, declare_layer
from spark_jax.models.params import Declaration, linear, norm
from spark_jax.ops.kv_cache import KVCache
from spark_jax.ops.layers import Linear, RMSNorm, rotary_angles
from spark_jax.ops.reference import AttentionMask

_BLOCK_PREFIX = "model.layers.0."  # declare_layer's HF prefix, dropped in the head's names
_SHAPE_KEYS = ("intermediate_size", "num_heads", "num_kv_heads")


def head_config(
    target: ModelConfig,
    intermediate_size: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> ModelConfig:
    """The config of a head's block for ``target``: one layer of the target's width, its
    MLP and attention heads the target's unless given (a smaller head drafts faster)."""
    num_heads = num_heads or target.num_heads
    num_kv_heads = num_kv_heads or (target.num_kv_heads if num_heads == target.num_heads else 1)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}.")
    return dataclasses.replace(
        target,
        num_layers=1,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        sliding_windows=(),
    )


# ---------------------------------------------------------------------------------------------
# Parameters: declared once (spark_jax.models.params), DeepSeek-V3's MTP names beside them.


def declare(config: ModelConfig) -> Declaration:
    """Every parameter of ``DraftHead`` for the block config ``config`` (``head_config``)."""
    d = config.hidden_size
    block = [
        dataclasses.replace(
            p,
            path=("block", *p.path[1:]),
            hf=tuple(n.removeprefix(_BLOCK_PREFIX) for n in p.hf),
            lora=False,
        )
        for p in declare_layer(config, 0)
    ]
    return Declaration.of(
        norm(("enorm",), "enorm", d),
        norm(("hnorm",), "hnorm", d),
        linear(("eh_proj",), ["eh_proj"], 2 * d, [d], lora=False),
        block,
        norm(("shared_head", "norm"), "shared_head.norm", d),
    )


# ---------------------------------------------------------------------------------------------
# The module.


class _SharedHead(nn.Module):
    """DeepSeek-V3's ``shared_head`` less its LM head (the target's): the output norm."""

    eps: float
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return RMSNorm(self.eps, self.dtype, name="norm")(x)


class DraftHead(nn.Module):
    """(embeddings of t_{p+1}, target states h_p) [B, T, D] -> h_next [B, T, D], with the cache."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, embeds, hidden, positions, mask, kv: KVCache, fresh=False):
        c = self.config
        e = RMSNorm(c.rms_norm_eps, self.dtype, name="enorm")(embeds)
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="hnorm")(hidden.astype(self.dtype))
        x = Linear(c.hidden_size, dtype=self.dtype, name="eh_proj")(jnp.concatenate([e, h], -1))
        angles = rotary_angles(positions, c.rope.inverse_frequencies(c.head_dim))
        block = DecoderLayer(c, 0, self.dtype, name="block")
        x, k, v = block(x, positions, angles, mask, kv.k[0], kv.v[0], None, fresh, None)
        h_next = _SharedHead(c.rms_norm_eps, self.dtype, name="shared_head")(x)
        return h_next, kv.with_layers((k,), (v,))


def init_cache(config: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """The head's KV cache: one layer, ``num_slots`` rows of ``max_len`` positions."""
    return KVCache.create(1, num_slots, max_len, config.num_kv_heads, config.head_dim, dtype)


def init_params(config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32) -> Any:
    """Random parameters of the head (tests, and the start of training)."""
    d = config.hidden_size
    x = jnp.zeros((1, 1, d), dtype)
    positions = jnp.zeros((1, 1), jnp.int32)
    mask = AttentionMask(query_positions=positions, key_lengths=jnp.ones((1,), jnp.int32))
    kv = init_cache(config, 1, 8, dtype)

    def init(k: jax.Array) -> Any:
        return DraftHead(config, dtype).init(k, x, x, positions, mask, kv)["params"]

    params = random_params(init, key, dtype)
    # Norm gains start at one (as trained norms sit near one), not at random draws.
    for path in (("enorm",), ("hnorm",), ("shared_head", "norm")):
        leaf = _at(params, path)
        leaf["scale"] = jnp.ones_like(leaf["scale"])
    for name in ("input_norm", "post_attn_norm"):
        params["block"][name]["scale"] = jnp.ones_like(params["block"][name]["scale"])
    return params


def _at(tree: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    for key in path:
        tree = tree[key]
    return tree


# ---------------------------------------------------------------------------------------------
# One head step (inside the speculative chunk, and the training loss).


def run_head(
    head_params: Any,
    target_params: Any,
    config: ModelConfig,
    target_config: ModelConfig,
    tokens: jax.Array,
    hidden: jax.Array,
    lengths: jax.Array,
    kv: KVCache,
    fresh: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """The head at positions kv.lengths[b] + t for inputs tokens[B, T] (t_{p+1}) and
    hidden[B, T, D] (h_p), the first ``lengths[b]`` real: (logits[B, T, V] of t_{p+2},
    h_next[B, T, D], the cache with those positions written and ``lengths`` added)."""
    h_next, kv = head_states(
        head_params, target_params, config, target_config, tokens, hidden, lengths, kv, fresh
    )
    return lm_logits(target_params, target_config, h_next), h_next, kv


def head_states(
    head_params: Any,
    target_params: Any,
    config: ModelConfig,
    target_config: ModelConfig,
    tokens: jax.Array,
    hidden: jax.Array,
    lengths: jax.Array,
    kv: KVCache,
    fresh: bool = False,
) -> tuple[jax.Array, KVCache]:
    """``run_head`` without the LM head: (h_next[B, T, D], cache).

    ``fresh``: each row starts at position 0 and attends within ``tokens`` (training).
    """
    target = DecoderLM(target_config, target_params["embed_tokens"]["embedding"].dtype)
    dtype = jax.tree_util.tree_leaves(head_params)[0].dtype
    embeds = target.apply({"params": target_params}, tokens, method=_embed)
    starts = jnp.zeros_like(lengths) if fresh else kv.lengths
    positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    mask = AttentionMask(query_positions=positions, key_lengths=starts + lengths)
    h_next, kv = DraftHead(config, dtype).apply(
        {"params": head_params}, embeds.astype(dtype), hidden, positions, mask, kv, fresh
    )
    return h_next, kv.with_lengths(starts + lengths)


def lm_logits(target_params: Any, target_config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """The target's LM head (shared with the head) on states [..., D]: fp32 logits [..., V]."""
    target = DecoderLM(target_config, target_params["embed_tokens"]["embedding"].dtype)
    return target.apply(
        {"params": target_params}, hidden.astype(target.dtype), method=DecoderLM.logits
    )


def _embed(module: DecoderLM, tokens: jax.Array) -> jax.Array:
    return module.embed_tokens(tokens)


# ---------------------------------------------------------------------------------------------
# Checkpoints: safetensors under DeepSeek-V3's MTP names, the block's shape in the metadata.


def save_draft_head(
    path: str | Path, params: Any, config: ModelConfig, dtype: Any = jnp.bfloat16
) -> None:
    """Writes the head's tensors (torch layout, ``dtype``) and its block shape to ``path``."""
    from safetensors.numpy import save_file

    tensors = {}
    for p in declare(config).params:
        value = np.asarray(jnp.asarray(_at(params, p.path[:-1])[p.path[-1]], dtype))
        value = value.T if p.transpose else value
        start = 0
        for name, shape in zip(p.hf, p.shapes, strict=True):
            part = value[start : start + shape[0]]
            tensors[name] = np.ascontiguousarray(part.view(np.uint16) if _is_bf16(part) else part)
            start += shape[0]
    metadata = {k: str(getattr(config, k)) for k in _SHAPE_KEYS}
    metadata["dtype"] = jnp.dtype(dtype).name
    save_file(tensors, str(path), metadata=metadata)


def load_draft_head(
    path: str | Path, target: ModelConfig, dtype: Any = None
) -> tuple[Any, ModelConfig]:
    """(params, block config) of a head written by ``save_draft_head`` (or any safetensors file
    with those names) for the target config ``target``; ``dtype`` defaults to the file's."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    shape = {k: int(metadata[k]) for k in _SHAPE_KEYS if k in metadata}
    config = head_config(target, **shape)
    stored = jnp.dtype(metadata.get("dtype", "float32"))
    if stored == jnp.bfloat16:
        tensors = {k: v.view(jnp.bfloat16) for k, v in tensors.items()}
    problems = declare(config).weight_spec().check({k: v.shape for k, v in tensors.items()})
    if problems:
        raise ValueError(f"{path} is not a draft head for this model: {'; '.join(problems)}.")
    tree = declare(config).from_hf(tensors)
    want = jnp.dtype(dtype) if dtype is not None else stored
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, want), tree), config


def _is_bf16(x: np.ndarray) -> bool:
    return x.dtype == jnp.bfloat16


def weight_names(config: ModelConfig) -> Mapping[str, tuple[int, ...]]:
    """The tensor names and shapes a head checkpoint of this block config holds."""
    return declare(config).weight_spec().required
