"""Probe (kept out of the suites): the attention of a cached wave's prefill chunk over a paged
cache, the flash kernel reading the pages in place against the same kernel over the rows
gathered first (what the engine's prefills ran before), device-timed, 32 layers' worth.

    PYTHONPATH=. python benchmarks/paged_prefill_probe.py [--rows 8] [--new 72]
        [--cached 1000] [--padded 576 640]

Llama-3-8B's heads (32 / 8, head dim 128), 16-key pages, a 128-page table per row (the
serving suite's 2 048 positions). Per padded length: milliseconds a layer each way and
their ratio, and whether the two outputs agree bitwise on the real queries.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import back_to_back_seconds
from spark_jax.ops import attention as att
from spark_jax.ops.kv_cache import PagedLayer
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.reference import AttentionMask

PAGED = KernelOptions(paged_flash_prefill=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new", type=int, default=72, help="new queries a row")
    parser.add_argument("--cached", type=int, default=1000, help="keys a row holds before")
    parser.add_argument("--padded", type=int, nargs="+", default=[576, 640])
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    b, width, page = args.rows, 128, 16
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.permutation(b * width).reshape(b, width), jnp.int32)
    pool = lambda: jnp.asarray(rng.standard_normal((b * width, page, 8, 128)), jnp.bfloat16)  # noqa: E731
    k, v = PagedLayer(pool(), table), PagedLayer(pool(), table)
    lengths = jnp.full((b,), args.cached + args.new, jnp.int32)
    results = {"device": jax.devices()[0].device_kind}
    for t in args.padded:
        q = jnp.asarray(rng.standard_normal((b, t, 32, 128)), jnp.bfloat16)
        positions = (lengths - args.new)[:, None] + jnp.arange(t, dtype=jnp.int32)
        mask = AttentionMask(positions, lengths)

        @jax.jit
        def in_place(q, k=k, v=v, mask=mask):
            return att.cache_attention(q, k, v, None, mask, options=PAGED)

        @jax.jit
        def gathered(q, k=k, v=v, mask=mask):
            return att.attention(q, k.read(None), v.read(None), mask)

        a, g = in_place(q), gathered(q)
        same = bool(jnp.array_equal(a[:, : args.new], g[:, : args.new]))
        row = {"kernel": att.paged_kernel(q, k, options=PAGED), "bitwise_equal": same}
        for name, fn in (("in_place", in_place), ("gathered", gathered)):
            row[f"{name}_ms_per_layer"] = back_to_back_seconds(lambda fn=fn, q=q: fn(q), 20) * 1e3
        row["gathered_over_in_place"] = row["gathered_ms_per_layer"] / row["in_place_ms_per_layer"]
        row["saved_ms_32_layers"] = args.layers * (
            row["gathered_ms_per_layer"] - row["in_place_ms_per_layer"]
        )
        results[f"t{t}"] = row
        print(t, json.dumps(row), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
