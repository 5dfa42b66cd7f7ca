"""One-token decode attention over an E4M3 K/V cache with a scale per kv head (Pallas, Triton
backend): the narrow pages are read in place and dequantized in registers.

``kv_cache_dtype="fp8"`` halves the K/V bytes a decode step reads, but only if attention
reads the E4M3 bytes themselves: cuDNN's and our Mosaic kernels take bf16 keys, and XLA's
fallback (rows read out and dequantized, then its split-K form) measured 0.12x the bf16 step
on the H200 at 64 rows x 4,096 keys.

Pages ``[P, L, K, H]``; row b's key s lives at ``pages[table[b, s // L], s % L]`` (a dense cache
``[slots, S, K, H]`` is the same with ``S / L`` pages per slot, a free reshape). Program
(b, k, c) takes row b, kv head k and the c-th of ``splits`` runs of the row's pages, and
walks them up to the row's length in steps of ``keys_per_step`` keys (small pages are
gathered several to a step: 128-key steps read fastest): each step's keys widened to fp16,
the scores of the head's G query heads (padded to 16 rows, Triton's smallest dot) on the
tensor cores, an online softmax in fp32, then the values likewise. The splits' unnormalized
outputs and softmax statistics are merged after the kernel (a log-sum-exp merge in jnp): many
splits keep the GPU busy when rows are few.

Why fp16: E4M3 widens to fp16 exactly in one conversion per two values, while bf16 takes a
detour through fp32 (two more). At 64 rows x 4,096 keys on the H200 the conversions, not the
bytes, bounded the kernel widened to bf16 (1.3-1.8 TB/s); widened to fp16 it reads 2.0 TB/s
with 64-key pages and 2.9-3.0 with 128 (``benchmarks/NOTES.md``). So the kernel takes q in
fp16 (times the softmax scale, in fp32 first, saturated at fp16's largest value where it
would overflow), and the head's K and V scales, which factor out of the sums, are applied to
the fp32 scores and output instead of to each value.

A row of length 0 gives zeros. Steps past a row's length are never read. Table entries a row
does not own (out of range) are clipped into the pool, and read only inside its last visible
step, where the positions past the length are masked; so, as for the bf16 paged kernel, the
pool must hold finite values there (a zero-initialised pool does: a masked key weighs exactly
0, and 0 * NaN is NaN).

Axes: B rows, N query heads, K kv heads, G = N / K, H head dim, P pages, L keys per page,
W table width (pages per row), C splits.
"""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
from jax import lax

from pallas_kernels._mosaic import MASKED, triton_params
from pallas_kernels.paged_attention import paged_attention_reference

MIN_DOT_ROWS = 16  # Triton's smallest tensor-core tile: the G query heads are padded to it
_LAST_AXES = (((1,), (1,)), ((), ()))  # dot_general: contract both operands' last axis


def dequantize_pages(pages: jax.Array, scale: jax.Array) -> jax.Array:
    """E4M3 pages ``[P, L, K, H]`` times ``scale [K]``, in the scale's dtype."""
    return pages.astype(scale.dtype) * scale[:, None]


def scaled_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    scale: float | None = None,
) -> jax.Array:
    """The jnp reference: the pages dequantized, then ``paged_attention_reference``."""
    k, v = dequantize_pages(k_pages, k_scale), dequantize_pages(v_pages, v_scale)
    return paged_attention_reference(q, k, v, block_table, lengths, scale=scale)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def scaled_paged_attention_applies(q: jax.Array, k_pages: jax.Array) -> bool:
    """True for the kernel's static constraints: one query token per row of a half dtype,
    E4M3 pages of a power-of-two size of at least 16 keys and head dim, G <= 16."""
    if q.ndim != 4 or k_pages.ndim != 4 or q.shape[1] != 1:
        return False
    _, _, n, h = q.shape
    _, page_size, kv_heads, page_h = k_pages.shape
    return (
        k_pages.dtype == jnp.float8_e4m3fn
        and q.dtype in (jnp.bfloat16, jnp.float16)
        and page_h == h
        and n % kv_heads == 0
        and n // kv_heads <= MIN_DOT_ROWS
        and _power_of_two(h)
        and h >= 16
        and _power_of_two(page_size)
        and page_size >= 16
    )


def scaled_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    k_scale: jax.Array,
    v_scale: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    scale: float | None = None,
    *,
    programs: int = 528,
    keys_per_step: int = 128,
    num_warps: int = 4,
    num_stages: int = 3,
    consecutive_pages: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """q [B,1,N,H] over each row's first ``lengths[b]`` keys in E4M3 ``k/v_pages [P,L,K,H]``
    (values ``pages * k/v_scale [K]``) through ``block_table`` int32[B, W] -> [B,1,N,H].

    ``programs``: each row's pages are split into runs until the grid has about this many
    programs (4 per SM of an H200); ``keys_per_step``: a program's loop takes this many keys
    a step (``keys_per_step / L`` pages gathered at once; 128-key steps read fastest on the
    H200); ``num_warps`` / ``num_stages``: Triton's launch and pipelining.
    ``consecutive_pages``: the caller promises each row's pages follow one another
    (``block_table[b, i] == block_table[b, 0] + i``, as a dense cache cut into pages has it),
    so a program reads its row's first entry once instead of an entry a step, and no step's
    page address waits on a load. ``interpret`` runs the kernel on the CPU (tests).
    """
    b, _, n, h = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    g = n // kv_heads
    width = block_table.shape[1]
    per_step = max(1, keys_per_step // page_size)  # pages a step gathers
    steps = -(-width // per_step)  # steps of a whole row
    splits = 1
    while b * kv_heads * splits * 2 <= programs and splits * 2 <= steps:
        splits *= 2
    run = -(-steps // splits) * per_step  # pages per split, whole steps
    table = jnp.pad(
        jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1),
        ((0, 0), (0, run * splits - width)),
    )
    scale = h**-0.5 if scale is None else scale
    # [B, K, 16, H]: each kv head's query heads, padded to the dot's 16 rows.
    queries = q.reshape(b, kv_heads, g, h)
    queries = jnp.pad(queries, ((0, 0), (0, 0), (0, MIN_DOT_ROWS - g), (0, 0)))
    # The softmax scale applied to q once, in fp32, before q narrows to fp16 (the pages'
    # widening type: see the module's docstring), saturated where it would overflow fp16.
    big = float(jnp.finfo(jnp.float16).max)
    queries = jnp.clip(queries.astype(jnp.float32) * scale, -big, big).astype(jnp.float16)
    kernel = functools.partial(
        _kernel,
        pages_per_split=run,
        pages_per_step=per_step,
        page_size=page_size,
        last_page=num_pages - 1 if consecutive_pages else None,
    )
    whole = lambda x: pl.BlockSpec(x.shape, lambda i, j, c: (0,) * x.ndim)
    inputs = [
        lengths.astype(jnp.int32),
        table,
        k_scale,
        v_scale,
        queries,
        k_pages,
        v_pages,
    ]
    in_specs = [whole(x) for x in inputs]
    in_specs[4] = pl.BlockSpec((None, None, MIN_DOT_ROWS, h), lambda i, j, c: (i, j, 0, 0))
    part = (b, kv_heads, splits, MIN_DOT_ROWS)
    out_shape = [
        jax.ShapeDtypeStruct((*part, h), jnp.float32),  # unnormalized outputs
        jax.ShapeDtypeStruct(part, jnp.float32),  # running max
        jax.ShapeDtypeStruct(part, jnp.float32),  # running sum
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, MIN_DOT_ROWS, h), lambda i, j, c: (i, j, c, 0, 0)),
        pl.BlockSpec((None, None, None, MIN_DOT_ROWS), lambda i, j, c: (i, j, c, 0)),
        pl.BlockSpec((None, None, None, MIN_DOT_ROWS), lambda i, j, c: (i, j, c, 0)),
    ]
    acc, run_max, run_sum = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, kv_heads, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        compiler_params=triton_params(num_warps, num_stages, interpret),
        interpret=interpret,
        name="scaled_paged_attention",
    )(*inputs)
    # The log-sum-exp merge of the splits; a split that saw no key has max MASKED, weight 0.
    top = jnp.max(run_max, axis=2, keepdims=True)
    weight = jnp.exp(run_max - top)  # [B, K, C, 16]
    total = jnp.sum(run_sum * weight, axis=2)
    out = jnp.sum(acc * weight[..., None], axis=2) / jnp.maximum(total, 1e-30)[..., None]
    out = jnp.where((lengths > 0)[:, None, None, None], out, 0.0)
    return out[:, :, :g].reshape(b, 1, n, h).astype(q.dtype)


def _kernel(
    lengths_ref,
    table_ref,
    k_scale_ref,
    v_scale_ref,
    q_ref,
    k_ref,
    v_ref,
    acc_ref,
    max_ref,
    sum_ref,
    *,
    pages_per_split: int,
    last_page: int | None,
    pages_per_step: int,
    page_size: int,
):
    row, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = lengths_ref[row]
    q = q_ref[...]  # [16, H]
    first = split * pages_per_split
    # Steps of this run that hold keys below the length (none: the run is skipped).
    visible = jnp.minimum(first + pages_per_split, (length + page_size - 1) // page_size)
    num_steps = jnp.maximum(visible - first + pages_per_step - 1, 0) // pages_per_step
    keys = pages_per_step * page_size  # a step's keys
    # The head's scales factor out of the sums: applied to the fp32 scores and output.
    k_scale, v_scale = k_scale_ref[head], v_scale_ref[head]

    # Consecutive pages: the row's first page, read once (each step's pages follow from it).
    row_first_page = None if last_page is None else table_ref[row, 0]

    def page_ids(entries):  # the block-table entries' pages
        if row_first_page is None:
            return table_ref[row, entries]
        # Kept in the pool: a last step of several pages may reach past the row's pages, as
        # padded table entries do.
        return jnp.minimum(row_first_page + entries, last_page)

    def narrow(pages_ref, start):  # [keys, H]: the step's pages, one after the other
        if pages_per_step == 1:
            return pages_ref[page_ids(start), :, head, :]
        # Gathered key by key (page id, offset in the page): one [keys, H] load, no reshape.
        at = lax.broadcasted_iota(jnp.int32, (keys,), 0)
        ids = page_ids(start + at // page_size)
        return pages_ref[ids, at % page_size, head, :]

    def attend(i, carry):
        run_max, run_sum, acc = carry
        start = first + i * pages_per_step
        k = narrow(k_ref, start).astype(jnp.float16)  # exact
        v = narrow(v_ref, start).astype(jnp.float16)
        # [16, keys] in fp32: q against the keys' rows (both operands' last axis contracted)
        scores = lax.dot_general(q, k, _LAST_AXES, preferred_element_type=jnp.float32)
        scores = scores * k_scale
        positions = start * page_size + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
        scores = jnp.where(positions < length, scores, MASKED)
        new_max = jnp.maximum(run_max, jnp.max(scores, axis=1))
        correction = jnp.exp(run_max - new_max)
        weights = jnp.exp(scores - new_max[:, None])
        run_sum = run_sum * correction + jnp.sum(weights, axis=1)
        acc = acc * correction[:, None] + jnp.dot(
            weights.astype(v.dtype), v, preferred_element_type=jnp.float32
        )
        return new_max, run_sum, acc

    rows, h = q.shape
    start = (
        jnp.full((rows,), MASKED, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, h), jnp.float32),
    )
    run_max, run_sum, acc = lax.fori_loop(0, num_steps, attend, start)
    acc_ref[...] = acc * v_scale
    max_ref[...] = run_max
    sum_ref[...] = run_sum
