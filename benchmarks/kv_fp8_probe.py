"""Probe (kept out of the suites): one-token attention over an E4M3 K/V cache at the decode
suite's bs=64 x 4,096 keys (Llama-3-8B's 32 query / 8 kv heads, head dim 128), every variant
device-timed in one process beside the bf16 cache's attention and the read ceiling.

    PYTHONPATH=. python benchmarks/kv_fp8_probe.py [--only NAME ...] [--layers 4] [--tiny]

Each variant runs ``--layers`` layers' attention (separate caches, so nothing stays in L2) in
one jitted call; the figure is the cache bytes read per second of device time
(``back_to_back_seconds``). Variants:

- ``bf16``: ``cache_attention`` over a dense bf16 cache (the decode suite's bf16 path).
- ``fp8``: ``cache_attention`` over a dense E4M3 cache (``ScaledLayer``: our kernel as the
  model calls it, with ``consecutive_pages``).
- ``kernel_*``: ``pallas_kernels.scaled_paged_attention`` on the cache as 128-key pages with
  its knobs named: ``w`` warps, ``s`` stages, ``k`` keys a step, ``p`` programs;
  ``consecutive``: each row's page ids from its first entry (``consecutive_pages``, which the
  probe's table allows), so no step's loads wait on a table entry's load.
- ``fp8_read``: XLA's sum over the E4M3 bytes of every layer's cache (the same bytes, read
  once): what a plain read of narrow bytes reaches here, beside the bf16 read ceiling.

Each output is checked against the jnp reference (relative error printed). ``--tiny``: 2 rows
of 256 keys, the kernels interpreted, no read ceiling (the CPU: a smoke run).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import back_to_back_seconds, read_bandwidth, write_probe_json
from pallas_kernels import scaled_paged_attention as spa
from spark_jax.ops.attention import cache_attention
from spark_jax.ops.kv_cache import ScaledLayer, quantize_kv
from spark_jax.ops.reference import AttentionMask

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 128

KERNELS = {
    "kernel_w4_s3": dict(num_warps=4, num_stages=3),
    "kernel_w4_s2": dict(num_warps=4, num_stages=2),
    "kernel_w4_s4": dict(num_warps=4, num_stages=4),
    "kernel_w4_s5": dict(num_warps=4, num_stages=5),
    "kernel_w4_s6": dict(num_warps=4, num_stages=6),
    "kernel_w8_s3": dict(num_warps=8, num_stages=3),
    "kernel_w4_s3_k64": dict(num_warps=4, num_stages=3, keys_per_step=64),
    "kernel_w4_s2_k256": dict(num_warps=4, num_stages=2, keys_per_step=256),
    "kernel_w4_s3_p1056": dict(num_warps=4, num_stages=3, programs=1056),
    "kernel_w4_s3_consecutive": dict(num_warps=4, num_stages=3, consecutive_pages=True),
    "kernel_w4_s2_consecutive": dict(num_warps=4, num_stages=2, consecutive_pages=True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="small shapes, interpreted (CPU)")
    args = parser.parse_args()
    rows, keys = (2, 256) if args.tiny else (64, 4096)
    wanted = lambda name: args.only is None or name in args.only

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((rows, 1, HEADS, HEAD_DIM)), jnp.bfloat16)
    lengths = jnp.full((rows,), keys, jnp.int32)
    mask = AttentionMask(query_positions=lengths[:, None] - 1, key_lengths=lengths)
    shape = (rows, keys, KV_HEADS, HEAD_DIM)
    layers = []
    for i in range(args.layers):
        key = jax.random.key(i)
        k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in jax.random.split(key))
        scales = [jnp.full((KV_HEADS,), 0.01, jnp.bfloat16) for _ in range(2)]
        layers.append((k, v, *scales, quantize_kv(k, scales[0]), quantize_kv(v, scales[1])))
    table = jnp.arange(rows * keys // PAGE, dtype=jnp.int32).reshape(rows, keys // PAGE)
    pages = lambda x: x.reshape(-1, PAGE, KV_HEADS, HEAD_DIM)
    read = 1e12 if args.tiny else read_bandwidth()
    results = {"read_ceiling_tb_s": read / 1e12, "device": str(jax.devices()[0])}
    narrow_bytes = 2 * rows * keys * KV_HEADS * HEAD_DIM * args.layers
    _, _, ks, vs, k8, v8 = layers[0]
    reference = np.asarray(
        spa.scaled_paged_attention_reference(q, pages(k8), pages(v8), ks, vs, table, lengths),
        np.float32,
    )  # layer 0's, against which every variant's layer 0 is checked

    def variant(name, one_layer, nbytes):
        jitted = jax.jit(lambda layers: [one_layer(*layer) for layer in layers])
        fn = lambda: jitted(layers)
        try:
            out = np.asarray(fn()[0], np.float32)
            error = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
            seconds = back_to_back_seconds(fn, calls=args.calls)
        except Exception as e:  # a variant that does not compile is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, results[name], flush=True)
            return
        results[name] = {
            "us_per_layer": seconds / args.layers * 1e6,
            "tb_s": nbytes / seconds / 1e12,
            "of_ceiling": nbytes / seconds / read,
            "rel_error": error,
        }
        print(name, json.dumps(results[name]), flush=True)

    if wanted("fp8_read"):
        narrow = lambda layers: [x for layer in layers for x in layer[4:]]  # k8, v8
        total = jax.jit(lambda layers: sum(jnp.sum(x.astype(jnp.float32)) for x in narrow(layers)))
        seconds = back_to_back_seconds(lambda: total(layers), calls=args.calls)
        results["fp8_read"] = {"tb_s": narrow_bytes / seconds / 1e12}
        results["fp8_read"]["of_ceiling"] = narrow_bytes / seconds / read
        print("fp8_read", json.dumps(results["fp8_read"]), flush=True)
    if wanted("bf16"):
        variant(
            "bf16",
            lambda k, v, *_: cache_attention(q, k, v, None, mask),
            2 * narrow_bytes,
        )
    if wanted("fp8"):
        variant(
            "fp8",
            lambda _k, _v, ks, vs, k8, v8: cache_attention(
                q, ScaledLayer(k8, ks), ScaledLayer(v8, vs), None, mask
            ),
            narrow_bytes,
        )
    for name, knobs in KERNELS.items():
        if wanted(name):
            variant(
                name,
                lambda _k, _v, ks, vs, k8, v8, knobs=knobs: spa.scaled_paged_attention(
                    q,
                    pages(k8),
                    pages(v8),
                    ks,
                    vs,
                    table,
                    lengths,
                    **knobs,
                    interpret=args.tiny,
                ),
                narrow_bytes,
            )
    print(json.dumps(results))
    write_probe_json(results, "kv_fp8_probe")


if __name__ == "__main__":
    main()
