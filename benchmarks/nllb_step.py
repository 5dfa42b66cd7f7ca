"""NLLB-200-distilled-600M's decoder step on the GPU: variants of the step against the HBM read
floor, and where the engine's greedy call spends its time (kernels, gaps).

The step is 32 rows (greedy over 32 sources) at cache length ~40 over ~34 source tokens, random
bf16 weights; each variant runs in a fixed-count device loop (``benchmarks.nllb._decode_loop``,
argmax picks), timed as (T(2k) - T(k)) / k, and profiled kernel by kernel
(``benchmarks.common.kernel_profile``). The floor is the bytes one step must read (decoder
weights, the tied LM head, the self and cross K/V in use) at the read bandwidth measured in
the same run. Variants: the default dispatch; attention through our Pallas kernels or XLA's
reference instead of cuDNN; XLA command buffers on the loop; cuBLAS instead of Triton GEMMs;
XLA options that change fusion or GEMM choice.
The engine's call (``sj.generate_batch``, 64 new tokens) is profiled whole: the kernels'
summed time against its span and its wall time shows what the host adds.

    PYTHONPATH=. python3 benchmarks/nllb_step.py [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    emit,
    kernel_profile,
    out_dir,
    print_table,
    read_bandwidth,
    timed,
)
from benchmarks.nllb import (
    EOS,
    EOS_MARGIN,
    FULL,
    TGT_LANG,
    TINY,
    Plan,
    _decode_loop,
    _loop_ms_per_step,
    _reorder_loop,
    beam_requests,
    greedy_params,
    hf_config_dict,
    language_ids,
    make_sources,
)


def build(plan: Plan) -> Any:
    """A spark_jax Model of the plan's shapes with random bf16 weights that never pick EOS."""
    import spark_jax as sj
    from spark_jax.config import config_from_hf
    from spark_jax.models import nllb

    config = config_from_hf({"model_type": "m2m_100", **hf_config_dict(plan)})
    params = nllb.init_params(config, jax.random.key(0), jnp.bfloat16)
    eos_row = params["shared"]["embedding"][EOS].astype(jnp.float32)
    bias = params["decoder_norm"]["bias"].astype(jnp.float32)
    bias = bias - EOS_MARGIN * eos_row / jnp.sum(eos_row**2)
    params["decoder_norm"]["bias"] = bias.astype(jnp.bfloat16)
    runner = nllb.NllbRunner(config, params, language_ids(plan.vocab_size), TGT_LANG)
    return sj.Model(config, params, tokenizer=None, runner=runner)


def step_bytes(model: Any, rows: int, length: int, source_len: int) -> int:
    """What one decode step must read: decoder weights, the LM head, the K/V in use."""
    params = model.params
    decoder = [v for k, v in params.items() if k.startswith("decoder")]
    weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(decoder))
    weights += params["shared"]["embedding"].nbytes
    c = model.config
    kv_row = 2 * c.decoder_layers * c.d_model * 2  # k and v, every layer, bf16
    return weights + rows * kv_row * (length + source_len)


def _variant_loop(compiler_options: dict[str, Any] | None) -> Callable[..., Any]:
    """``_decode_loop`` compiled with ``compiler_options`` (a jit of its own)."""
    if not compiler_options:
        return _decode_loop
    return jax.jit(
        _decode_loop.__wrapped__,
        static_argnames=("config", "steps", "width"),
        compiler_options=compiler_options,
    )


def time_variant(
    model: Any,
    state_fn: Callable[[], Any],
    rows: int,
    steps: int,
    attention: str | None,
    compiler_options: dict[str, Any] | None,
    hlo_name: str = "",
    width: int = 0,
) -> dict[str, Any]:
    """ms per step of the fixed-count loop and its kernel profile under one variant
    (``width`` > 0: beam search's pick, a top-``width`` of the log-softmax, instead of argmax)."""
    from spark_jax.ops.attention import forced_implementation

    loop = _variant_loop(compiler_options)
    tokens = jnp.full((rows,), 5, jnp.int32)
    active = jnp.ones((rows,), bool)
    jax.clear_caches()  # the attention dispatch acts at trace time
    try:
        with forced_implementation(attention):
            run = partial(loop, model.params, model.config, tokens, active, width=width)
            ms = _loop_ms_per_step(lambda k: run(state_fn(), steps=k), steps)
            profile = kernel_profile(lambda: run(state_fn(), steps=steps), calls=2, per=steps)
            if hlo_name and out_dir() is not None:
                args = (model.params, model.config, tokens, active, state_fn())
                text = loop.lower(*args, steps=steps, width=width)
                path = out_dir() / f"{hlo_name}.txt.gz"
                path.write_bytes(gzip.compress(text.compile().as_text().encode()))
    except Exception as error:  # a variant that does not apply here is reported, not fatal
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        jax.clear_caches()
    kinds = profile.get("by_kind_count_us", {})
    return {
        "ms_per_step": ms,
        "kernels": profile.get("kernels"),
        "busy_us": profile.get("busy_us"),
        "span_us": profile.get("span_us"),
        "top_kinds": dict(list(kinds.items())[:8]),
    }


def reorder_profile(state: Any, rows: int, steps: int) -> dict[str, Any]:
    """Beam search's cache reorder alone (every row takes another's history, at the state's
    lengths): ms per reorder in a device loop and its kernels."""
    source_rows = jnp.arange(rows, dtype=jnp.int32)[::-1]
    run = partial(_reorder_loop, state, source_rows)
    ms = _loop_ms_per_step(lambda k: run(steps=k), steps)
    profile = kernel_profile(lambda: run(steps=steps), calls=2, per=steps)
    kinds = profile.get("by_kind_count_us", {})
    return {
        "ms_per_reorder": ms,
        "kernels": profile.get("kernels"),
        "busy_us": profile.get("busy_us"),
        "top_kinds": dict(list(kinds.items())[:6]),
    }


def engine_call(
    model: Any, plan: Plan, fixed_chunks: bool, steps_per_sync: int = 8
) -> dict[str, Any]:
    """The engine's greedy call: wall time, and its kernels' busy time against their span."""
    import spark_jax as sj
    from spark_jax.generation import generate as engine

    sources = make_sources(plan)
    params = greedy_params(plan)
    saved = engine.CHUNKS_EXIT_EARLY, engine.STEPS_PER_SYNC
    engine.CHUNKS_EXIT_EARLY, engine.STEPS_PER_SYNC = not fixed_chunks, steps_per_sync
    try:

        def call() -> list[Any]:
            return sj.generate_batch(model, sources, params)

        call()
        walls = [timed(call)[1] for _ in range(plan.repeats)]
        profile = kernel_profile(call, calls=1, gaps=15)
    finally:
        engine.CHUNKS_EXIT_EARLY, engine.STEPS_PER_SYNC = saved
    return {
        "wall_s": float(np.median(walls)),
        "kernels": profile.get("kernels"),
        "busy_ms": (profile.get("busy_us") or 0) / 1e3,
        "span_ms": (profile.get("span_us") or 0) / 1e3,
        "idle_ms_in_gaps": (profile.get("idle_us_in_gaps") or 0) / 1e3,
        "idle_gaps": profile.get("idle_gaps"),
        "longest_gaps_us_after_before_at_ms": profile.get("longest_gaps"),
        "top_kinds": dict(list(profile.get("by_kind_count_us", {}).items())[:8]),
    }


def beam_call(model: Any, plan: Plan, attention: str | None) -> dict[str, Any]:
    """The engine's beam-search call (``sj.generate_beam``): median wall seconds, with the
    attention dispatch's choice or one implementation forced."""
    import spark_jax as sj
    from spark_jax.ops.attention import forced_implementation

    requests = beam_requests(plan, make_sources(plan))
    jax.clear_caches()
    try:
        with forced_implementation(attention):
            first = [r.sequences[0] for r in sj.generate_beam(model, requests)]
            walls = [timed(lambda: sj.generate_beam(model, requests))[1] for _ in range(5)]
    except Exception as error:
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    finally:
        jax.clear_caches()
    return {"wall_s": float(np.median(walls)), "sequences_head": [s[:4] for s in first[:2]]}


def host_profile(model: Any, plan: Plan, calls: int = 3) -> dict[str, Any]:
    """The host's share of the engine's greedy call (cProfile): seconds per call spent waiting
    for the device (reading arrays back) and in the rest, and the top functions by own time."""
    import cProfile
    import io
    import pstats

    import spark_jax as sj

    sources, params = make_sources(plan), greedy_params(plan)
    sj.generate_batch(model, sources, params)
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        sj.generate_batch(model, sources, params)
    profiler.disable()
    wall = (time.perf_counter() - start) / calls
    stats = pstats.Stats(profiler)
    waiting = sum(
        tottime
        for (path, _, func), (_, _, tottime, _, _) in stats.stats.items()
        if func in ("_value", "block_until_ready") and "jax" in path
    )
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    if out_dir() is not None:
        (out_dir() / "host_profile.txt").write_text(text.getvalue())
    total = stats.total_tt / calls
    return {
        "wall_ms": wall * 1e3,
        "profiled_ms": total * 1e3,
        "waiting_ms": waiting / calls * 1e3,
        "host_ms": total * 1e3 - waiting / calls * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--variants", default="all", help="comma-separated step variants, or none")
    parser.add_argument(
        "--host-profile", action="store_true", help="cProfile the engine's greedy call"
    )
    args = parser.parse_args()
    plan = TINY if args.tiny else FULL
    from spark_jax.generation.compile_options import device_loop_options

    t0 = time.perf_counter()
    model = build(plan)
    rows, length, source_len = plan.num_sources, 40, max(plan.source_lengths)
    steps = 16

    def state_fn(rows: int = rows) -> Any:
        state = model.runner.init_state(rows, 128, source_len)
        full = jnp.full((rows,), length, jnp.int32)
        return dataclasses.replace(state, lengths=full, source_lengths=full * 0 + source_len)

    read_bps = read_bandwidth(1 << 30 if args.tiny else 4 << 30)
    nbytes = step_bytes(model, rows, length, source_len)
    floor_ms = nbytes / read_bps * 1e3
    buffers = device_loop_options()
    no_triton = {"xla_gpu_enable_triton_gemm": False}
    variants = {
        "default": (None, None),
        "beam": (None, None),
        "beam_pallas_attention": ("pallas", None),
        "pallas_attention": ("pallas", None),
        "xla_attention": ("xla", None),
        "command_buffers": (None, buffers),
        "cublas": (None, no_triton),
        "cublas_command_buffers": (None, {**buffers, **no_triton}),
        # XLA options that may cut kernels: Triton for every fusion it can take (LayerNorms as
        # one kernel?), cuDNN GEMMs with fused epilogues, a wider search of GEMM tilings.
        "block_level_fusion": (
            None,
            {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True},
        ),
        "cudnn_gemm_fusion": (None, {"xla_gpu_cudnn_gemm_fusion_level": 2}),
        "exhaustive_tiling": (None, {"xla_gpu_exhaustive_tiling_search": True}),
        "triton_multi_output": (
            None,
            {"xla_gpu_unsupported_enable_triton_multi_output_fusion": True},
        ),
        "generic_triton_gemms": (
            None,
            {"xla_gpu_unsupported_enable_generic_triton_emitter_for_gemms": True},
        ),
    }
    if args.variants != "all":
        chosen = [v for v in args.variants.split(",") if v and v != "none"]
        variants = {name: variants[name] for name in chosen}
    results: dict[str, Any] = {"benchmark": "nllb_step", "tiny": args.tiny}
    results["device"] = str(jax.devices()[0].device_kind)
    results["jax"] = jax.__version__
    results["read_tb_s"] = read_bps / 1e12
    results["step_bytes"] = nbytes
    results["floor_ms"] = floor_ms
    rows_out = []
    beam_rows = rows * plan.num_beams
    beam_state = partial(state_fn, beam_rows)
    for name, (attention, options) in variants.items():
        hlo = "nllb_step_hlo" if name == "default" else ""
        if name.startswith("beam"):  # rows x beams, top-(2 x beams) of the log-softmax
            width = 2 * plan.num_beams
            r = time_variant(model, beam_state, beam_rows, steps, attention, None, "", width)
        else:
            r = time_variant(model, state_fn, rows, steps, attention, options, hlo)
        results[name] = r
        if "error" in r:
            rows_out.append([name, None, None, None, None, r["error"][:60]])
            continue
        floor = floor_ms
        if name.startswith("beam"):
            beam_bytes = step_bytes(model, beam_rows, length, source_len)
            floor = r["floor_ms"] = beam_bytes / read_bps * 1e3
        frac = floor / r["ms_per_step"] if r["ms_per_step"] > 0 else None
        rows_out.append([name, r["ms_per_step"], frac, r["kernels"], r["busy_us"], r["span_us"]])
    engine_modes = {
        "engine_greedy": (False, 8),
        "engine_greedy_fixed_chunks": (True, 8),
        "engine_greedy_sync16": (False, 16),
        "engine_greedy_sync32": (False, 32),
    }
    for name, (fixed, per_sync) in engine_modes.items():
        results[name] = engine_call(model, plan, fixed, per_sync)
    if args.host_profile:
        results["host_profile"] = host_profile(model, plan)
    results["beam_reorder"] = reorder_profile(beam_state(), beam_rows, steps)
    results["engine_beam"] = beam_call(model, plan, None)
    results["wall_s"] = time.perf_counter() - t0
    emit(results, "nllb_step")
    print_table(["variant", "ms/step", "floor/ms", "kernels", "busy_us", "span_us"], rows_out)
    for name in engine_modes:
        r = results[name]
        print(
            f"{name}: wall {r['wall_s'] * 1e3:.1f} ms, kernels busy {r['busy_ms']:.1f} ms over a"
            f" {r['span_ms']:.1f} ms span ({r['kernels']} kernels), idle {r['idle_ms_in_gaps']:.1f}"
            f" ms in {r['idle_gaps']} gaps >= 20 us; longest [us, after, before, at ms]:"
            f" {r['longest_gaps_us_after_before_at_ms']}"
        )
    print(f"beam call: {results['engine_beam']}; reorder alone: {results['beam_reorder']}")
    if "host_profile" in results:
        print(f"host profile of the greedy call: {results['host_profile']}")
    print(f"floor {floor_ms:.3f} ms/step ({nbytes / 1e9:.3f} GB at {read_bps / 1e12:.2f} TB/s)")


if __name__ == "__main__":
    main()
