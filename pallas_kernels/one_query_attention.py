"""One-query multi-head attention on the GPU (Pallas, Triton backend): a decode step's
attention for models whose every query head has its own key head (MHA: NLLB / M2M100).

A decode step asks for one query per row against a short cache: NLLB's self-attention reads
at most a few hundred keys, its cross-attention the ~30 source tokens. Tensor-core kernels
(cuDNN's, our flash walk) pad each head's single query to a 64-row tile and launch a program
per (row, head): measured on the H200 at 32 rows x 16 heads, ~8 us a call for ~2 MB of keys,
latency rather than bandwidth. Here a program takes a row and ``heads_per_program`` heads at
once and does the products on the CUDA cores (a multiply and a reduction over the head dim per
key: no padding), walking the keys in blocks of ``block_keys`` with an online softmax in fp32.

With ``k_new``/``v_new`` (self-attention) the step's own key and value join the softmax as
its first entry and are written into the caches at position ``lengths[b]`` in the same kernel
(the caches are aliased to the outputs: updated in place, the scatters of a separate write
are gone). Without them (cross-attention) the kernel only reads.

``row_table`` (beam search): row b reads key position t from cache row ``row_table[b, t]``
instead of its own row, so a beam reorder rewrites that small table instead of moving every
layer's cache rows; the new key is still written into row b. Programs run in any order, so a
table must not name, below a row's length, the position another row writes in the same call
(beams of one request share their length: none reads the position its siblings write).

Why Triton and not Mosaic GPU: the work is a few multiply-reduces per key on a handful of
heads, which Triton lowers directly; Mosaic GPU's register layouts are built around wgmma
tiles. Its speed against cuDNN and against our Mosaic flash walk is measured by
``benchmarks/nllb_step.py`` (BENCHMARKS.md). Interpret mode runs the same kernel on the CPU.

Axes: B batch rows, S cache positions, N heads, H head dim, G heads per program, L keys per
block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import gather_rows, reference_attention, triton_params, visible_keys

_MASKED = -1e30  # finite: a block with no visible key leaves the running max untouched


def one_query_attention_applies(q: jax.Array, k_cache: jax.Array) -> bool:
    """True for the kernel's static constraints: q [B,1,N,H] against k [B,S,N,H] of the same
    dtype (MHA: one key head per query head), head dim a power of two, S a multiple of 16."""
    if q.ndim != 4 or k_cache.ndim != 4 or q.shape[1] != 1:
        return False
    b, _, n, h = q.shape
    return (
        k_cache.shape[0] == b
        and k_cache.shape[2] == n
        and k_cache.shape[3] == h
        and h & (h - 1) == 0
        and k_cache.shape[1] % 16 == 0
        and k_cache.dtype == q.dtype
    )


def one_query_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    row_table: jax.Array | None = None,
    scale: float | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """The jnp reference of ``one_query_attention``: the same contract, built from
    ``reference_attention`` over the cache rows the table names (the new key appended)."""
    b = k_cache.shape[0]
    if row_table is not None:
        keys, values = gather_rows(k_cache, row_table), gather_rows(v_cache, row_table)
    else:
        keys, values = k_cache, v_cache
    anywhere = jnp.zeros((b, 1), jnp.int32)
    if k_new is None:
        visible = visible_keys(anywhere, lengths, keys.shape[1], causal=False)
        return reference_attention(q, keys, values, visible, scale), None, None
    # The new key sits right after the row's keys, in one spare position past a full row.
    rows = jnp.arange(b)
    spare = lambda x: jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))
    keys = spare(keys).at[rows, lengths].set(k_new[:, 0])
    values = spare(values).at[rows, lengths].set(v_new[:, 0])
    visible = visible_keys(anywhere, lengths + 1, keys.shape[1], causal=False)
    out = reference_attention(q, keys, values, visible, scale)
    k_cache = k_cache.at[rows, lengths].set(k_new[:, 0], mode="drop")
    v_cache = v_cache.at[rows, lengths].set(v_new[:, 0], mode="drop")
    return out, k_cache, v_cache


def one_query_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    lengths: jax.Array,
    k_new: jax.Array | None = None,
    v_new: jax.Array | None = None,
    row_table: jax.Array | None = None,
    scale: float | None = None,
    *,
    heads_per_program: int = 2,
    block_keys: int = 64,
    num_warps: int = 4,
    num_stages: int = 1,
    packed: bool = False,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """q [B,1,N,H] against ``lengths[b]`` cached keys of k/v_cache [B,S,N,H]: (out, k, v).

    With ``k_new``/``v_new`` [B,1,N,H] the new key is attended too and written at position
    ``lengths[b]`` (dropped where that is past the cache): returns the updated caches, which
    donate their buffers (update them in place). Without, the caches come back as None.
    ``row_table`` int32[B, S]: the cache row to read each position of row b from (beam search).
    ``packed``: q is [B,1,3N,H], the queries, new keys and new values side by side (a fused
    qkv projection's output split into heads), read in place by offset: no slice kernel before
    this one (``k_new``/``v_new`` are then not given; the new key is appended).
    Tunings: a program takes the most heads up to ``heads_per_program`` that divide N, and
    walks blocks of up to ``block_keys`` keys that divide S. The defaults were the fastest for
    NLLB-600M's greedy step on the H200.
    """
    b, _, n, h = q.shape
    if packed:
        if k_new is not None or v_new is not None:
            raise ValueError("packed q already holds the new keys and values; pass no k_new/v_new.")
        n //= 3
    s = k_cache.shape[1]
    append = packed or k_new is not None
    g = math.gcd(heads_per_program, n)  # the most heads up to the tuning that divide N
    keys_per_block = min(block_keys, s)
    while s % keys_per_block:  # halve down to a divisor of S (S is a multiple of 16)
        keys_per_block //= 2
    scale = h**-0.5 if scale is None else scale
    # Block j of g heads; ``part`` 1 and 2 of a packed q are its new keys and values.
    heads = lambda part=0: pl.BlockSpec(
        (None, None, g, h), lambda i, j: (i, 0, j + part * (n // g), 0)
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)
    table = row_table if row_table is not None else jnp.zeros((1, 1), jnp.int32)
    inputs = [lengths.astype(jnp.int32), table, q, k_cache, v_cache]
    in_specs = [whole(inputs[0]), whole(table), heads(), whole(k_cache), whole(v_cache)]
    out_shape = [jax.ShapeDtypeStruct((b, 1, n, h), q.dtype)]
    out_specs = [heads()]
    aliases = {}
    if append:
        inputs += [q, q] if packed else [k_new, v_new]
        in_specs += [heads(1), heads(2)] if packed else [heads(), heads()]
        out_shape += [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype)] * 2
        out_specs += [whole(k_cache), whole(v_cache)]
        aliases = {3: 1, 4: 2}
    kernel = functools.partial(
        _kernel,
        scale=scale,
        heads_per_program=g,
        block_keys=keys_per_block,
        append=append,
        indirect=row_table is not None,
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, n // g),
        in_specs=in_specs,
        out_specs=out_specs,
        input_output_aliases=aliases,
        compiler_params=triton_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="one_query_attention",
    )(*inputs)
    if append:
        return outs[0], outs[1], outs[2]
    return outs[0], None, None


def _kernel(
    lengths_ref,
    table_ref,
    q_ref,
    k_ref,
    v_ref,
    *rest,
    scale: float,
    heads_per_program: int,
    block_keys: int,
    append: bool,
    indirect: bool,
):
    if append:
        k_new_ref, v_new_ref, o_ref, k_out_ref, v_out_ref = rest
    else:
        (o_ref,) = rest
    row = pl.program_id(0)
    heads = pl.ds(pl.program_id(1) * heads_per_program, heads_per_program)
    length = lengths_ref[row]
    num_positions = k_ref.shape[1]
    q = q_ref[...].astype(jnp.float32) * scale  # [G, H]
    if append:
        k_new = k_new_ref[...]
        v_new = v_new_ref[...]
        # The new key is the softmax's first entry: its score is the running max, weight 1.
        running_max = jnp.sum(q * k_new.astype(jnp.float32), axis=-1)  # [G]
        running_sum = jnp.ones_like(running_max)
        acc = v_new.astype(jnp.float32)  # [G, H]
    else:
        running_max = jnp.full((heads_per_program,), _MASKED, jnp.float32)
        running_sum = jnp.zeros((heads_per_program,), jnp.float32)
        acc = jnp.zeros(q.shape, jnp.float32)

    def load(start):
        """Keys and values [L, G, H] of positions start .. start + L (through the table)."""
        if indirect:
            positions = start + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
            rows = table_ref[row, pl.ds(start, block_keys)]  # [L]
            return k_ref[rows, positions, heads, :], v_ref[rows, positions, heads, :]  # gathers
        keys = k_ref[row, pl.ds(start, block_keys), heads, :]
        return keys, v_ref[row, pl.ds(start, block_keys), heads, :]

    def attend(start, keys, values, carry):
        """The online softmax over one block of keys."""
        running_max, running_sum, acc = carry
        positions = start + lax.broadcasted_iota(jnp.int32, (block_keys,), 0)
        scores = jnp.sum(keys.astype(jnp.float32) * q[None], axis=-1)  # [L, G]
        visible = (positions < length)[:, None]
        scores = jnp.where(visible, scores, _MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=0))
        correction = jnp.exp(running_max - new_max)
        weights = jnp.where(visible, jnp.exp(scores - new_max[None]), 0.0)  # [L, G]
        running_sum = running_sum * correction + jnp.sum(weights, axis=0)
        acc = acc * correction[:, None] + jnp.sum(
            weights[:, :, None] * values.astype(jnp.float32), axis=0
        )
        return new_max, running_sum, acc

    # The first block is read whatever the length (its loads need not wait for it: a short
    # row's whole walk is then one memory round trip); the rest only up to the length.
    carry = attend(0, *load(0), (running_max, running_sum, acc))
    num_blocks = jnp.minimum((length + block_keys - 1) // block_keys, num_positions // block_keys)
    running_max, running_sum, acc = lax.fori_loop(
        1, num_blocks, lambda i, c: attend(i * block_keys, *load(i * block_keys), c), carry
    )
    out = acc / jnp.maximum(running_sum, 1e-30)[:, None]
    o_ref[...] = out.astype(o_ref.dtype)
    if append:

        @pl.when(length < num_positions)
        def _write():
            k_out_ref[row, pl.ds(length, 1), heads, :] = k_new[None].astype(k_out_ref.dtype)
            v_out_ref[row, pl.ds(length, 1), heads, :] = v_new[None].astype(v_out_ref.dtype)
