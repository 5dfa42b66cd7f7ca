"""NLLB's decode-step projections alone: the fused projection kernel against XLA's path.

One "step" here is the 72 projections of NLLB-600M's 12 decoder layers at one token per row,
chained as in the model (attention left out: the self-attention's query part of the qkv output
stands in for its output): per layer LayerNorm + qkv (1024 -> 3072), out (1024 -> 1024) +
residual, LayerNorm + q, cross out + residual, LayerNorm + fc1 (1024 -> 4096) + relu, fc2
(4096 -> 1024) + residual; each layer its own random bf16 weights (336 MB in all, past the L2).
XLA's path is ``decode_linear_reference`` (LayerNorm, GEMM, bias, residual as the modules run
them: ~17 kernels a layer); ours ``pallas_kernels.decode_linear`` (6 kernels a layer) under a
few tilings (``n``: output columns per program, ``k``: weight rows per tile, ``w`` warps,
``s`` pipeline stages). Each is checked against an fp32 run of the reference, then timed as a
chain of steps; the floor is the weights' bytes at the read bandwidth measured in the run.

    PYTHONPATH=. python3 benchmarks/decode_linear.py [--tiny]
"""

from __future__ import annotations

import argparse
import traceback
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import chain_seconds, emit, print_table, read_bandwidth
from pallas_kernels.decode_linear import decode_linear, decode_linear_reference

ON_GPU = jax.default_backend() == "gpu"
FULL = dict(layers=12, d=1024, ffn=4096)
TINY = dict(layers=2, d=64, ffn=128)
TILINGS = {
    "n32_k128_w4_s3": dict(block_n=32, block_k=128, num_warps=4, num_stages=3),
    "n16_k128_w4_s3": dict(block_n=16, block_k=128, num_warps=4, num_stages=3),
    "n16_k256_w4_s4": dict(block_n=16, block_k=256, num_warps=4, num_stages=4),
    "n64_k128_w4_s3": dict(block_n=64, block_k=128, num_warps=4, num_stages=3),
    "n32_k64_w2_s4": dict(block_n=32, block_k=64, num_warps=2, num_stages=4),
}


def make_weights(shape: dict[str, int], dtype: jnp.dtype, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    d, f = shape["d"], shape["ffn"]

    def normal(*dims: int, std: float = 0.02) -> jax.Array:
        return jnp.asarray(rng.normal(0.0, std, dims), dtype)

    def norm() -> tuple[jax.Array, jax.Array]:
        return jnp.asarray(rng.normal(1.0, 0.1, d), dtype), normal(d, std=0.1)

    return [
        dict(
            qkv=(normal(d, 3 * d), normal(3 * d)),
            out=(normal(d, d), normal(d)),
            q=(normal(d, d), normal(d)),
            cross_out=(normal(d, d), normal(d)),
            fc1=(normal(d, f), normal(f)),
            fc2=(normal(f, d), normal(d)),
            norms=(norm(), norm(), norm()),
        )
        for _ in range(shape["layers"])
    ]


def make_step(linear: Any, weights: list[dict]):
    @jax.jit
    def step(x: jax.Array) -> jax.Array:
        d = x.shape[1]
        for w in weights:
            self_norm, cross_norm, ffn_norm = w["norms"]
            qkv = linear(x, *w["qkv"], norm=self_norm)
            x = linear(qkv[:, :d], *w["out"], residual=x)
            q = linear(x, *w["q"], norm=cross_norm)
            x = linear(q, *w["cross_out"], residual=x)
            h = linear(x, *w["fc1"], norm=ffn_norm, relu=True)
            x = linear(h, *w["fc2"], residual=x)
        return x

    return step


def run(shape: dict[str, int], rows: int, steps: int, names: list[str]) -> dict[str, Any]:
    dtype = jnp.bfloat16 if ON_GPU else jnp.float32
    weights = make_weights(shape, dtype)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, shape["d"])), dtype)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32), weights)
    ref = np.asarray(make_step(decode_linear_reference, f32)(x.astype(jnp.float32)))
    variants = {"xla": decode_linear_reference}
    for name, tiling in TILINGS.items():
        variants[name] = partial(decode_linear, interpret=not ON_GPU, **tiling)
    results: dict[str, Any] = {}
    for name, linear in variants.items():
        if names and name not in names:
            continue
        try:
            step = make_step(linear, weights)
            out = np.asarray(step(x), np.float32)
            error = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
            seconds, _, _ = chain_seconds(step, x, steps)
            results[name] = {"us_per_step": seconds * 1e6, "rel_err": error}
        except Exception as e:  # a tiling that fails records why
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (interpret mode)")
    parser.add_argument("--variants", default="", help="comma list of variant names (all)")
    args = parser.parse_args()
    shape = TINY if args.tiny else FULL
    names = [n for n in args.variants.split(",") if n]
    read = read_bandwidth() if ON_GPU else None
    d, f = shape["d"], shape["ffn"]
    weight_bytes = shape["layers"] * (6 * d * d + 2 * d * f) * 2
    out: dict[str, Any] = {"device": jax.devices()[0].device_kind, "read_bytes_per_s": read}
    for rows in (16, 32) if args.tiny else (32, 128):
        results = run(shape, rows, 2 if args.tiny else 50, names)
        floor_us = weight_bytes / read * 1e6 if read else None
        out[f"rows_{rows}"] = {"floor_us": floor_us, "variants": results}
        table = [
            [n, r.get("us_per_step"), r.get("rel_err", r.get("error"))] for n, r in results.items()
        ]
        print_table([f"rows {rows}", "us/step", "rel err"], table)
    emit(out, "decode_linear")


if __name__ == "__main__":
    main()
