"""The M2M100 / NLLB-200 encoder-decoder (``M2M100ForConditionalGeneration``).

Reads top to bottom: checkpoint layout → positions → layers → model → jitted steps → the
engine-facing runner. Architecture (HF's modeling_m2m_100): one shared embedding scaled by
sqrt(d_model), fairseq sinusoidal positions that start at ``pad_token_id + 1`` and skip pad
tokens, pre-LayerNorm blocks with biased projections and a ReLU FFN, a final LayerNorm on
each stack, and the LM head tied to the shared embedding. Layers are unrolled (DESIGN.md).

    encode(params, config, src[B,S], src_len[B])                      -> hidden[B,S,D]
    prefill(params, config, src, src_len, seed[B,T0], slots[B], cache) -> (logits[B,V], cache)
    decode(params, config, tokens[R], active[R], cache)                -> (logits[R,V], cache)
    forward(params, config, src, src_len, decoder_tokens[B,T])         -> logits[B,T,V]
    reorder_rows(cache, source_rows[R], with_cross)                    -> cache

``prefill`` runs the encoder, projects every decoder layer's cross-attention K/V once into
cache rows ``slots``, then runs the decoder seed ``[decoder_start (= eos), target language]``;
the forced language token is never sampled. ``decode`` runs every row of the cache in order
(R = num_slots), so reading the cache never copies it. Sources are right-padded with
``pad_token_id``; ``src_len`` masks the padding.

Every step but ``reorder_rows`` takes ``options`` (``KernelOptions``, static: one program per
value), which the attention and LayerNorm calls follow, and an optional ``lora``
(``spark_jax.ops.lora.LoraBatch``), one adapter slot per batch row: at prefill the encoder,
the cross K/V projection and the seed run with the request's adapter, so the cached cross K/V
already carry it.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import NllbConfig
from spark_jax.models.common import ForwardOutput, bucket, random_params
from spark_jax.models.params import Declaration, Param, WeightSpec, embedding, linear, norm
from spark_jax.ops.attention import attention, cache_step_attention, packed_cache_step_attention
from spark_jax.ops.kv_cache import EncoderDecoderCache, write_kv
from spark_jax.ops.layers import LayerNorm, Linear, sinusoidal_table
from spark_jax.ops.lora import LoraBatch, LoraTarget, scope
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask, attention_probabilities
from spark_jax.ops.sharding import host_array, split_fused

# ---------------------------------------------------------------------------------------------
# Parameters: each declared once (spark_jax.models.params), HF names and shapes beside it.
# Self-attention Q/K/V are fused into one matmul; cross-attention K/V are fused (projected once
# per request, with the request's adapter), Q stays apart.


def declare_layer(config: NllbConfig, stack: str, i: int) -> list[Param]:
    """The parameters of layer ``i`` of ``stack`` ("encoder": ``EncoderLayer``, "decoder":
    ``DecoderLayer``, which adds cross-attention)."""
    d, p, layer = config.d_model, f"model.{stack}.layers.{i}.", f"{stack}_layers_{i}"
    f = config.encoder_ffn_dim if stack == "encoder" else config.decoder_ffn_dim
    n = config.encoder_attention_heads if stack == "encoder" else config.decoder_attention_heads
    attn = p + "self_attn."
    columns, rows = ("embed", "heads"), ("heads", "embed")
    params = [
        *norm((layer, "self_attn_norm"), p + "self_attn_layer_norm", d, bias=True),
        *linear(
            (layer, "self_attn", "qkv_proj"),
            [attn + "q_proj", attn + "k_proj", attn + "v_proj"],
            d,
            [d, d, d],
            bias=True,
            axes=columns,
            units=[n, n, n],
        ),
        *linear(
            (layer, "self_attn", "out_proj"), [attn + "out_proj"], d, [d], bias=True, axes=rows
        ),
        *norm((layer, "ffn_norm"), p + "final_layer_norm", d, bias=True),
        *linear((layer, "mlp", "fc1"), [p + "fc1"], d, [f], bias=True, axes=("embed", "mlp")),
        *linear((layer, "mlp", "fc2"), [p + "fc2"], f, [d], bias=True, axes=("mlp", "embed")),
    ]
    if stack == "decoder":
        cross = p + "encoder_attn."
        params += [
            *norm((layer, "cross_attn_norm"), p + "encoder_attn_layer_norm", d, bias=True),
            *linear(
                (layer, "cross_attn", "q_proj"), [cross + "q_proj"], d, [d], True, axes=columns
            ),
            *linear(
                (layer, "cross_attn", "kv_proj"),
                [cross + "k_proj", cross + "v_proj"],
                d,
                [d, d],
                bias=True,
                axes=columns,
                units=[n, n],
            ),
            *linear(
                (layer, "cross_attn", "out_proj"), [cross + "out_proj"], d, [d], True, axes=rows
            ),
        ]
    return params


def declare(config: NllbConfig) -> Declaration:
    """Every parameter of ``Nllb`` for this config. ``model.shared.weight`` is the embedding;
    the per-stack embeddings and ``lm_head.weight`` are the same tied tensor in HF, so a
    checkpoint may store them or not."""
    d, v = config.d_model, config.vocab_size
    copies = ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"]
    return Declaration.of(
        embedding(("shared",), "model.shared.weight", v, d, aliases=[*copies, "lm_head.weight"]),
        norm(("encoder_norm",), "model.encoder.layer_norm", d, bias=True),
        norm(("decoder_norm",), "model.decoder.layer_norm", d, bias=True),
        *(declare_layer(config, "encoder", i) for i in range(config.encoder_layers)),
        *(declare_layer(config, "decoder", i) for i in range(config.decoder_layers)),
    )


def weight_spec(config: NllbConfig) -> WeightSpec:
    """The HF tensors a checkpoint of this config holds, with their shapes."""
    return declare(config).weight_spec()


def params_from_hf(config: NllbConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """HF tensors (torch layout, [out, in]) → this model's params tree (kernels [in, out])."""
    return declare(config).from_hf(tensors)


def lora_targets(config: NllbConfig) -> dict[str, LoraTarget]:
    """PEFT module names → where their low-rank updates land in our (fused) layers."""
    return declare(config).lora_targets()


# ---------------------------------------------------------------------------------------------
# Positions: fairseq's, as HF computes them from the token ids.


def position_ids(tokens: jax.Array, pad_token_id: int, past_lengths: jax.Array) -> jax.Array:
    """HF's ``create_position_ids_from_input_ids``: int32[B, T].

    Non-pad tokens count from ``pad_token_id + 1`` (continuing after ``past_lengths`` earlier
    tokens); pad tokens sit at ``pad_token_id``, whose table row is zero.
    """
    real = (tokens != pad_token_id).astype(jnp.int32)
    return (jnp.cumsum(real, axis=1) + past_lengths[:, None]) * real + pad_token_id


def _position_table_size(config: NllbConfig, *lengths: int) -> int:
    # HF grows its table on demand; a static table covering every buffer is the same rows.
    return max(config.max_position_embeddings, *lengths) + config.pad_token_id + 2


# ---------------------------------------------------------------------------------------------
# Layers.


def _heads(x: jax.Array, num_heads: int) -> jax.Array:
    """[B, T, D] → [B, T, N, H]."""
    return x.reshape(*x.shape[:-1], num_heads, x.shape[-1] // num_heads)


def _merge_heads(x: jax.Array) -> jax.Array:
    """[B, T, N, H] → [B, T, D]."""
    return x.reshape(*x.shape[:-2], -1)


class SelfAttention(nn.Module):
    """Biased multi-head self-attention; with ``cache`` (k, v) the new keys are appended first.

    ``fresh``: every row starts at position 0, so it attends to the new keys alone and never
    reads (gathers) its longer cache row. ``row_table``: the cache's (beam search), read
    through by ``packed_cache_step_attention``. ``shards``: the fused Q/K/V columns are held
    shard-major over that many devices (spark_jax.ops.sharding); the packed read is then
    skipped (its [3N] heads would cross shards) and the parts are split per shard.
    """

    d_model: int
    num_heads: int
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()
    shards: int = 1

    @nn.compact
    def __call__(
        self,
        x,
        mask,
        cache=None,
        slots=None,
        cache_positions=None,
        lora=None,
        fresh=False,
        row_table=None,
    ):
        qkv = Linear(3 * self.d_model, use_bias=True, dtype=self.dtype, name="qkv_proj")(
            x, scope(lora, "qkv_proj")
        )
        d = self.d_model
        if cache is not None and not fresh and self.shards > 1:
            q, k, v = (_heads(p, self.num_heads) for p in split_fused(qkv, (d, d, d), self.shards))
            out, *cache = cache_step_attention(
                q, k, v, *cache, slots, cache_positions, mask, row_table, options=self.options
            )
            cache = tuple(cache)
        elif cache is not None and not fresh:
            # [B, T, 3N, H]: queries, keys and values side by side, split where they are read.
            out, *cache = packed_cache_step_attention(
                _heads(qkv, 3 * self.num_heads),
                *cache,
                slots,
                cache_positions,
                mask,
                row_table,
                options=self.options,
            )
            cache = tuple(cache)
        else:
            parts = split_fused(qkv, (d, d, d), self.shards)
            q, k, v = (_heads(part, self.num_heads) for part in parts)
            # For the research forward (``forward_outputs``); a no-op in every other step.
            self.sow("intermediates", "queries", q)
            self.sow("intermediates", "keys", k)
            if cache is not None:
                pairs = zip(cache, (k, v), strict=True)
                cache = tuple(write_kv(buf, new, slots, cache_positions) for buf, new in pairs)
            out = attention(q, k, v, mask, options=self.options)
        out = _merge_heads(out)
        out_proj = Linear(self.d_model, use_bias=True, dtype=self.dtype, name="out_proj")
        return out_proj(out, scope(lora, "out_proj")), cache


class CrossAttention(nn.Module):
    """Decoder → encoder attention. ``project_kv`` runs once per request, at prefill."""

    d_model: int
    num_heads: int
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()
    shards: int = 1  # the fused K/V columns held shard-major over that many devices

    def setup(self):
        self.q_proj = Linear(self.d_model, use_bias=True, dtype=self.dtype)
        self.kv_proj = Linear(2 * self.d_model, use_bias=True, dtype=self.dtype)
        self.out_proj = Linear(self.d_model, use_bias=True, dtype=self.dtype)

    def project_kv(
        self, encoder_hidden: jax.Array, lora: LoraBatch | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """[B, S, D] → k, v [B, S, N, H] (with each row's adapter on k/v)."""
        kv = self.kv_proj(encoder_hidden, scope(lora, "kv_proj"))
        k, v = split_fused(kv, (self.d_model, self.d_model), self.shards)
        return _heads(k, self.num_heads), _heads(v, self.num_heads)

    def __call__(self, x, k, v, mask, lora=None):
        q = _heads(self.q_proj(x, scope(lora, "q_proj")), self.num_heads)
        self.sow("intermediates", "queries", q)  # for ``forward_outputs``, as in SelfAttention
        out = _merge_heads(attention(q, k, v, mask, options=self.options))
        return self.out_proj(out, scope(lora, "out_proj"))


class ReluMLP(nn.Module):
    d_model: int
    ffn_dim: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x, lora=None):
        h = Linear(self.ffn_dim, use_bias=True, dtype=self.dtype, name="fc1")(x, scope(lora, "fc1"))
        h = jax.nn.relu(h)
        return Linear(self.d_model, use_bias=True, dtype=self.dtype, name="fc2")(
            h, scope(lora, "fc2")
        )


class EncoderLayer(nn.Module):
    config: NllbConfig
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()

    @nn.compact
    def __call__(self, x, mask, lora=None):
        c, options = self.config, self.options
        norm = partial(LayerNorm, c.layer_norm_eps, self.dtype, options)
        heads = c.encoder_attention_heads
        attn = SelfAttention(
            c.d_model, heads, self.dtype, options, c.tensor_parallel, name="self_attn"
        )
        x = x + attn(norm(name="self_attn_norm")(x), mask, lora=scope(lora, "self_attn"))[0]
        mlp = ReluMLP(c.d_model, c.encoder_ffn_dim, self.dtype, name="mlp")
        return x + mlp(norm(name="ffn_norm")(x), scope(lora, "mlp"))


class DecoderLayer(nn.Module):
    config: NllbConfig
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()

    def setup(self):
        c, heads, options = self.config, self.config.decoder_attention_heads, self.options
        self.self_attn_norm = LayerNorm(c.layer_norm_eps, self.dtype, options)
        self.self_attn = SelfAttention(c.d_model, heads, self.dtype, options, c.tensor_parallel)
        self.cross_attn_norm = LayerNorm(c.layer_norm_eps, self.dtype, options)
        self.cross_attn = CrossAttention(c.d_model, heads, self.dtype, options, c.tensor_parallel)
        self.ffn_norm = LayerNorm(c.layer_norm_eps, self.dtype, options)
        self.mlp = ReluMLP(c.d_model, c.decoder_ffn_dim, self.dtype)

    def __call__(
        self, x, self_mask, cross_mask, kv, cross_kv, slots, cache_positions, lora, fresh, table
    ):
        """kv: this layer's (k, v) cache buffers; cross_kv: (k, v) [B, S_src, N, H] to read;
        table: the cache's row table (or None)."""
        h, kv = self.self_attn(
            self.self_attn_norm(x),
            self_mask,
            kv,
            slots,
            cache_positions,
            scope(lora, "self_attn"),
            fresh,
            table,
        )
        x = x + h
        cross_lora = scope(lora, "cross_attn")
        x = x + self.cross_attn(self.cross_attn_norm(x), *cross_kv, cross_mask, cross_lora)
        return x + self.mlp(self.ffn_norm(x), scope(lora, "mlp")), kv


class Nllb(nn.Module):
    """The encoder and decoder stacks around one shared embedding; methods are the phases."""

    config: NllbConfig
    dtype: jnp.dtype = jnp.float32
    options: KernelOptions = KernelOptions()

    def setup(self):
        c, dtype, options = self.config, self.dtype, self.options
        self.shared = nn.Embed(c.vocab_size, c.d_model, dtype=dtype, param_dtype=dtype)
        self.encoder_layers = [EncoderLayer(c, dtype, options) for _ in range(c.encoder_layers)]
        self.encoder_norm = LayerNorm(c.layer_norm_eps, dtype, options)
        self.decoder_layers = [DecoderLayer(c, dtype, options) for _ in range(c.decoder_layers)]
        self.decoder_norm = LayerNorm(c.layer_norm_eps, dtype, options)

    def embed(self, tokens, positions, table_size: int):
        """Scaled token embedding plus the sinusoidal position embedding, summed in fp32."""
        c = self.config
        scale = float(np.sqrt(c.d_model)) if c.scale_embedding else 1.0
        table = jnp.asarray(sinusoidal_table(table_size, c.d_model, c.pad_token_id))
        x = self.shared(tokens).astype(jnp.float32) * scale + table[positions]
        return x.astype(self.dtype)

    def encode(self, src, src_len, lora=None):
        """Source ids [B, S] (right-padded) → final encoder hidden states [B, S, D]."""
        positions = position_ids(src, self.config.pad_token_id, jnp.zeros_like(src_len))
        x = self.embed(src, positions, _position_table_size(self.config, src.shape[1]))
        mask = AttentionMask(jnp.zeros_like(src), src_len, causal=False)
        for i, layer in enumerate(self.encoder_layers):
            x = layer(x, mask, scope(lora, f"encoder_layers_{i}"))
        return self.encoder_norm(x)

    def cross_kv(self, encoder_hidden, lora=None):
        """Every decoder layer's cross-attention (k, v), each [B, S, N, H]."""
        kvs = []
        for i, layer in enumerate(self.decoder_layers):
            layer_lora = scope(lora, f"decoder_layers_{i}", "cross_attn")
            kvs.append(layer.cross_attn.project_kv(encoder_hidden, layer_lora))
        return tuple(kvs)

    def decode(
        self,
        tokens,
        starts,
        num_new,
        cross_kv,
        source_lengths,
        cache,
        slots,
        lora=None,
        fresh=False,
        row_table=None,
    ):
        """Runs tokens[B, T] at cache positions starts[b] + t; returns hidden and new (k, v)s.

        ``cross_kv`` holds each layer's (k, v) rows for this batch; ``cache`` the self-attention
        (k, v) buffers, written at rows ``slots`` (every row in order when None); ``lora`` the
        adapter of each of the B rows; ``fresh``: every start is 0 (attention stays in tokens);
        ``row_table``: the cache's (beam search), with every row in order.
        """
        c = self.config
        cache_positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)
        positions = position_ids(tokens, c.pad_token_id, starts)
        x = self.embed(tokens, positions, _position_table_size(c, cache[0][0].shape[1]))
        self_mask = AttentionMask(cache_positions, starts + num_new)
        cross_mask = AttentionMask(jnp.zeros_like(tokens), source_lengths, causal=False)
        new_cache = []
        layers = zip(self.decoder_layers, cache, cross_kv, strict=True)
        for i, (layer, kv, layer_cross) in enumerate(layers):
            layer_lora = scope(lora, f"decoder_layers_{i}")
            x, kv = layer(
                x,
                self_mask,
                cross_mask,
                kv,
                layer_cross,
                slots,
                cache_positions,
                layer_lora,
                fresh,
                row_table,
            )
            new_cache.append(kv)
        return self.decoder_norm(x), tuple(new_cache)

    def logits(self, hidden):
        """fp32 logits of hidden states [..., D] through the tied LM head."""
        table = self.shared.embedding
        return jnp.einsum("...d,vd->...v", hidden, table, preferred_element_type=jnp.float32)

    def init_all(self, src, src_len, tokens, cache):
        """Touches every parameter once, for ``init``."""
        cross = self.cross_kv(self.encode(src, src_len))
        zeros = jnp.zeros_like(src_len)
        hidden, _ = self.decode(tokens, zeros, zeros + 1, cross, src_len, cache, None)
        return self.logits(hidden)


# ---------------------------------------------------------------------------------------------
# Steps. Each is one jitted function; the cache is donated so XLA updates it in place.


# One jitted call allocates every buffer: built op by op, the 4 x layers + 2 zero arrays were
# as many dispatches on each generate call (~50 at NLLB-600M's 12 decoder layers).
@partial(
    jax.jit,
    static_argnames=("config", "num_slots", "max_len", "max_source_len", "dtype", "row_table"),
)
def init_cache(
    config: NllbConfig,
    num_slots: int,
    max_len: int,
    max_source_len: int,
    dtype: jnp.dtype,
    row_table: bool = False,
) -> EncoderDecoderCache:
    heads = config.decoder_attention_heads
    return EncoderDecoderCache.create(
        config.decoder_layers,
        num_slots,
        max_len,
        max_source_len,
        heads,
        config.d_model // heads,
        dtype,
        row_table,
    )


def _params_dtype(params: dict[str, Any]) -> jnp.dtype:
    return params["shared"]["embedding"].dtype


def _self_kv(cache: EncoderDecoderCache):
    return tuple(zip(cache.k, cache.v, strict=True))


def _with_self_kv(cache: EncoderDecoderCache, kvs, lengths) -> EncoderDecoderCache:
    k, v = zip(*kvs, strict=True)
    return dataclasses.replace(cache, k=tuple(k), v=tuple(v), lengths=lengths)


@partial(jax.jit, static_argnames=("config", "options"))
def encode(
    params,
    config: NllbConfig,
    src,
    src_len,
    lora: LoraBatch | None = None,
    *,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """Source ids [B, S] (right-padded with pad) → encoder hidden states [B, S, D]."""
    model = Nllb(config, _params_dtype(params), options)
    return model.apply({"params": params}, src, src_len, lora, method=Nllb.encode)


@partial(jax.jit, static_argnames=("config", "options"), donate_argnames=("cache",))
def prefill(
    params,
    config: NllbConfig,
    src,
    src_len,
    seed,
    slots,
    cache: EncoderDecoderCache,
    lora: LoraBatch | None = None,
    *,
    options: KernelOptions = KernelOptions(),
) -> tuple[jax.Array, EncoderDecoderCache]:
    """Encodes src[B, S] into rows ``slots`` and runs the decoder seed[B, T0]; last logits [B,V].

    Slots past the cache (padding of a bucketed batch) are dropped by every write. ``lora``
    rows follow the B batch rows: the encoder, the cross K/V and the seed use each one's adapter.
    """
    model = Nllb(config, _params_dtype(params), options)
    apply = partial(model.apply, {"params": params})
    cross = apply(apply(src, src_len, lora, method=Nllb.encode), lora, method=Nllb.cross_kv)
    source_positions = jnp.broadcast_to(jnp.arange(src.shape[1]), src.shape)
    write = lambda buffers, new: tuple(
        write_kv(b, x, slots, source_positions) for b, x in zip(buffers, new, strict=True)
    )
    starts = jnp.zeros_like(src_len)
    num_new = jnp.full_like(src_len, seed.shape[1])
    hidden, kvs = apply(
        seed,
        starts,
        num_new,
        cross,
        src_len,
        _self_kv(cache),
        slots,
        lora,
        fresh=True,
        method=Nllb.decode,
    )
    k, v = zip(*kvs, strict=True)
    row_table = cache.row_table
    if row_table is not None:  # a prefilled row reads its own positions
        own = jnp.broadcast_to(slots[:, None], (slots.shape[0], row_table.shape[1]))
        row_table = row_table.at[slots].set(own, mode="drop")
    cache = EncoderDecoderCache(
        k=tuple(k),
        v=tuple(v),
        cross_k=write(cache.cross_k, [kv[0] for kv in cross]),
        cross_v=write(cache.cross_v, [kv[1] for kv in cross]),
        lengths=cache.lengths.at[slots].set(num_new, mode="drop"),
        source_lengths=cache.source_lengths.at[slots].set(src_len, mode="drop"),
        row_table=row_table,
    )
    return apply(hidden[:, -1], method=Nllb.logits), cache


def _decode_rows(
    params, tokens, active, cache, lora, *, config: NllbConfig, options: KernelOptions
):
    """``decode`` with the config and options bound, in the argument order of
    ``NllbRunner.decode_fn``."""
    return decode(params, config, tokens, active, cache, lora, options=options)


@partial(jax.jit, static_argnames=("config", "options"), donate_argnames=("cache",))
def decode(
    params,
    config: NllbConfig,
    tokens,
    active,
    cache: EncoderDecoderCache,
    lora: LoraBatch | None = None,
    *,
    options: KernelOptions = KernelOptions(),
) -> tuple[jax.Array, EncoderDecoderCache]:
    """One token per cache row; rows where ``active`` is False keep their length.

    ``lora`` rows follow the cache rows (the cross K/V already hold each row's adapter).
    """
    model = Nllb(config, _params_dtype(params), options)
    apply = partial(model.apply, {"params": params})
    num_new = active.astype(jnp.int32)
    cross = tuple(zip(cache.cross_k, cache.cross_v, strict=True))
    hidden, kvs = apply(
        tokens[:, None],
        cache.lengths,
        num_new,
        cross,
        cache.source_lengths,
        _self_kv(cache),
        None,
        lora,
        row_table=cache.row_table,
        method=Nllb.decode,
    )
    cache = _with_self_kv(cache, kvs, cache.lengths + num_new)
    return apply(hidden[:, 0], method=Nllb.logits), cache


@partial(jax.jit, static_argnames=("config", "options"))
def forward(
    params,
    config: NllbConfig,
    src,
    src_len,
    decoder_tokens,
    lora: LoraBatch | None = None,
    *,
    options: KernelOptions = KernelOptions(),
):
    """Teacher-forced logits [B, T, V] of decoder_tokens[B, T] (HF's full forward)."""
    model = Nllb(config, _params_dtype(params), options)
    apply = partial(model.apply, {"params": params})
    cross = apply(apply(src, src_len, lora, method=Nllb.encode), lora, method=Nllb.cross_kv)
    b, t = decoder_tokens.shape
    scratch = init_cache(config, b, t, 1, _params_dtype(params))
    zeros = jnp.zeros_like(src_len)
    hidden, _ = apply(
        decoder_tokens,
        zeros,
        zeros + t,
        cross,
        src_len,
        _self_kv(scratch),
        None,
        lora,
        fresh=True,
        method=Nllb.decode,
    )
    return apply(hidden, method=Nllb.logits)


def _records_layer(module: nn.Module, method_name: str) -> bool:
    """Flax ``capture_intermediates`` filter: the decoder's embedding and each layer's output."""
    if isinstance(module, Nllb):
        return method_name == "embed"
    return method_name == "__call__" and isinstance(module, DecoderLayer)


@partial(
    jax.jit,
    static_argnames=("config", "output_hidden_states", "output_attentions", "options"),
)
def forward_outputs(
    params,
    config: NllbConfig,
    src,
    src_len,
    decoder_tokens,
    lora: LoraBatch | None = None,
    *,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    options: KernelOptions = KernelOptions(implementation="xla", pallas_layer_norm=False),
) -> ForwardOutput:
    """``forward``'s logits [B, T, V] and, when asked, the decoder side of what HF returns:
    ``decoder_hidden_states``, ``decoder_attentions`` and ``cross_attentions`` (research).

    ``decoder_tokens`` may be right-padded: causal attention keeps padding out of the
    positions before it.
    """
    model = Nllb(config, _params_dtype(params), options)
    apply = partial(model.apply, {"params": params})
    cross = apply(apply(src, src_len, lora, method=Nllb.encode), lora, method=Nllb.cross_kv)
    b, t = decoder_tokens.shape
    scratch = init_cache(config, b, t, 1, _params_dtype(params))
    zeros = jnp.zeros_like(src_len)
    args = (decoder_tokens, zeros, zeros + t, cross, src_len, _self_kv(scratch), None, lora)
    if not (output_hidden_states or output_attentions):
        hidden, _ = apply(*args, fresh=True, method=Nllb.decode)
        return ForwardOutput(apply(hidden, method=Nllb.logits))
    (hidden, _), state = apply(
        *args,
        fresh=True,
        method=Nllb.decode,
        capture_intermediates=_records_layer,
        mutable=["intermediates"],
    )
    recorded = state["intermediates"]
    layers = [recorded[f"decoder_layers_{i}"] for i in range(config.decoder_layers)]
    hidden_states = attentions = cross_attentions = None
    if output_hidden_states:
        outputs = [layer["__call__"][0][0] for layer in layers[:-1]]  # (x, kv) per layer
        hidden_states = (recorded["embed"][0], *outputs, hidden)
    if output_attentions:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        self_mask = AttentionMask(positions, zeros + t)
        cross_mask = AttentionMask(jnp.zeros_like(decoder_tokens), src_len, causal=False)
        attentions = tuple(
            attention_probabilities(
                layer["self_attn"]["queries"][0], layer["self_attn"]["keys"][0], self_mask
            )
            for layer in layers
        )
        cross_attentions = tuple(
            attention_probabilities(layer["cross_attn"]["queries"][0], k, cross_mask)
            for layer, (k, _) in zip(layers, cross, strict=True)
        )
    logits = apply(hidden, method=Nllb.logits)
    return ForwardOutput(logits, hidden_states, attentions, cross_attentions)


@partial(jax.jit, static_argnames=("with_cross",), donate_argnames=("cache",))
def reorder_rows(
    cache: EncoderDecoderCache, source_rows, with_cross: bool = False
) -> EncoderDecoderCache:
    """Row r becomes row ``source_rows[r]`` (beam search); a gather on device."""
    return cache.gather_rows(source_rows, with_cross)


def init_params(
    config: NllbConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32
) -> dict[str, Any]:
    """Random parameters of the right tree and shapes (benchmarks and tests)."""
    model = Nllb(config, dtype)
    cache = _self_kv(init_cache(config, 1, 4, 4, dtype))
    src = jnp.full((1, 4), config.eos_token_id, jnp.int32)
    src_len = jnp.full((1,), 4, jnp.int32)
    tokens = jnp.zeros((1, 1), jnp.int32)

    def init(k: jax.Array) -> Any:
        return model.init(k, src, src_len, tokens, cache, method=Nllb.init_all)["params"]

    return random_params(init, key, dtype)


# ---------------------------------------------------------------------------------------------
# The engine-facing runner: validation, language codes, padding and bucketing around the steps.


class NllbRunner:
    """Drives the NLLB steps for the engine (``spark_jax.model.Runner``) and for beam search.

    ``tokenizer`` maps language codes to ids: a ``spark_jax.tokenizer.Tokenizer`` or a plain
    ``{code: id}`` mapping. ``default_tgt_lang`` is used by requests that name no target.
    """

    is_encoder_decoder = True
    # Adapters enter a step as the pool's arrays, with or without adapter rows: one program.
    adapter_rows_change_the_program = False

    def __init__(
        self,
        config: NllbConfig,
        params: dict[str, Any],
        tokenizer: Any = None,
        default_tgt_lang: str | None = None,
        options: KernelOptions = KernelOptions(),
    ):
        self.config = config
        self.options = options  # the kernels every step of this runner compiles with
        self.params = params
        self.tokenizer = tokenizer
        self.default_tgt_lang = default_tgt_lang
        self.dtype = _params_dtype(params)
        self.eos_token_ids: tuple[int, ...] = config.eos_token_ids
        self.lora_pool: Any = None  # a spark_jax.ops.lora.LoraPool once an adapter is added
        self.mesh: Any = None  # the Model sets its tensor-parallel mesh (caches by heads)
        # The pure decode step, for the engine's device loops (see decoder.Runner.decode_fn).
        self.decode_fn = partial(_decode_rows, config=config, options=options)

    # -- requests ---------------------------------------------------------------------------

    @property
    def max_source_len(self) -> int:
        """The longest source accepted: the model's positions minus fairseq's offset of 2."""
        return self.config.max_position_embeddings - 2

    def language_id(self, code: str) -> int:
        """The token id of an NLLB language code; ValueError naming close codes if unknown."""
        if self.tokenizer is None:
            raise ValueError(
                f"language code {code!r} given but this model has no tokenizer to map it; "
                "load a checkpoint with its tokenizer or pass a {code: id} mapping."
            )
        if isinstance(self.tokenizer, Mapping):
            if code in self.tokenizer:
                return int(self.tokenizer[code])
            close = difflib.get_close_matches(code, list(self.tokenizer), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ValueError(f"unknown language code {code!r}{hint}")
        return int(self.tokenizer.lang_code_to_id(code))

    def target_language_id(self, request: Any) -> int:
        """The forced first target token of a request: its ``tgt_lang``, else the default."""
        code = (request.tgt_lang if request is not None else None) or self.default_tgt_lang
        if code is None:
            raise ValueError(
                "no target language: set tgt_lang on the request (e.g. 'fra_Latn') or give "
                "the runner a default_tgt_lang."
            )
        return self.language_id(code)

    @property
    def language_ids(self) -> frozenset[int]:
        """The token ids of every language code this runner's tokenizer knows."""
        if self.tokenizer is None:
            return frozenset()
        if isinstance(self.tokenizer, Mapping):
            return frozenset(int(i) for i in self.tokenizer.values())
        return frozenset(self.tokenizer.lang_code_to_id(c) for c in self.tokenizer.language_codes)

    def source_tokens(self, prompt: Sequence[int], request: Any = None) -> list[int]:
        """The source as the encoder reads it, ``[src_lang] tokens </s>``; ValueError for a
        source the model cannot translate.

        A raw source (text tokens only) of a request naming ``src_lang`` gets the language
        token and ``</s>`` around it, as HF's ``NllbTokenizer`` builds it; a source that
        already starts with a language token is used as is (it must be ``src_lang``'s when the
        request names one), and so is a raw source without ``src_lang``.
        """
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the source is empty; give at least one token ([src_lang] ... </s>).")
        src_lang = None if request is None else request.src_lang
        if src_lang is not None:
            language = self.language_id(src_lang)
            if ids[0] not in self.language_ids:
                ids = [language, *ids, self.config.eos_token_id]
            elif ids[0] != language:
                raise ValueError(
                    f"the source starts with another language's token than {src_lang!r}; drop "
                    "that token (the source is then built from src_lang) or fix src_lang."
                )
        if len(ids) > self.max_source_len:
            raise ValueError(
                f"the source has {len(ids)} tokens but this model's positions allow at most "
                f"{self.max_source_len} (max_position_embeddings - 2); split the text."
            )
        return ids

    def check_source(self, prompt: Sequence[int], request: Any = None) -> None:
        """ValueError for a source the model cannot translate (see ``source_tokens``)."""
        self.source_tokens(prompt, request)

    # -- the Runner protocol ----------------------------------------------------------------

    def init_state(
        self, num_slots: int, max_len: int, max_prompt_len: int = 0, row_table: bool = False
    ) -> EncoderDecoderCache:
        """``max_len`` decoder positions per row (seed included); sources up to max_prompt_len;
        ``row_table``: rows read their history through a table (beam search's reorder)."""
        max_source = bucket(min(max(max_prompt_len, 1), self.max_source_len))
        cache = init_cache(self.config, num_slots, max_len, max_source, self.dtype, row_table)
        return cache if self.mesh is None else jax.device_put(cache, cache.shardings(self.mesh))

    def prefill(
        self,
        state: EncoderDecoderCache,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        requests: Sequence[Any] = (),
        adapters: Sequence[int] | None = None,
    ) -> tuple[jax.Array, EncoderDecoderCache]:
        """Encodes each source into its slot and seeds the decoder; logits [len(slots), V].

        ``adapters``: each prompt's adapter slot (-1 = base) for the encoder, the cross K/V and
        the seed. Every request is validated before any device work, so an error leaves
        ``state`` untouched (it is donated only once all of them pass).
        """
        args = self._prefill_args(state, slots, prompts, requests, adapters)
        logits, state = prefill(*args, options=self.options)
        return logits[: len(prompts)], state

    def lower_prefill(
        self,
        state: EncoderDecoderCache,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        requests: Sequence[Any] = (),
        adapters: Sequence[int] | None = None,
    ) -> jax.stages.Lowered:
        """``prefill``'s program for these inputs, traced but neither compiled nor run (the
        engine compiles its shapes on threads, then its calls find them compiled)."""
        args = self._prefill_args(state, slots, prompts, requests, adapters)
        return prefill.lower(*args, options=self.options)

    def _prefill_args(self, state, slots, prompts, requests, adapters) -> tuple:
        """Validates every request, then pads the batch: the arguments of ``prefill``."""
        requests = list(requests) or [None] * len(prompts)
        prompts = [self.source_tokens(p, r) for p, r in zip(prompts, requests, strict=True)]
        for prompt in prompts:
            if len(prompt) > state.max_source_len:
                raise ValueError(
                    f"the source has {len(prompt)} tokens but the cache holds sources of at "
                    f"most {state.max_source_len}; raise max_prompt_len in init_state."
                )
        targets = [self.target_language_id(r) for r in requests]
        n = len(prompts)
        rows = bucket(n, minimum=1)
        c = self.config
        src = np.full((rows, bucket(max(len(p) for p in prompts))), c.pad_token_id, np.int32)
        src_len = np.ones((rows,), np.int32)
        src[:, 0] = c.eos_token_id  # padding rows: a one-token source, written nowhere
        seed = np.full((rows, 2), c.decoder_start_token_id, np.int32)
        slot_ids = np.full((rows,), state.num_slots, np.int32)  # out of range: dropped
        for row, (prompt, target, slot) in enumerate(zip(prompts, targets, slots, strict=True)):
            src[row, : len(prompt)] = prompt
            src_len[row] = len(prompt)
            seed[row, 1] = target
            slot_ids[row] = slot
        # Host arrays: the jitted call moves them in one batched transfer (a jnp.asarray
        # apiece would be a dispatch each).
        return (self.params, c, src, src_len, seed, slot_ids, state, self._lora(adapters, rows))

    def prefill_chunk(self, *args: Any, **kwargs: Any) -> None:
        """Chunked prefill does not apply to an encoder-decoder: refused."""
        raise ValueError(
            "chunked prefill is not supported for NLLB / M2M100: the encoder must see the "
            "whole source at once (its attention is bidirectional), so the source is encoded "
            "in one prefill; disable chunked prefill for this model."
        )

    def decode(
        self,
        state: EncoderDecoderCache,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None = None,
    ) -> tuple[jax.Array, EncoderDecoderCache]:
        """One token per cache row; ``adapters`` gives each cache row's adapter slot."""
        lora = self._lora(adapters, state.num_slots)
        return decode(self.params, self.config, tokens, active, state, lora, options=self.options)

    def lower_decode(
        self,
        state: EncoderDecoderCache,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None = None,
    ) -> jax.stages.Lowered:
        """``decode``'s program for these inputs, traced but neither compiled nor run."""
        lora = self._lora(adapters, state.num_slots)
        return decode.lower(
            self.params, self.config, tokens, active, state, lora, options=self.options
        )

    def reorder_rows(
        self, state: EncoderDecoderCache, source_rows: jax.Array, with_cross: bool = False
    ) -> EncoderDecoderCache:
        """Row r becomes row ``source_rows[r]`` (cross K/V too when ``with_cross``)."""
        return reorder_rows(state, source_rows, with_cross)

    def lora_input(self, adapters: Sequence[int]) -> LoraBatch | None:
        """The adapter input of a step whose cache rows use ``adapters`` (for ``decode_fn``)."""
        return self._lora(adapters, len(adapters))

    def lora_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` as steps with this runner's pool read them: unchanged (NLLB's steps take
        A and B from the pool, ``LoraPool.batch``)."""
        return params

    def _lora(self, adapters: Sequence[int] | None, rows: int) -> LoraBatch | None:
        """The step's adapter input for ``rows`` batch rows (past ``adapters``: the base).

        None when no adapter is loaded or none was asked for.
        """
        if self.lora_pool is None or adapters is None:
            return None
        if len(adapters) > rows:
            raise ValueError(f"{len(adapters)} adapter slots given for a batch of {rows} rows.")
        slots = np.full((rows,), -1, np.int32)
        slots[: len(adapters)] = adapters
        return self.lora_pool.batch(slots)

    def logits(
        self, src_ids: Sequence[int], decoder_ids: Sequence[int], adapter: int | None = None
    ) -> np.ndarray:
        """float32 [T_dec, V]: HF's teacher-forced logits of one source and decoder sequence.

        ``adapter``: the pool slot of a LoRA adapter (None or -1: the base model).
        """
        self.check_source(src_ids)
        if len(decoder_ids) == 0:
            raise ValueError("decoder_ids is empty; start it with decoder_start_token_id.")
        pad = self.config.pad_token_id
        src = np.full((1, bucket(len(src_ids))), pad, np.int32)
        src[0, : len(src_ids)] = src_ids
        # Padding after the last decoder token cannot change earlier positions (causal).
        dec = np.full((1, bucket(len(decoder_ids))), pad, np.int32)
        dec[0, : len(decoder_ids)] = decoder_ids
        out = forward(
            self.params,
            self.config,
            jnp.asarray(src),
            jnp.asarray([len(src_ids)], jnp.int32),
            jnp.asarray(dec),
            self._lora(None if adapter is None else [adapter], 1),
            options=self.options,
        )
        return host_array(out)[0, : len(decoder_ids)].astype(np.float32)


Runner = NllbRunner  # the name ``spark_jax.model.Model`` looks up in every family
