"""The decoder-only family: Llama, Mistral, Qwen2, Qwen3 (and SmolLM2, a Llama).

Reads top to bottom: checkpoint layout → layer → model → jitted steps. The layers are
unrolled Python modules (never ``lax.scan``: the scanned decode step measured 2.9x slower on
the H200, DESIGN.md). Every step is one function of (params, tokens, cache):

    prefill(params, config, tokens[B,T], lengths[B], slots[B], kv) -> (logits[B,V], kv)
      (ragged=True: tokens[N], the rows' tokens one after another: ``ragged_rows``; with
      decode_slots[S] too, those cache rows decode a token each in the same forward, after
      the rows' tokens: (logits[B,V], logits[S,V]))
    decode(params, config, tokens[B], active[B], kv)               -> (logits[B,V], kv)
    verify(params, config, tokens[B,T], lengths[B], kv)            -> (logits[B,T,V], kv)

``prefill`` writes rows ``slots`` of the cache; ``decode`` and ``verify`` run every row of
the cache in order, so reading the cache never copies it. Every step takes ``options``
(``KernelOptions``, static: one program per value), which the attention calls follow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import ModelConfig
from spark_jax.models.common import ForwardOutput, bucket, random_params
from spark_jax.models.params import Declaration, Param, WeightSpec, embedding, linear, norm
from spark_jax.models.wide_gemm import argument, jit_by_rows
from spark_jax.ops.attention import attention, cache_attention, ragged_query_block
from spark_jax.ops.kv_cache import KVCache, write_kv
from spark_jax.ops.layers import GatedMLP, Linear, RMSNorm, apply_rotary, rotary_angles
from spark_jax.ops.lora import LoraTarget, scope
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask, attention_probabilities
from spark_jax.ops.sharding import host_array, split_fused

# ---------------------------------------------------------------------------------------------
# Parameters: each declared once (spark_jax.models.params), HF names and shapes beside it. Q/K/V
# and gate/up are fused so a decode step reads each layer's weights in two matmuls, not five.


def declare_layer(config: ModelConfig, i: int) -> list[Param]:
    """The parameters of decoder layer ``i`` (``DecoderLayer``)."""
    c, p, layer = config, f"model.layers.{i}.", f"layers_{i}"
    d, f, q, kv = c.hidden_size, c.intermediate_size, c.q_size, c.kv_size
    attn, quant = p + "self_attn.", c.quantization
    params = [
        *norm((layer, "input_norm"), p + "input_layernorm", d),
        *norm((layer, "post_attn_norm"), p + "post_attention_layernorm", d),
        *linear(
            (layer, "attn", "qkv_proj"),
            [attn + "q_proj", attn + "k_proj", attn + "v_proj"],
            d,
            [q, kv, kv],
            bias=c.qkv_bias,
            quantization=quant,
            axes=("embed", "heads"),
            units=[c.num_heads, c.num_kv_heads, c.num_kv_heads],
        ),
        *linear(
            (layer, "attn", "o_proj"),
            [attn + "o_proj"],
            q,
            [d],
            quantization=quant,
            axes=("heads", "embed"),
        ),
        *linear(
            (layer, "mlp", "gate_up_proj"),
            [p + "mlp.gate_proj", p + "mlp.up_proj"],
            d,
            [f, f],
            quantization=quant,
            axes=("embed", "mlp"),
        ),
        *linear(
            (layer, "mlp", "down_proj"),
            [p + "mlp.down_proj"],
            f,
            [d],
            quantization=quant,
            axes=("mlp", "embed"),
        ),
    ]
    if c.qk_norm:
        params += norm((layer, "attn", "q_norm"), attn + "q_norm", c.head_dim)
        params += norm((layer, "attn", "k_norm"), attn + "k_norm", c.head_dim)
    return params


def declare(config: ModelConfig) -> Declaration:
    """Every parameter of ``DecoderLM`` for this config. A tied LM head is the embedding, so a
    checkpoint's ``lm_head.weight`` is then an optional copy."""
    c, d = config, config.hidden_size
    tied = c.tie_word_embeddings
    quant = c.quantization if c.quantization and c.quantization.lm_head else None
    head = (
        []
        if tied
        else linear(
            ("lm_head",), ["lm_head"], d, [c.vocab_size], False, False, quant, ("embed", "vocab")
        )
    )
    return Declaration.of(
        embedding(
            ("embed_tokens",),
            "model.embed_tokens.weight",
            c.vocab_size,
            d,
            aliases=["lm_head.weight"] if tied else [],
        ),
        norm(("final_norm",), "model.norm", d),
        head,
        *(declare_layer(c, i) for i in range(c.num_layers)),
    )


def weight_spec(config: ModelConfig) -> WeightSpec:
    """The HF tensors a checkpoint of this config holds, with their shapes."""
    return declare(config).weight_spec()


def params_from_hf(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """HF tensors (torch layout, [out, in]) → this model's params tree (kernels [in, out])."""
    return declare(config).from_hf(tensors)


def lora_targets(config: ModelConfig) -> dict[str, LoraTarget]:
    """PEFT module names → where their low-rank updates land in our fused layers."""
    return declare(config).lora_targets()


# ---------------------------------------------------------------------------------------------
# The model.


class AttentionRows(NamedTuple):
    """How a ragged batch's queries are laid out for attention: ``[R, width]`` rows, row i
    holding ``lengths[i]`` queries at positions ``starts[i]``, ``starts[i] + 1``, ... of
    cache row ``slots[i]`` (seeing its keys up to its last query), and each token of the flat
    stream at ``places[j]`` of that layout (``R * width``, out of range: padding)."""

    places: jax.Array  # int32[N]
    slots: jax.Array  # int32[R]
    starts: jax.Array  # int32[R]
    lengths: jax.Array  # int32[R]
    width: int


def _owners(sizes: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Items 0..n-1 laid out one after another, ``sizes[b]`` of them for owner b, then the
    rest unowned: each item's owner (the last for an unowned one), whether it has one, and
    its index within its owner."""
    ends = jnp.cumsum(sizes)
    i = jnp.arange(n, dtype=jnp.int32)
    owner = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
    owner_ = jnp.minimum(owner, sizes.shape[0] - 1)
    return owner_, owner < sizes.shape[0], i - (ends - sizes)[owner_]


def ragged_rows(lengths: jax.Array, num_tokens: int) -> jax.Array:
    """A ragged batch's token places: the rows' tokens lie one after another in a flat stream
    of ``num_tokens`` (row 0's ``lengths[0]``, then row 1's, ..., then padding), and token j
    goes to place ``row * T + t`` of the rows' ``[R, T]`` layout (T = ``num_tokens``: one
    row may hold them all); padding goes to ``R * T``, out of range, so it is dropped."""
    row, real, t = _owners(lengths, num_tokens)
    return jnp.where(real, row * num_tokens + t, lengths.shape[0] * num_tokens)


def chunk_rows(
    lengths: jax.Array, starts: jax.Array, slots: jax.Array, num_tokens: int
) -> AttentionRows:
    """One attention row per chunk of a ragged batch, as long as the stream (``ragged_rows``):
    R x N places for N tokens, most of them padding."""
    return AttentionRows(ragged_rows(lengths, num_tokens), slots, starts, lengths, num_tokens)


def block_rows(
    lengths: jax.Array, starts: jax.Array, slots: jax.Array, num_tokens: int, block: int
) -> AttentionRows:
    """A ragged batch's chunks cut into attention rows of ``block`` queries: chunk b's
    ``lengths[b]`` queries take ceil(lengths[b] / block) rows, each starting at its first
    query's position of cache row ``slots[b]`` (it reads its keys from the cache, which
    holds the chunk's own by then). N tokens over R chunks take at most
    (N + R (block - 1)) // block rows, the count the layout has; unused ones see nothing."""
    count = (num_tokens + lengths.shape[0] * (block - 1)) // block
    blocks = -(-lengths // block)  # each chunk's rows
    chunk, used, row_in_chunk = _owners(blocks, count)
    before = row_in_chunk * block  # the chunk's queries in earlier rows
    row_starts = jnp.where(used, starts[chunk] + before, 0)
    row_lengths = jnp.where(used, jnp.clip(lengths[chunk] - before, 0, block), 0)
    token_chunk, real, t = _owners(lengths, num_tokens)  # t: the token's index in its chunk
    first = jnp.cumsum(blocks) - blocks  # each chunk's first row
    place = (first[token_chunk] + t // block) * block + t % block
    places = jnp.where(real, place, count * block)
    return AttentionRows(places, slots[chunk], row_starts, row_lengths, block)


def to_rows(x: jax.Array, rows: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """``x [N, 1, ...]`` of a ragged batch in its rows' ``[R, T, ...]`` layout (``shape``:
    (R, T)), zeros where a row has no token."""
    r, t = shape
    flat = jnp.zeros((r * t, *x.shape[2:]), x.dtype)
    flat = flat.at[rows].set(x[:, 0], mode="drop", unique_indices=True)
    return flat.reshape(r, t, *x.shape[2:])


def ragged_slots(rows: jax.Array, slots: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """The cache row of each token of a ragged batch (its row's slot; padding none: a slot
    out of range, whose writes are dropped)."""
    r, t = shape
    nowhere = jnp.iinfo(jnp.int32).max
    return jnp.where(rows < r * t, slots[jnp.minimum(rows // t, r - 1)], nowhere)


def from_rows(y: jax.Array, rows: jax.Array) -> jax.Array:
    """``y [R, T, ...]`` back to a ragged batch's ``[N, 1, ...]`` (padding reads place 0)."""
    r, t = y.shape[:2]
    flat = y.reshape(r * t, *y.shape[2:])
    return jnp.take(flat, jnp.where(rows < r * t, rows, 0), axis=0)[:, None]


class DecodeRows(NamedTuple):
    """The decode rows of a mixed step (``prefill`` with ``decode_slots``): one token each,
    after the prefill rows' in the flat stream, attending to its row's cache as a decode
    step's token does."""

    places: jax.Array  # int32[S]: each row's token in the flat stream (N, out of range: none)
    slots: jax.Array  # int32[S]: its cache row (out of range: none)
    positions: jax.Array  # int32[S, 1]: its token's position (the row's keys before it)
    mask: AttentionMask  # one query over its row's keys, its own included


def decode_rows(lengths: jax.Array, slots: jax.Array, first: jax.Array, n: int) -> DecodeRows:
    """Decode rows ``slots`` (out of range: none; the real ones first) of cache rows holding
    ``lengths`` keys, their tokens at ``first``, ``first + 1``, ... of a flat stream of ``n``."""
    active = slots < lengths.shape[0]
    before = jnp.take(lengths, slots, mode="fill", fill_value=0)
    places = jnp.where(active, first + jnp.arange(slots.shape[0], dtype=jnp.int32), n)
    mask = AttentionMask(
        query_positions=before[:, None], key_lengths=jnp.where(active, before + 1, 0)
    )
    return DecodeRows(places, slots, before[:, None], mask)


def take_places(x: jax.Array, places: jax.Array) -> jax.Array:
    """Rows ``places`` of a flat stream ``x [N, ...]`` (out of range: the last row's)."""
    return jnp.take(x, jnp.minimum(places, x.shape[0] - 1), axis=0)


class SelfAttention(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()

    @nn.compact
    def __call__(
        self, x, positions, angles, mask, k_cache, v_cache, slots, fresh, lora, rows=None,
        decoding=None,
    ):  # fmt: skip
        c = self.config
        b, t, _ = x.shape
        linear = partial(Linear, dtype=self.dtype, options=self.options)
        qkv = linear(c.qkv_size, use_bias=c.qkv_bias, name="qkv_proj")(x, scope(lora, "qkv_proj"))
        q, k, v = split_fused(qkv, (c.q_size, c.kv_size, c.kv_size), c.tensor_parallel)
        q = q.reshape(b, t, c.num_heads, c.head_dim)
        k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
        v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = RMSNorm(c.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(c.rms_norm_eps, self.dtype, name="k_norm")(k)
        q = apply_rotary(q, angles)
        k = apply_rotary(k, angles)
        # For the research forward (``forward_outputs``); a step that does not ask for the
        # collection leaves it immutable, sow does nothing and the program is unchanged.
        self.sow("intermediates", "queries", q)
        self.sow("intermediates", "keys", k)
        window = c.sliding_windows[self.layer_idx] if c.sliding_windows else None
        if decoding is not None:
            # A mixed step's decode rows: their tokens' keys go to their rows' ends and their
            # queries attend as a decode step's do (the prefill rows never see them).
            dq, dk, dv = (take_places(y, decoding.places) for y in (q, k, v))
            k_cache = write_kv(k_cache, dk, decoding.slots, decoding.positions)
            v_cache = write_kv(v_cache, dv, decoding.slots, decoding.positions)
        if rows is not None:
            # A ragged batch: each token writes its key where it lies (a row of its own), and
            # only what attention reads moves to the rows' [R, T] layout (the queries, and a
            # fresh chunk's keys: a continuing one's are read from the cache).
            shape = mask.query_positions.shape
            token_slots = ragged_slots(rows, slots, shape)
            k_cache = write_kv(k_cache, k, token_slots, positions)
            v_cache = write_kv(v_cache, v, token_slots, positions)
            q = to_rows(q, rows, shape)
            if fresh:
                k, v = to_rows(k, rows, shape), to_rows(v, rows, shape)
        else:
            k_cache = write_kv(k_cache, k, slots, positions)
            v_cache = write_kv(v_cache, v, slots, positions)
        if fresh:  # a new sequence sees only this chunk: no read of the (longer) cache rows
            out = attention(q, k, v, mask, window, options=self.options)
        else:
            out = cache_attention(q, k_cache, v_cache, slots, mask, window, self.options)
        if rows is not None:
            out = from_rows(out, rows)
        if decoding is not None:  # read after every write: no read waits on a later write
            decoded = cache_attention(
                dq, k_cache, v_cache, decoding.slots, decoding.mask, window, self.options
            )
            out = out.at[decoding.places].set(decoded, mode="drop", unique_indices=True)
        out = linear(c.hidden_size, name="o_proj")(out.reshape(b, t, -1), scope(lora, "o_proj"))
        return out, k_cache, v_cache


class DecoderLayer(nn.Module):
    config: ModelConfig
    layer_idx: int
    dtype: jnp.dtype
    options: KernelOptions = KernelOptions()

    @nn.compact
    def __call__(
        self, x, positions, angles, mask, k_cache, v_cache, slots, fresh, lora, rows=None,
        decoding=None,
    ):  # fmt: skip
        c = self.config
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="input_norm")(x)
        attn = SelfAttention(c, self.layer_idx, self.dtype, self.options, name="attn")
        h, k_cache, v_cache = attn(
            h, positions, angles, mask, k_cache, v_cache, slots, fresh, scope(lora, "attn"),
            rows, decoding,
        )  # fmt: skip
        x = x + h
        h = RMSNorm(c.rms_norm_eps, self.dtype, name="post_attn_norm")(x)
        c_mlp = (c.hidden_size, c.intermediate_size, self.dtype, c.tensor_parallel, self.options)
        x = x + GatedMLP(*c_mlp, name="mlp")(h, scope(lora, "mlp"))
        return x, k_cache, v_cache


class DecoderLM(nn.Module):
    """Token ids → final hidden states, updating the cache; ``logits`` applies the LM head."""

    config: ModelConfig
    dtype: jnp.dtype = jnp.float32
    options: KernelOptions = KernelOptions()

    def setup(self):
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype
        )
        self.layers = [DecoderLayer(c, i, self.dtype, self.options) for i in range(c.num_layers)]
        self.final_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(
                c.vocab_size, dtype=self.dtype, out_dtype=jnp.float32, options=self.options
            )

    def __call__(
        self,
        tokens,
        positions,
        mask,
        kv: KVCache,
        slots,
        fresh=False,
        lora=None,
        rows=None,
        decoding=None,
    ):
        """``rows``: a ragged batch's token places (``AttentionRows.places``): ``tokens`` and
        ``positions`` are then ``[N, 1]`` (one token a row for every matmul) and ``mask``
        describes the ``[R, T]`` rows the attention sees. ``decoding`` (``DecodeRows``): the
        stream's decode rows, one token each after the ragged rows'."""
        angles = rotary_angles(
            positions, self.config.rope.inverse_frequencies(self.config.head_dim)
        )
        x = self.embed_tokens(tokens)
        ks, vs = [], []
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, kv.k, kv.v, strict=True)):
            x, k_cache, v_cache = layer(
                x,
                positions,
                angles,
                mask,
                k_cache,
                v_cache,
                slots,
                fresh,
                scope(lora, f"layers_{i}"),
                rows,
                decoding,
            )
            ks.append(k_cache)
            vs.append(v_cache)
        return self.final_norm(x), kv.with_layers(tuple(ks), tuple(vs))

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits of hidden states [..., D]."""
        if self.config.tie_word_embeddings:
            table = self.embed_tokens.embedding
            return jnp.einsum("...d,vd->...v", hidden, table, preferred_element_type=jnp.float32)
        return self.lm_head(hidden)

    def init_all(self, tokens, positions, mask, kv: KVCache):
        """Touches every parameter once, for ``init``."""
        hidden, _ = self(tokens, positions, mask, kv, None)
        return self.logits(hidden)


# ---------------------------------------------------------------------------------------------
# Steps. Each is one jitted function; the cache is donated so XLA updates it in place. Each is
# compiled with cuBLAS's GEMMs where its token ids are many rows (``jit_by_rows``).

TOKENS = argument(2, "tokens")  # a step's rows: its token ids, the third argument


def init_cache(
    config: ModelConfig, num_slots: int, max_len: int, dtype: jnp.dtype, kv_cache_dtype="auto"
) -> KVCache:
    """An empty cache; ``kv_cache_dtype="fp8"`` holds K/V as E4M3 (``spark_jax.ops.kv_cache``)."""
    c = config
    return KVCache.create(
        c.num_layers, num_slots, max_len, c.num_kv_heads, c.head_dim, dtype, kv_cache_dtype
    )


def _params_dtype(params: dict[str, Any]) -> jnp.dtype:
    """The activations' dtype: the embedding table's (never quantized)."""
    return params["embed_tokens"]["embedding"].dtype


def _run(
    params,
    config,
    tokens,
    starts,
    num_new,
    slots,
    kv: KVCache,
    fresh=False,
    lora=None,
    options: KernelOptions = KernelOptions(),
    rows: AttentionRows | None = None,
    decoding: DecodeRows | None = None,
):
    """Runs tokens[B, T] at positions starts[b] + t; returns hidden states and the new cache.

    ``fresh``: every row starts a new sequence at position 0 (attention stays in the chunk).
    ``rows`` (``AttentionRows``): ``tokens`` is a ragged batch's flat ``[N]``, its rows'
    tokens one after another (``num_new`` each), laid out for attention as ``rows`` says; the
    hidden states are then ``[N, 1, D]``. ``decoding``: that stream's decode rows
    (``DecodeRows``), a token each after the rows'.
    """
    model = DecoderLM(config, _params_dtype(params), options)
    key_lengths = starts + num_new
    places, attention_slots = None, slots
    if rows is None:
        positions = starts[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        mask = AttentionMask(query_positions=positions, key_lengths=key_lengths)
    else:  # each token a row of its own for the matmuls, at its own position
        positions = rows.starts[:, None] + jnp.arange(rows.width, dtype=jnp.int32)[None, :]
        mask = AttentionMask(query_positions=positions, key_lengths=rows.starts + rows.lengths)
        places, attention_slots = rows.places, rows.slots
        flat = jnp.minimum(places, positions.size - 1)
        tokens, positions = tokens[:, None], positions.reshape(-1)[flat][:, None]
    if decoding is not None:
        positions = positions.at[decoding.places].set(decoding.positions, mode="drop")
    apply = (tokens, positions, mask, kv, attention_slots, fresh, lora, places, decoding)
    hidden, kv = model.apply({"params": params}, *apply)
    written = jnp.arange(kv.num_slots) if slots is None else slots
    lengths = kv.lengths.at[written].set(key_lengths)
    if decoding is not None:
        lengths = lengths.at[decoding.slots].set(decoding.mask.key_lengths, mode="drop")
    return model, hidden, kv.with_lengths(lengths)


def _attention_rows(
    config: ModelConfig,
    params,
    lengths: jax.Array,
    starts: jax.Array,
    slots: jax.Array,
    num_tokens: int,
    kv: KVCache,
    fresh: bool,
    options: KernelOptions,
) -> tuple[AttentionRows, KernelOptions]:
    """A ragged prefill's attention layout, and the options its layers run under: rows of
    ``ragged_query_block`` queries (for chunks appending to the cache), read in place by the
    flash kernel where it applies, else a row per chunk."""
    block = None
    if not fresh:
        c = config
        windowed = any(w is not None for w in c.sliding_windows)
        block = ragged_query_block(
            num_tokens, lengths.shape[0], c.num_heads, c.head_dim, _params_dtype(params),
            kv.k[0], windowed, options,
        )  # fmt: skip
    if block is None:
        return chunk_rows(lengths, starts, slots, num_tokens), options
    rows = block_rows(lengths, starts, slots, num_tokens, block)
    return rows, dataclasses.replace(options, paged_flash_prefill=True)


@jit_by_rows(
    TOKENS,
    static_argnames=("config", "fresh", "options", "with_hidden", "ragged"),
    donate_argnames=("kv",),
)
def prefill(
    params,
    config: ModelConfig,
    tokens,
    lengths,
    slots,
    kv: KVCache,
    fresh=True,
    lora=None,
    decode_slots=None,
    last_tokens=None,
    *,
    options: KernelOptions = KernelOptions(),
    with_hidden: bool = False,
    ragged: bool = False,
) -> tuple[Any, KVCache]:
    """Writes tokens[B, T] (first ``lengths[b]`` real) into rows ``slots``; logits of the last.

    ``fresh`` starts new sequences in those rows; otherwise the tokens are appended to what
    the rows hold (chunked prefill). ``with_hidden``: (logits, the final hidden states
    [B, T, D] of every position) in place of the logits (a draft head reads them).

    ``ragged``: ``tokens`` is flat, ``[N]``: row b's ``lengths[b]`` tokens after row b-1's,
    then padding. Every matmul then computes N positions, not B times the longest row's;
    attention sees the rows as ``[B, N]`` (``ragged_rows``), as does ``with_hidden``'s output.

    ``decode_slots`` (a ragged batch's; int32[S], out of range: none, the real ones first)
    makes it a mixed step: those cache rows also decode one token each, their last token
    (``last_tokens[slot]``) placed after the ragged rows' in the stream, so the weights are
    read once for both. The logits are then a pair: the rows' last [B, V] and the decode rows'
    [S, V] (each picked at a shape the engine's other steps have).
    """
    starts = jnp.zeros_like(lengths) if fresh else kv.lengths[slots]
    n = tokens.shape[0]
    rows = None
    if ragged:
        rows, options = _attention_rows(
            config, params, lengths, starts, slots, n, kv, fresh, options
        )
    decoding = None
    if decode_slots is not None:
        decoding = decode_rows(kv.lengths, decode_slots, jnp.sum(lengths), n)
        inputs = jnp.take(last_tokens, decode_slots, mode="clip")
        tokens = tokens.at[decoding.places].set(inputs, mode="drop")
    model, hidden, kv = _run(
        params, config, tokens, starts, lengths, slots, kv, fresh, lora, options, rows, decoding
    )
    if ragged:
        last = hidden[jnp.maximum(jnp.cumsum(lengths) - 1, 0)]
        if decoding is not None:
            last = jnp.concatenate([last, take_places(hidden, decoding.places)])
        if with_hidden:
            hidden = to_rows(hidden, ragged_rows(lengths, n), (lengths.shape[0], n))
    else:
        last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)
    logits = model.apply({"params": params}, last[:, 0], method=DecoderLM.logits)
    if decoding is not None:  # one LM head read for both, split after
        logits = (logits[: lengths.shape[0]], logits[lengths.shape[0] :])
    return ((logits, hidden) if with_hidden else logits), kv


@jit_by_rows(
    TOKENS,
    static_argnames=("config", "options", "with_hidden"),
    donate_argnames=("tokens", "lengths", "slots", "decode_slots", "last_tokens", "kv"),
)
def prefill_returning_inputs(
    params,
    config: ModelConfig,
    tokens,
    lengths,
    slots,
    decode_slots,
    last_tokens,
    kv: KVCache,
    lora=None,
    *,
    options: KernelOptions = KernelOptions(),
    with_hidden: bool = False,
) -> tuple[tuple[Any, ...], Any, KVCache]:
    """A ragged ``prefill`` appending to the rows' cache (``decode_slots`` and
    ``last_tokens``: its decode rows, or None) that takes its inputs too (donated) and hands
    them back unchanged in the same buffers, first: ((tokens, lengths, slots, decode_slots,
    last_tokens), logits, cache); ``decode_returning_inputs`` says why. Its own argument
    order keeps each output paired with its input where shapes coincide (decode_slots and
    last_tokens are as long as the cache's lengths)."""
    out, kv = prefill(
        params, config, tokens, lengths, slots, kv, False, lora, decode_slots, last_tokens,
        options=options, with_hidden=with_hidden, ragged=True,
    )  # fmt: skip
    return (tokens, lengths, slots, decode_slots, last_tokens), out, kv


def token_adapters(
    adapters: Sequence[int], lengths: Sequence[int], num_decoding: int, total: int
) -> list[int]:
    """A ragged batch's adapter per token (each token is a row of the matmuls): ``adapters``
    gives each row's (``lengths`` tokens each), then the decode rows' (``num_decoding`` of
    them, a token each); padding to ``total`` takes none (-1)."""
    adapters = list(adapters)
    decoded = adapters[len(lengths) : len(lengths) + num_decoding]
    out = [a for a, n in zip(adapters, lengths, strict=False) for _ in range(n)] + decoded
    return out + [-1] * (total - len(out))


@jit_by_rows(TOKENS, static_argnames=("config", "options", "with_hidden"), donate_argnames=("kv",))
def decode(
    params,
    config: ModelConfig,
    tokens,
    active,
    kv: KVCache,
    lora=None,
    *,
    options: KernelOptions = KernelOptions(),
    with_hidden: bool = False,
) -> tuple[Any, KVCache]:
    """One token per cache row; rows where ``active`` is False keep their length.
    ``with_hidden``: (logits, the final hidden states [B, 1, D]) in place of the logits."""
    num_new = active.astype(jnp.int32)
    model, hidden, kv = _run(
        params, config, tokens[:, None], kv.lengths, num_new, None, kv, lora=lora, options=options
    )
    logits = model.apply({"params": params}, hidden[:, 0], method=DecoderLM.logits)
    return ((logits, hidden) if with_hidden else logits), kv


@jit_by_rows(
    TOKENS,
    static_argnames=("config", "options", "with_hidden"),
    donate_argnames=("tokens", "active", "kv"),
)
def decode_returning_inputs(
    params,
    config: ModelConfig,
    tokens,
    active,
    kv: KVCache,
    lora=None,
    *,
    options: KernelOptions = KernelOptions(),
    with_hidden: bool = False,
) -> tuple[tuple[jax.Array, jax.Array], Any, KVCache]:
    """``decode`` that takes its tokens and activity too (donated) and hands them back
    unchanged in the same buffers, first: ((tokens, active), logits, cache).

    For the serving engine, which writes each step's inputs into the last step's buffers (a
    program's CUDA graph is re-recorded when an argument moves): it then donates buffers
    this program returned, never ones a queued program still reads (such a donation made
    the host wait for that program on the H200; ``spark_jax.serving.executor._pick_rows``).
    They come first because jit pairs each output with the first donated input of its shape
    and dtype: after the cache, the lengths (int32[B]) would take the tokens' buffer."""
    kwargs = _hidden_kwargs(options, with_hidden)
    out, kv = decode(params, config, tokens, active, kv, lora, **kwargs)
    return (tokens, active), out, kv


def _decode_rows(
    params, tokens, active, kv: KVCache, lora, *, config: ModelConfig, options: KernelOptions
):
    """``decode`` with the config and options bound, in the argument order of
    ``Runner.decode_fn``."""
    return decode(params, config, tokens, active, kv, lora, options=options)


@jit_by_rows(TOKENS, static_argnames=("config", "options", "with_hidden"), donate_argnames=("kv",))
def verify(
    params,
    config: ModelConfig,
    tokens,
    lengths,
    kv: KVCache,
    lora=None,
    *,
    options: KernelOptions = KernelOptions(),
    with_hidden: bool = False,
) -> tuple[Any, KVCache]:
    """Scores tokens[B, T] (first ``lengths[b]`` real) for every row; logits at every position.
    ``with_hidden``: (logits, the final hidden states [B, T, D]) in place of the logits (a
    draft head reads them: ``spark_jax.models.draft_head``); a program of its own, so the
    plain verify step never writes them out."""
    model, hidden, kv = _run(
        params, config, tokens, kv.lengths, lengths, None, kv, lora=lora, options=options
    )
    logits = model.apply({"params": params}, hidden, method=DecoderLM.logits)
    return ((logits, hidden) if with_hidden else logits), kv


def _verify_rows(
    params,
    tokens,
    lengths,
    kv: KVCache,
    lora,
    *,
    config: ModelConfig,
    options: KernelOptions,
    with_hidden: bool = False,
):
    """``verify`` with the config and options bound, in the argument order of
    ``Runner.verify_fn`` (``verify_hidden_fn``: ``with_hidden`` bound too)."""
    kwargs = _hidden_kwargs(options, with_hidden)
    return verify(params, config, tokens, lengths, kv, lora, **kwargs)


def _hidden_kwargs(options: KernelOptions, with_hidden: bool) -> dict[str, Any]:
    """A step's keyword arguments; ``with_hidden`` only when set (jit keys a keyword passed
    apart from one left to its default: passing False would compile the program again)."""
    return {"options": options} | ({"with_hidden": True} if with_hidden else {})


# ---------------------------------------------------------------------------------------------
# Research: the teacher-forced forward with what HF's output flags return. It runs the layers
# above through the reference attention; no serving step calls it.


def _records_layer(module: nn.Module, method_name: str) -> bool:
    """Flax ``capture_intermediates`` filter: the embedding's and each layer's output."""
    return method_name == "__call__" and isinstance(module, DecoderLayer | nn.Embed)


@partial(
    jax.jit,
    static_argnames=("config", "output_hidden_states", "output_attentions", "options"),
)
def forward_outputs(
    params,
    config: ModelConfig,
    tokens,
    lengths,
    lora=None,
    *,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    options: KernelOptions = KernelOptions(implementation="xla"),
) -> ForwardOutput:
    """Logits [B, T, V] of every position of tokens[B, T] (first ``lengths[b]`` real), and, when
    asked, the hidden states and attention probabilities HF returns for them.

    A pure function of ``params``: differentiable (LoRA training takes its gradient).
    """
    model = DecoderLM(config, _params_dtype(params), options)
    b, t = tokens.shape
    kv = init_cache(config, b, t, _params_dtype(params))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    mask = AttentionMask(query_positions=positions, key_lengths=lengths)
    apply = partial(model.apply, {"params": params})
    args = (tokens, positions, mask, kv, None, True, lora)
    if not (output_hidden_states or output_attentions):
        hidden, _ = apply(*args)
        return ForwardOutput(apply(hidden, method=DecoderLM.logits))
    (hidden, _), state = apply(
        *args, capture_intermediates=_records_layer, mutable=["intermediates"]
    )
    recorded = state["intermediates"]
    layers = [recorded[f"layers_{i}"] for i in range(config.num_layers)]
    hidden_states = attentions = None
    if output_hidden_states:
        outputs = [layer["__call__"][0][0] for layer in layers[:-1]]  # (x, k, v) per layer
        hidden_states = (recorded["embed_tokens"]["__call__"][0], *outputs, hidden)
    if output_attentions:
        windows = config.sliding_windows or (None,) * config.num_layers
        attentions = tuple(
            attention_probabilities(layer["attn"]["queries"][0], layer["attn"]["keys"][0], mask, w)
            for layer, w in zip(layers, windows, strict=True)
        )
    logits = apply(hidden, method=DecoderLM.logits)
    return ForwardOutput(logits, hidden_states, attentions)


def init_params(
    config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32
) -> dict[str, Any]:
    """Random parameters of the right tree and shapes (benchmarks and tests)."""
    model = DecoderLM(config, dtype)
    kv = init_cache(config, 1, 8, dtype)
    tokens = jnp.zeros((1, 1), jnp.int32)
    positions = jnp.zeros((1, 1), jnp.int32)
    mask = AttentionMask(query_positions=positions, key_lengths=jnp.ones((1,), jnp.int32))

    def init(k: jax.Array) -> Any:
        return model.init(k, tokens, positions, mask, kv, method=DecoderLM.init_all)["params"]

    # A quantized config's kernels are drawn in ``dtype``, then made narrow (with scales).
    return declare(config).quantize(random_params(init, key, dtype))


# ---------------------------------------------------------------------------------------------
# The engine-facing runner: host-side padding and bucketing around the jitted steps.


class Runner:
    """Drives the decoder steps for the engine (see ``spark_jax.model.Runner``)."""

    is_encoder_decoder = False

    # A step with an adapter row and one without compile to different programs (the latter
    # passes lora=None): an engine warms both up (spark_jax.serving.engine.Engine.warmup).
    adapter_rows_change_the_program = True

    def __init__(
        self,
        config: ModelConfig,
        params: dict[str, Any],
        tokenizer: Any = None,
        options: KernelOptions = KernelOptions(),
    ):
        self.config = config
        self.options = options  # the kernels every step of this runner compiles with
        # The params every step reads; steps never change them. With LoRA enabled the Model
        # sets them to its fused tree (``lora_params``): adapted kernels [W | A], so one GEMM
        # gives x W and x A.
        self.params = params
        self.tokenizer = tokenizer
        self.dtype = _params_dtype(params)
        self.kv_cache_dtype = "auto"  # the Model sets "fp8" for an E4M3 K/V cache
        self.mesh: Any = None  # the Model sets its tensor-parallel mesh (caches by KV heads)
        self.lora_pool: Any = None  # a spark_jax.ops.lora.LoraPool once LoRA is enabled
        # The pure decode step, for device loops of several steps (one object per runner,
        # so a jit taking it as a static argument compiles once per model).
        self.decode_fn = partial(_decode_rows, config=config, options=options)
        self.verify_fn = partial(_verify_rows, config=config, options=options)
        self.verify_hidden_fn = partial(
            _verify_rows, config=config, options=options, with_hidden=True
        )

    def init_state(self, num_slots: int, max_len: int, max_prompt_len: int = 0) -> KVCache:
        del max_prompt_len  # the self-attention cache holds the prompt
        cache = init_cache(self.config, num_slots, max_len, self.dtype, self.kv_cache_dtype)
        return cache if self.mesh is None else jax.device_put(cache, cache.shardings(self.mesh))

    def prefill(
        self,
        state: KVCache,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        requests: Sequence[Any] = (),
        continuing: bool = False,
        adapters: Sequence[int] | None = None,
        min_len: int = 0,
        with_hidden: bool = False,
        ragged: bool = False,
        decode_slots: Sequence[int] | None = None,
        last_tokens: jax.Array | None = None,
    ) -> tuple[Any, KVCache]:
        """Starts (or, ``continuing``, extends: chunked prefill) the sequences in ``slots``.

        ``min_len`` pads the batch to at least that many tokens: a caller with a coarser
        ladder of chunk sizes than ``bucket`` keeps to its own (fewer) compiled shapes.
        ``with_hidden``: (logits, hidden states [B, T, D]) in place of the logits.
        ``ragged``: the prompts' tokens one after another, padded to ``min_len`` in all
        (``prefill``'s ragged batch; a prompt may then be empty: a row that computes nothing).
        ``decode_slots`` (ragged only): cache rows that decode one token each in the same
        forward, their inputs ``last_tokens[slot]`` (a mixed step: ``prefill``); ``adapters``
        then gives the prompts' and then the decode rows'.
        """
        del requests  # nothing per request changes a decoder prefill
        args, kwargs = self._prefill_args(
            state, slots, prompts, continuing, adapters, min_len, with_hidden, ragged,
            decode_slots, last_tokens,
        )  # fmt: skip
        return prefill(*args, **kwargs)

    def lower_prefill(
        self,
        state: KVCache,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        continuing: bool = False,
        adapters: Sequence[int] | None = None,
        min_len: int = 0,
        with_hidden: bool = False,
        ragged: bool = False,
        decode_slots: Sequence[int] | None = None,
        last_tokens: jax.Array | None = None,
    ) -> jax.stages.Lowered:
        """``prefill``'s program for these inputs, traced but neither compiled nor run (the
        engine compiles its shapes on threads, then its calls find them compiled)."""
        args, kwargs = self._prefill_args(
            state, slots, prompts, continuing, adapters, min_len, with_hidden, ragged,
            decode_slots, last_tokens,
        )  # fmt: skip
        return prefill.lower(*args, **kwargs)

    def _prefill_args(
        self, state, slots, prompts, continuing, adapters, min_len, with_hidden, ragged,
        decode_slots, last_tokens,
    ):  # fmt: skip
        lengths = [len(p) for p in prompts]
        mixed = ()
        if decode_slots is not None:
            if not ragged or with_hidden or last_tokens is None:
                raise ValueError(
                    "decode rows ride only in a ragged prefill without hidden states, and "
                    "need last_tokens; pass ragged=True and last_tokens, or no decode_slots."
                )
            mixed = (jnp.asarray(decode_slots, jnp.int32), last_tokens)
        if ragged:
            riding = np.asarray([] if decode_slots is None else decode_slots)
            decoding = int((riding < len(state.lengths)).sum())  # the real decode rows
            if sum(lengths) + decoding > min_len:
                raise ValueError(
                    f"a ragged prefill of {sum(lengths)} tokens and {decoding} decode rows "
                    f"exceeds its {min_len}; pass min_len of at least their total."
                )
            tokens = np.zeros((min_len,), np.int32)
            tokens[: sum(lengths)] = [t for p in prompts for t in p]
            if adapters is not None:
                adapters = token_adapters(adapters, lengths, decoding, min_len)
        else:
            if min(lengths) < 1:
                raise ValueError("a prompt is empty; give at least one token.")
            tokens = np.zeros((len(prompts), bucket(max(*lengths, min_len))), np.int32)
            for row, prompt in enumerate(prompts):
                tokens[row, : len(prompt)] = prompt
        lora = self._lora(adapters)
        args = (
            self.params,
            self.config,
            jnp.asarray(tokens),
            jnp.asarray(lengths, jnp.int32),
            jnp.asarray(slots, jnp.int32),
            state,
        )
        kwargs = {"fresh": not continuing, "lora": lora} | _hidden_kwargs(self.options, with_hidden)
        kwargs |= dict(zip(("decode_slots", "last_tokens"), mixed, strict=False))
        return args, kwargs | ({"ragged": True} if ragged else {})

    def prefill_held(
        self,
        state: KVCache,
        tokens: jax.Array,
        lengths: jax.Array,
        slots: jax.Array,
        decode_slots: jax.Array | None = None,
        last_tokens: jax.Array | None = None,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
        *,
        lower: bool = False,
    ) -> Any:
        """A ragged prefill appending to the rows' cache, its inputs on the device already
        (``prefill_returning_inputs``: handed back first); ``adapters``: one per token
        (``token_adapters``). ``lower``: the program for these inputs, traced but neither
        compiled nor run."""
        step = prefill_returning_inputs.lower if lower else prefill_returning_inputs
        inputs = (tokens, lengths, slots, decode_slots, last_tokens)
        return step(
            self.params, self.config, *inputs, state, self._lora(adapters),
            options=self.options, with_hidden=with_hidden,
        )  # fmt: skip

    def decode(
        self,
        state: KVCache,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
        returning_inputs: bool = False,
    ) -> Any:
        """``with_hidden``: (logits, hidden states [B, 1, D]) in place of the logits.
        ``returning_inputs``: ((tokens, active), logits, cache), the tokens and activity
        donated and handed back in their buffers (``decode_returning_inputs``)."""
        step = decode_returning_inputs if returning_inputs else decode
        args, kwargs = self._decode_args(state, tokens, active, adapters, with_hidden)
        return step(*args, **kwargs)

    def lower_decode(
        self,
        state: KVCache,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
        returning_inputs: bool = False,
    ) -> jax.stages.Lowered:
        """``decode``'s program for these inputs, traced but neither compiled nor run."""
        step = decode_returning_inputs if returning_inputs else decode
        args, kwargs = self._decode_args(state, tokens, active, adapters, with_hidden)
        return step.lower(*args, **kwargs)

    def _decode_args(
        self,
        state: KVCache,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None,
        with_hidden: bool,
    ) -> tuple[tuple, dict[str, Any]]:
        """A decode step's positional and keyword arguments."""
        kwargs = _hidden_kwargs(self.options, with_hidden)
        return (self.params, self.config, tokens, active, state, self._lora(adapters)), kwargs

    def verify(
        self,
        state: KVCache,
        tokens: jax.Array,
        lengths: jax.Array,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
    ) -> tuple[Any, KVCache]:
        """``with_hidden``: (logits, hidden states [B, T, D]) in place of the logits."""
        kwargs = _hidden_kwargs(self.options, with_hidden)
        return verify(
            self.params, self.config, tokens, lengths, state, self._lora(adapters), **kwargs
        )

    def lower_verify(
        self,
        state: KVCache,
        tokens: jax.Array,
        lengths: jax.Array,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
    ) -> jax.stages.Lowered:
        """``verify``'s program for these inputs, traced but neither compiled nor run."""
        kwargs = _hidden_kwargs(self.options, with_hidden)
        lora = self._lora(adapters)
        return verify.lower(self.params, self.config, tokens, lengths, state, lora, **kwargs)

    @property
    def _fuse_lora(self) -> bool:
        """Adapters' A columns join the kernels (one GEMM) unless the kernels are narrow or
        sharded (a tensor-parallel model's adapters stay in the pool, held whole per device)."""
        return self.config.quantization is None and self.mesh is None

    def lora_input(self, adapters: Sequence[int]) -> Any:
        """The adapter input of a step whose cache rows use ``adapters`` (for ``decode_fn``,
        with ``self.params``)."""
        return self._lora(adapters)

    def lora_params(self, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` as steps with this runner's pool read them: a new tree whose adapted
        kernels hold the pool's A columns (``LoraPool.fused_params``); ``params`` is untouched.

        ``spark_jax.model.Model`` calls this when LoRA is enabled and at every adapter add or
        remove, and sets the result as its and this runner's params. The first call widens the
        kernels; later ones only rewrite the A columns, so no step shape changes and an engine
        warmed up with LoRA enabled never recompiles for adapters. The kernels are never
        narrowed again: with no adapter loaded their A columns are zero, and a base-only step
        (lora None) pays one slightly wider GEMM per adapted layer.

        A quantized model's kernels are narrow: its adapters stay in the pool in the model dtype
        (``x a`` a GEMM of its own) and the params are returned as they are.
        """
        if self.lora_pool is None or not self._fuse_lora:
            return params
        return self.lora_pool.fused_params(params)

    def _lora(self, adapters: Sequence[int] | None) -> Any:
        """The step's adapter input: None when no row asks for an adapter, else a fused batch
        (the A's are in ``self.params``' kernels, see ``lora_params``)."""
        pool = self.lora_pool
        if pool is None:
            return None
        slots = np.asarray([] if adapters is None else adapters, np.int32)
        if not (slots >= 0).any():
            return None
        return pool.batch(slots, fused=self._fuse_lora)

    def logits(self, ids: Sequence[int], adapter: int | None = None) -> np.ndarray:
        """float32 [T, V]: the logits of every position of one sequence."""
        ids = list(ids)
        state = self.init_state(1, bucket(len(ids)))
        tokens = np.zeros((1, bucket(len(ids))), np.int32)
        tokens[0, : len(ids)] = ids
        lora = self._lora(None if adapter is None else [adapter])
        out, _ = verify(
            self.params,
            self.config,
            jnp.asarray(tokens),
            jnp.asarray([len(ids)]),
            state,
            lora,
            options=self.options,
        )
        return host_array(out)[0, : len(ids)].astype(np.float32)
