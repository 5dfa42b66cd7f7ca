"""Decode-step cost of per-row LoRA adapters, against the same step with no adapters.

    python -m benchmarks lora            # H200: Llama-3-8B shapes, B=32, ctx 2048
    python -m benchmarks lora --tiny     # any backend, seconds

Eight distinct rank-16 adapters on every projection (q/k/v/o, gate/up/down) are resident in a
pool of 8; the batch of 32 rows cycles through them, so every adapter is in use in every
step. The peer, in the same run and on the same cache, is the decode step without adapters.
Ours is what ``sj.generate`` and the Engine run once adapters exist: the model's kernels
widened to [W|A] in place (``LoraPool.fuse_into``), then mask and ·B batched (fp32 out,
added in the consumer's fusion). Both steps are timed chained on the device. Also checked:
the adapters change the logits.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Report, chain_seconds, llama, random_params


def random_adapters(config: Any, count: int, rank: int, seed: int) -> list[Any]:
    """``count`` adapters of ``rank`` on every target of the model, small random A and B."""
    from spark_jax.models import decoder
    from spark_jax.ops.lora import LoraAdapter

    rng = np.random.default_rng(seed)
    adapters = []
    for i in range(count):
        weights = {
            name: (
                rng.standard_normal((rank, t.in_dim), np.float32) * 0.01,
                rng.standard_normal((t.out_dim, rank), np.float32) * 0.01,
            )
            for name, t in decoder.lora_targets(config).items()
        }
        adapters.append(LoraAdapter(f"adapter{i}", rank, 2.0, weights))
    return adapters


def random_cache(config: Any, dtype: str, batch: int, max_len: int, length: int) -> Any:
    """A cache of ``batch`` rows holding ``length`` random keys and values each."""
    from spark_jax.ops.kv_cache import KVCache

    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    keys = jax.random.split(jax.random.key(3), 2 * config.num_layers)
    layers = [jax.random.normal(k, shape, dtype) for k in keys]
    return KVCache(
        k=tuple(layers[: config.num_layers]),
        v=tuple(layers[config.num_layers :]),
        lengths=jnp.full((batch,), length, jnp.int32),
    )


def compile_step(params: Any, config: Any, tokens: Any, active: Any, kv: Any, lora: Any) -> Any:
    """The decode step compiled for one variant (a fresh jit: traces are not shared)."""
    from spark_jax.models import decoder

    @functools.wraps(decoder.decode.__wrapped__)
    def fresh(*args: Any, **kwargs: Any) -> Any:
        return decoder.decode.__wrapped__(*args, **kwargs)

    step = jax.jit(fresh, static_argnames=("config",), donate_argnames=("kv",))
    return step.lower(params, config, tokens, active, kv, lora).compile()


def run(tiny: bool, peer: bool = True) -> Report:
    """The step without adapters is this suite's peer: always measured."""
    from spark_jax.models import decoder
    from spark_jax.ops.lora import LoraPool

    config, dtype = llama(tiny)
    batch, context, adapters, rank = (4, 128, 2, 4) if tiny else (32, 2048, 8, 16)
    steps = 4 if tiny else 16
    params = random_params(config, dtype)
    pool = LoraPool(decoder.lora_targets(config), adapters, rank, jnp.dtype(dtype))
    for adapter in random_adapters(config, adapters, rank, seed=1):
        pool.add(adapter)
    rows = np.arange(batch) % adapters
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, config.vocab_size, batch))
    tokens = tokens.astype(jnp.int32)
    active = jnp.ones((batch,), bool)
    kv = random_cache(config, dtype, batch, context, context - 64)

    def restart(kv: Any) -> Any:  # a new lengths array each time: the step donates the cache
        return kv.with_lengths(jnp.full((batch,), context - 64, jnp.int32))

    figures: dict[str, float] = {}
    logits: dict[str, Any] = {}
    for name in ("plain", "fused"):
        if name == "fused":
            pool.fuse_into(params)  # in place, as the Runner does: no second copy of W
        lora = None if name == "plain" else pool.batch(rows, fused=True)
        compiled = compile_step(params, config, tokens, active, kv, lora)
        logits[name], kv = compiled(params, tokens, active, restart(kv), lora)

        def step(state: Any, compiled: Any = compiled, lora: Any = lora) -> Any:
            return compiled(params, tokens, active, state, lora)[1]

        seconds, _, kv = chain_seconds(step, restart(kv), steps)
        figures[name] = seconds * 1e3
    report = Report()
    report.figures["adapters_ms_step"] = figures["fused"]
    report.peers["no_adapters_ms_step"] = figures["plain"]
    report.ratios["overhead"] = figures["fused"] / figures["plain"] - 1.0
    change = float(jnp.abs(logits["fused"] - logits["plain"]).max())
    report.details = {"batch": batch, "context": context, "adapters": adapters, "rank": rank}
    report.details["adapter_max_logit_change"] = change
    if not change > 0:
        report.notes.append("the adapters did not change the logits: check failed")
    report.table = [
        ["step", "ms", "overhead"],
        ["no adapters", figures["plain"], 0.0],
        [f"{adapters} adapters x rank {rank}", figures["fused"], report.ratios["overhead"]],
    ]
    return report
