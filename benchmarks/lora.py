"""Decode-step cost of per-row LoRA adapters, against the same step with no adapters.

    PYTHONPATH=. python3 benchmarks/lora.py           # H200: Llama-3-8B shapes, B=32, ctx 2048
    PYTHONPATH=. python3 benchmarks/lora.py --tiny    # any backend, seconds

Eight distinct rank-16 adapters on every projection (q/k/v/o, gate/up/down) are resident in a
pool of 8; the batch of 32 rows cycles through them, so every adapter is in use in every
step. The peer, in the same run and on the same cache, is the decode step without adapters;
the floor adds the pool's bytes to the weight and KV bytes a step must read. The kernels of
both compiled steps are counted (the adapters' cost is launches more than bytes). Also checked:
base rows of the adapted step give the same logits as the plain step (exact zero delta).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import chain_seconds, copy_bandwidth, emit, floor_seconds, print_table
from benchmarks.decode import (
    FULL,
    SMALL,
    hlo_report,
    kv_bytes_per_token,
    random_cache,
    random_tokens,
    weight_bytes_per_step,
)
from spark_jax.lora import LoraAdapter, LoraPool
from spark_jax.models import decoder


def random_adapters(config, count: int, rank: int, seed: int) -> list[LoraAdapter]:
    """``count`` adapters of ``rank`` on every target of the model, small random A and B."""
    rng = np.random.default_rng(seed)
    targets = decoder.lora_targets(config)
    adapters = []
    for i in range(count):
        weights = {
            name: (
                rng.standard_normal((rank, t.in_dim), np.float32) * 0.01,
                rng.standard_normal((t.out_dim, rank), np.float32) * 0.01,
            )
            for name, t in targets.items()
        }
        adapters.append(LoraAdapter(f"adapter{i}", rank, 2.0, weights))
    return adapters


def step_kernels(params, config, tokens, active, kv, lora) -> int:
    """Kernel launches of the compiled decode step, counted in its optimized HLO."""
    text = decoder.decode.lower(params, config, tokens, active, kv, lora).compile().as_text()
    return hlo_report(text, kv.k[0].size)["kernels"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    plan = SMALL if args.tiny else FULL
    config = plan.config
    batch, context = (4, 128) if args.tiny else (args.batch, args.context)
    dtype = jnp.dtype(plan.dtype)
    t0 = time.perf_counter()

    bandwidth = copy_bandwidth(plan.copy_bytes)
    params = decoder.init_params(config, jax.random.key(0), dtype)
    pool = LoraPool(decoder.lora_targets(config), args.adapters, args.rank, dtype)
    for adapter in random_adapters(config, args.adapters, args.rank, seed=1):
        pool.add(adapter)
    rows = np.arange(batch) % args.adapters
    lora = pool.batch(rows)
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pool.device_weights()))

    tokens = random_tokens(config, (batch,), seed=2)
    active = jnp.ones((batch,), bool)

    def step_plain(kv):
        return decoder.decode(params, config, tokens, active, kv)[1]

    def step_lora(kv):
        return decoder.decode(params, config, tokens, active, kv, lora)[1]

    # Correctness first: base rows through the adapted step equal the plain step.
    kv = random_cache(plan, batch, context, context - 64, seed=3)
    base_rows = pool.batch(np.full(batch, -1))
    plain_logits, kv = decoder.decode(params, config, tokens, active, kv)
    kv = kv.with_lengths(kv.lengths - 1)
    base_logits, kv = decoder.decode(params, config, tokens, active, kv, base_rows)
    kv = kv.with_lengths(kv.lengths - 1)
    lora_logits, kv = decoder.decode(params, config, tokens, active, kv, lora)
    # Bitwise on the CPU (fp32, see tests/test_lora.py); in bf16 on the GPU XLA fuses the
    # adapted step differently, so base rows agree to bf16 rounding.
    base_rel = float(jnp.linalg.norm(base_logits - plain_logits) / jnp.linalg.norm(plain_logits))
    base_equal = base_rel < 2e-2
    lora_changes = float(jnp.abs(lora_logits - plain_logits).max())

    kernels = {
        name: step_kernels(params, config, tokens, active, kv, step_lora)
        for name, step_lora in (("plain", None), ("lora", lora))
    }

    kv = kv.with_lengths(jnp.full((batch,), context - 64, jnp.int32))
    steps = 4 if args.tiny else 16
    plain_s, plain_all, kv = chain_seconds(step_plain, kv, steps)
    kv = kv.with_lengths(jnp.full((batch,), context - 64, jnp.int32))
    lora_s, lora_all, kv = chain_seconds(step_lora, kv, steps)

    kv_bytes = batch * (context - 64) * kv_bytes_per_token(config, dtype.itemsize)
    weights = weight_bytes_per_step(config, dtype.itemsize)
    results = {
        "benchmark": "lora",
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "tiny": args.tiny,
        "batch": batch,
        "context": context,
        "adapters": args.adapters,
        "rank": args.rank,
        "pool_bytes": pool_bytes,
        "ms_step_no_adapters": plain_s * 1e3,
        "ms_step_adapters": lora_s * 1e3,
        "s_per_step_repeats": {"plain": plain_all, "lora": lora_all},
        "overhead": lora_s / plain_s - 1.0,
        "kernels_no_adapters": kernels["plain"],
        "kernels_adapters": kernels["lora"],
        "kernels_added_per_layer": (kernels["lora"] - kernels["plain"]) / config.num_layers,
        "floor_ms_no_adapters": floor_seconds(weights + kv_bytes, bandwidth) * 1e3,
        "floor_ms_adapters": floor_seconds(weights + kv_bytes + pool_bytes, bandwidth) * 1e3,
        "copy_bytes_per_s": bandwidth,
        "base_rows_equal_plain": base_equal,
        "base_rows_rel_err": base_rel,
        "adapter_max_logit_change": lora_changes,
        "total_s": time.perf_counter() - t0,
    }
    emit(results, "lora")
    print_table(
        ["variant", "ms/step", "floor ms", "overhead", "kernels"],
        [
            ["no adapters", plain_s * 1e3, results["floor_ms_no_adapters"], 0.0, kernels["plain"]],
            [
                f"{args.adapters} x r{args.rank}",
                lora_s * 1e3,
                results["floor_ms_adapters"],
                results["overhead"],
                kernels["lora"],
            ],
        ],
    )
    if not base_equal or not lora_changes > 0:
        raise SystemExit("correctness check failed: see base_rows_equal_plain / adapter change")


if __name__ == "__main__":
    main()
