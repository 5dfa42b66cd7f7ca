"""NLLB's decode-step attention alone: the one-query kernel against cuDNN, our Mosaic flash
walk and XLA's reference, on the step shapes of ``benchmarks/nllb.py``.

One "step" here is the 24 attentions of NLLB-600M's decoder step, chained as in the model:
per layer, self-attention (the new key and value written at each row's length, then one
query over the cache) and cross-attention (one query over the source's keys), each layer's
output the next one's query. Shapes: greedy, 32 rows, self cache 128 positions at length ~40,
source 64 positions at ~30 keys; beam, 128 rows (32 sources x 4 beams), the same lengths,
where beam search also moves every row's cache to its parent beam each step: ``reorder``
variants gather the 24 self-attention buffers by row (what ``EncoderDecoderCache.gather_rows``
does), the kernel's ``table`` variant rewrites its row table instead and reads through it.

Each variant is checked against the fp32 reference on the same inputs (relative error of the
step's output), then timed as a chain of steps (``chain_seconds``). The floor is the step's
K/V bytes at the read bandwidth measured in the same run.

    PYTHONPATH=. python3 benchmarks/one_query.py [--tiny]
"""

from __future__ import annotations

import argparse
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import chain_seconds, emit, print_table, read_bandwidth
from pallas_kernels.one_query_attention import one_query_attention
from spark_jax.ops.attention import (
    AttentionMask,
    cudnn_decode_attention,
    pallas_decode_attention,
    reference_attention,
)
from spark_jax.ops.kv_cache import write_kv

ON_GPU = jax.default_backend() == "gpu"
FULL = dict(layers=12, heads=16, head_dim=64, self_len=128, length=40, source_len=64, src=30)
TINY = dict(layers=2, heads=4, head_dim=16, self_len=32, length=9, source_len=16, src=7)

State = tuple[Any, ...]  # (x [B,1,N,H], k caches, v caches, lengths)


def make_inputs(shape: dict[str, int], rows: int, dtype: jnp.dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n, h, layers = shape["heads"], shape["head_dim"], shape["layers"]

    def normal(*dims: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(dims), dtype)

    return dict(
        x=normal(rows, 1, n, h),
        k=tuple(normal(rows, shape["self_len"], n, h) for _ in range(layers)),
        v=tuple(normal(rows, shape["self_len"], n, h) for _ in range(layers)),
        cross_k=tuple(normal(rows, shape["source_len"], n, h) for _ in range(layers)),
        cross_v=tuple(normal(rows, shape["source_len"], n, h) for _ in range(layers)),
        # Rows in groups of 4 share a length, as the beams of one request do.
        lengths=jnp.asarray(
            np.repeat(rng.integers(shape["length"] - 8, shape["length"] + 8, -(-rows // 4)), 4)[
                :rows
            ],
            "int32",
        ),
        source_lengths=jnp.asarray(rng.integers(shape["src"] - 4, shape["src"] + 4, rows), "int32"),
        # Beam reorder: each row takes a random beam of its group of 4 as its parent.
        parents=jnp.asarray(
            (np.arange(rows) // 4) * 4 + rng.integers(0, 4, rows) if rows >= 4 else np.zeros(rows),
            jnp.int32,
        ),
    )


def _xla_like(attend: Callable[..., jax.Array]) -> Callable[..., Any]:
    """A step through ``attend(q, k, v, mask)``: scatter the new key/value, then attend."""

    def self_attention(q, k_cache, v_cache, lengths, table):
        del table
        positions = lengths[:, None]
        k_cache = write_kv(k_cache, q, None, positions)
        v_cache = write_kv(v_cache, q, None, positions)
        out = attend(q, k_cache, v_cache, AttentionMask(positions, lengths + 1))
        return out, k_cache, v_cache

    def cross_attention(q, k, v, lengths):
        return attend(q, k, v, AttentionMask(jnp.zeros_like(lengths)[:, None], lengths, False))

    return self_attention, cross_attention


def _kernel_like(interpret: bool, **tuning: int) -> Callable[..., Any]:
    """A step through ``one_query_attention`` (the write fused into the self-attention)."""

    def self_attention(q, k_cache, v_cache, lengths, table):
        return one_query_attention(
            q, k_cache, v_cache, lengths, q, q, table, interpret=interpret, **tuning
        )

    def cross_attention(q, k, v, lengths):
        return one_query_attention(q, k, v, lengths, interpret=interpret, **tuning)[0]

    return self_attention, cross_attention


def make_step(variant: Callable[..., Any], reorder: str, inputs: dict) -> Callable[[State], State]:
    """One decoder step's attentions; ``reorder``: "", "gather" (rows moved) or "table"."""
    self_attention, cross_attention = variant
    cross_k, cross_v = inputs["cross_k"], inputs["cross_v"]
    source_lengths, parents = inputs["source_lengths"], inputs["parents"]

    @partial(jax.jit, donate_argnums=0)
    def step(state: State) -> State:
        x, ks, vs, lengths, table = state
        if reorder == "gather":
            ks = tuple(k[parents] for k in ks)
            vs = tuple(v[parents] for v in vs)
        if reorder == "table":
            # The parents' rows of the table; the newest position is each row's own.
            table = (
                table[parents]
                .at[jnp.arange(table.shape[0]), lengths]
                .set(jnp.arange(table.shape[0]), mode="drop")
            )
        new_ks, new_vs = [], []
        for k, v, ck, cv in zip(ks, vs, cross_k, cross_v, strict=True):
            x, k, v = self_attention(x, k, v, lengths, table if reorder == "table" else None)
            x = cross_attention(x, ck, cv, source_lengths)
            new_ks.append(k)
            new_vs.append(v)
        return x, tuple(new_ks), tuple(new_vs), lengths, table

    return step


def initial_state(inputs: dict) -> State:
    rows, length = inputs["k"][0].shape[:2]
    table = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, length))
    copy = lambda xs: tuple(jnp.array(x, copy=True) for x in xs)  # the step donates its state
    x, lengths = copy((inputs["x"], inputs["lengths"]))
    return x, copy(inputs["k"]), copy(inputs["v"]), lengths, jnp.array(table)


def variants(interpret: bool) -> dict[str, tuple[Callable[..., Any], str]]:
    kernel = partial(_kernel_like, interpret)
    table = {
        "xla": (_xla_like(reference_attention), ""),
        "oneq_g4_l16": (kernel(heads_per_program=4, block_keys=16), ""),
        "oneq_g2_l16": (kernel(heads_per_program=2, block_keys=16), ""),
        "oneq_g8_l16": (kernel(heads_per_program=8, block_keys=16), ""),
        "oneq_g16_l16": (kernel(heads_per_program=16, block_keys=16), ""),
        "oneq_g4_l32": (kernel(heads_per_program=4, block_keys=32), ""),
        "oneq_g1_l32": (kernel(heads_per_program=1, block_keys=32), ""),
        "oneq_g4_l64": (kernel(heads_per_program=4, block_keys=64), ""),
        "oneq_g2_l64": (kernel(heads_per_program=2, block_keys=64), ""),
        "oneq_g2_l64_w2": (kernel(heads_per_program=2, block_keys=64, num_warps=2), ""),
        "oneq_g1_l64_w2": (kernel(heads_per_program=1, block_keys=64, num_warps=2), ""),
        "oneq_g2_l32": (kernel(heads_per_program=2, block_keys=32), ""),
        "oneq_g4_l16_s2": (kernel(heads_per_program=4, block_keys=16, num_stages=2), ""),
        "oneq_g2_l32_s2": (kernel(heads_per_program=2, block_keys=32, num_stages=2), ""),
        "xla_reorder": (_xla_like(reference_attention), "gather"),
        "oneq_g4_l16_reorder": (kernel(heads_per_program=4, block_keys=16), "gather"),
        "oneq_g4_l16_table": (kernel(heads_per_program=4, block_keys=16), "table"),
    }
    if ON_GPU:
        table |= {
            "cudnn": (_xla_like(cudnn_decode_attention), ""),
            "pallas_flash": (_xla_like(pallas_decode_attention), ""),
            "cudnn_reorder": (_xla_like(cudnn_decode_attention), "gather"),
        }
    return table


def reference_output(inputs: dict, reorder: str) -> np.ndarray:
    """The step's output in fp32 through the reference (rows reordered first if asked)."""
    f32 = {
        key: jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype != jnp.int32 else a, val)
        for key, val in inputs.items()
    }
    step = make_step(_xla_like(reference_attention), "gather" if reorder else "", f32)
    return np.asarray(step(initial_state(f32))[0], np.float32)


def run(shape: dict[str, int], rows: int, dtype: jnp.dtype, steps: int, names: list[str]):
    inputs = make_inputs(shape, rows, dtype)
    refs = {flag: reference_output(inputs, flag) for flag in ("", "moved")}
    results: dict[str, Any] = {}
    for name, (variant, reorder) in variants(not ON_GPU).items():
        if names and name not in names:
            continue
        try:
            step = make_step(variant, reorder, inputs)
            out = np.asarray(step(initial_state(inputs))[0], np.float32)
            ref = refs["moved" if reorder else ""]
            error = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            seconds, _, _ = chain_seconds(step, initial_state(inputs), steps)
            results[name] = {"us_per_step": seconds * 1e6, "rel_err": error}
        except Exception as e:  # a variant that fails records why
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (interpret mode)")
    parser.add_argument("--variants", default="", help="comma list of variant names (all)")
    parser.add_argument("--cases", default="greedy,beam", help="greedy (32 rows), beam (128)")
    args = parser.parse_args()
    shape = TINY if args.tiny else FULL
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    names = [n for n in args.variants.split(",") if n]
    steps = 4 if args.tiny else 50
    read = read_bandwidth() if ON_GPU else None
    out: dict[str, Any] = {"device": jax.devices()[0].device_kind, "read_bytes_per_s": read}
    rows_of = {"greedy": 8 if args.tiny else 32, "beam": 16 if args.tiny else 128}
    for label in args.cases.split(","):
        rows = rows_of[label]
        results = run(shape, rows, dtype, steps, names)
        kv = 2 * shape["layers"] * rows * shape["heads"] * shape["head_dim"] * 2
        step_bytes = kv * (shape["length"] + shape["src"])
        floor_us = step_bytes / read * 1e6 if read else None
        out[label] = {"rows": rows, "floor_us": floor_us, "variants": results}
        print_table(
            ["variant", "us/step", "rel err"],
            [
                [name, r.get("us_per_step"), r.get("rel_err", r.get("error"))]
                for name, r in results.items()
            ],
        )
    emit(out, "one_query")


if __name__ == "__main__":
    main()
