"""Decode-step cost of per-row LoRA adapters, against the same step with no adapters.

    PYTHONPATH=. python3 benchmarks/lora.py         # H200: Llama-3-8B shapes, B=32, ctx 2048
    PYTHONPATH=. python3 benchmarks/lora.py --tiny  # any backend, seconds

Eight distinct rank-16 adapters on every projection (q/k/v/o, gate/up/down) are resident in a
pool of 8; the batch of 32 rows cycles through them, so every adapter is in use in every
step. The peer, in the same run and on the same cache, is the decode step without adapters;
the floor adds the pool's bytes to the weight and KV bytes a step must read. The kernels of
every compiled step are counted (the adapters' cost is launches more than bytes). Also checked:
base rows of an adapted step give the plain step's logits (exact zero delta), and every variant
gives the committed scheme's logits.

Variants, each its own jit, in this order (the third fuses the params in place):
  plain       the peer: a model that never had an adapter.
  pool        x·A a GEMM of its own (A in the pool), as NLLB runs it.
  fused       the headline: what sj.generate and the Engine run for a step with adapters: the
              model's own kernels widened to [W|A] (``LoraPool.fuse_into``, as the decoder's
              Runner does at the first add; the plain kernels are deleted), x·[W|A] is the
              base GEMM, then mask and ·B batched over output chunks (fp32 out, added in the
              consumer's fusion).
  fused_base  a step of base rows only once adapters were added: the widened kernels, no
              adapter input (the A columns of the output are dropped).
Earlier schemes, measured and gone from the tree (BENCHMARKS.md runs h, l, n): block-diagonal
B's (+20.4%, +16.0% fused), ·B rounding to bf16 (+14.0% fused).
Their compiled HLO goes to $OUT/hlo_lora_<variant>.txt.gz for fusion-level reading.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    chain_seconds,
    copy_bandwidth,
    emit,
    floor_seconds,
    out_dir,
    print_table,
)
from benchmarks.decode import (
    FULL,
    SMALL,
    hlo_report,
    kv_bytes_per_token,
    random_cache,
    random_tokens,
    weight_bytes_per_step,
)
from spark_jax.models import decoder
from spark_jax.ops.lora import LoraAdapter, LoraPool


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


# variant -> (kernels widened to [W | A], the step's adapter input: None, "pool" or "fused")
VARIANTS: dict[str, tuple[bool, str | None]] = {
    "plain": (False, None),
    "pool": (False, "pool"),
    "fused": (True, "fused"),
    "fused_base": (True, None),
}


def compile_step(name: str, params, config, tokens, active, kv, lora):
    """The decode step compiled for one variant (a fresh jit: traces are not shared)."""

    # A new function object per variant: jit's trace cache is keyed on the function, so a
    # second jit of decoder.decode itself would reuse the first variant's trace (patch unseen).
    @functools.wraps(decoder.decode.__wrapped__)
    def fresh(*args, **kwargs):
        return decoder.decode.__wrapped__(*args, **kwargs)

    step = jax.jit(fresh, static_argnames=("config",), donate_argnames=("kv",))
    compiled = step.lower(params, config, tokens, active, kv, lora).compile()
    out = out_dir()
    if out is not None:
        with gzip.open(out / f"hlo_lora_{name}.txt.gz", "wt") as f:
            f.write(compiled.as_text())
    return compiled


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
    pool_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(pool.device_weights()))
    tokens = random_tokens(config, (batch,), seed=2)
    active = jnp.ones((batch,), bool)
    kv = random_cache(plan, batch, context, context - 64, seed=3)
    steps = 4 if args.tiny else 16

    def restart(kv):  # a new lengths array each time: the step donates the whole cache
        return kv.with_lengths(jnp.full((batch,), context - 64, jnp.int32))

    def run(compiled, lora, kv):
        return compiled(params, tokens, active, restart(kv), lora)

    figures: dict[str, dict] = {}
    adapted: dict[str, jax.Array] = {}
    fused_in_place = False
    for name, (widened, kind) in VARIANTS.items():
        if widened and not fused_in_place:
            pool.fuse_into(params)  # in place, as the Runner does: no second copy of W
            fused_in_place = True
        lora = None if kind is None else pool.batch(rows, fused=kind == "fused")
        compiled = compile_step(name, params, config, tokens, active, kv, lora)
        logits, kv = run(compiled, lora, kv)
        figure = {"kernels": hlo_report(compiled.as_text(), kv.k[0].size)["kernels"]}
        if name == "plain":
            plain_logits = logits
        else:
            # Base rows equal the plain step: bitwise on the CPU (fp32); in bf16 on the GPU XLA
            # fuses the adapted step differently, so they agree to bf16 rounding.
            base_logits = logits
            if lora is not None:
                base_rows = pool.batch(np.full(batch, -1), fused=kind == "fused")
                base_logits, kv = run(compiled, base_rows, kv)
                figure["adapter_max_logit_change"] = float(jnp.abs(logits - plain_logits).max())
                adapted[name] = logits
            figure["base_rows_rel_err"] = _rel(base_logits, plain_logits)

        def step(state, compiled=compiled, lora=lora):
            return compiled(params, tokens, active, state, lora)[1]

        seconds, repeats, kv = chain_seconds(step, restart(kv), steps)
        figures[name] = figure | {"ms_step": seconds * 1e3, "s_per_step_repeats": repeats}
        print(name, figures[name], flush=True)
    for name, logits in adapted.items():  # every scheme gives the headline's adapted logits
        figures[name]["rel_err_vs_fused"] = _rel(logits, adapted["fused"])

    plain = figures["plain"]
    for figure in figures.values():
        figure["overhead"] = figure["ms_step"] / plain["ms_step"] - 1.0
        figure["kernels_added_per_layer"] = (figure["kernels"] - plain["kernels"]) / (
            config.num_layers
        )
    kv_bytes = batch * (context - 64) * kv_bytes_per_token(config, dtype.itemsize)
    weights = weight_bytes_per_step(config, dtype.itemsize)
    headline = figures["fused"]
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
        "ms_step_no_adapters": plain["ms_step"],
        "ms_step_adapters": headline["ms_step"],
        "overhead": headline["overhead"],
        "kernels_no_adapters": plain["kernels"],
        "kernels_adapters": headline["kernels"],
        "kernels_added_per_layer": headline["kernels_added_per_layer"],
        "floor_ms_no_adapters": floor_seconds(weights + kv_bytes, bandwidth) * 1e3,
        "floor_ms_adapters": floor_seconds(weights + kv_bytes + pool_bytes, bandwidth) * 1e3,
        "copy_bytes_per_s": bandwidth,
        "variants": figures,
        "total_s": time.perf_counter() - t0,
    }
    emit(results, "lora")
    print_table(
        ["variant", "ms/step", "overhead", "kernels", "+/layer", "base rel err", "err vs fused"],
        [
            [
                name,
                f["ms_step"],
                f["overhead"],
                f["kernels"],
                f["kernels_added_per_layer"],
                f.get("base_rows_rel_err"),
                f.get("rel_err_vs_fused"),
            ]
            for name, f in figures.items()
        ],
    )
    print(
        f"floor ms: {results['floor_ms_no_adapters']:.3g} plain, "
        f"{results['floor_ms_adapters']:.3g} with the pool ({pool_bytes / 1e9:.2f} GB)"
    )
    bad = [
        name
        for name, f in figures.items()
        if name != "plain"
        and not (
            f["base_rows_rel_err"] < 2e-2
            and f.get("adapter_max_logit_change", 1.0) > 0
            and f.get("rel_err_vs_fused", 0.0) < 2e-2
        )
    ]
    if bad:
        raise SystemExit(f"correctness check failed for {bad}: see base_rows_rel_err / rel_err")


def _rel(x: jax.Array, ref: jax.Array) -> float:
    return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


if __name__ == "__main__":
    main()
