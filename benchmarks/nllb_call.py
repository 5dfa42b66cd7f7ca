"""One greedy NLLB translation call (``sj.generate_batch``, 32 sources, 64 new tokens) on the
host's clock: when each device call is dispatched and when each readback returns, for
variants of the call's start and chunking, against the call's device floor measured in the
same run (the prefill synced alone + 63 steps of the fixed-count decode loop).

The shapes are NLLB-200-distilled-600M's (``benchmarks.nllb.FULL``) with random bf16 weights
that never pick EOS, so every row runs all 64 tokens. Variants:

- ``default``: the engine as it is (chunks of ``engine.STEPS_PER_SYNC`` steps, dispatched one
  ahead of the readback);
- ``sync16`` / ``sync64``: 16 or 64 steps per device call;
- ``prefill_graph``: the prefill compiled with the device loops' command buffers (one CUDA
  graph instead of ~500 launches from the host);
- ``loop_<options>_<exit>``: the decode chunk compiled with other XLA options (``cb``: the
  command buffers of ``compile_options``, ``nocb``: none, ``cbfusion``: command buffers without
  the WHILE / CONDITIONAL commands) and a fixed or data-dependent trip count.

The decode chunk alone (``engine._decode_chunk``, synced per call) is timed for each loop
variant: device ms per step as (T(16 steps) - T(8 steps)) / 8, against the fixed-count loop of
the same step (``benchmarks.nllb._decode_loop``).

    PYTHONPATH=. python3 benchmarks/nllb_call.py [--tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import jax

from benchmarks.common import emit, print_table, timed
from benchmarks.nllb import (
    FULL,
    TINY,
    Plan,
    _decode_loop,
    _loop_ms_per_step,
    greedy_params,
    make_sources,
)
from benchmarks.nllb_step import build
from spark_jax.generation.compile_options import device_loop_options


@contextmanager
def recording(model: Any) -> Iterator[list[tuple[str, float, float]]]:
    """Records (name, start, end) on the host clock of every device call of the engine's greedy
    call and every readback, without syncing anything."""
    from spark_jax.generation import generate as engine

    events: list[tuple[str, float, float]] = []
    runner = model.runner

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            events.append((name, start, time.perf_counter()))
            return out

        return timed_call

    originals = engine._pick, engine._decode_chunk, engine._to_host
    runner.init_state = wrap("init_state", runner.init_state)
    runner.prefill = wrap("prefill", runner.prefill)
    engine._pick = wrap("pick", engine._pick)
    engine._decode_chunk = wrap("chunk", engine._decode_chunk)
    engine._to_host = wrap("read", engine._to_host)
    try:
        yield events
    finally:
        del runner.init_state, runner.prefill  # the class's methods again
        engine._pick, engine._decode_chunk, engine._to_host = originals


def call_timeline(model: Any, plan: Plan, repeats: int) -> dict[str, Any]:
    """Median wall of the call and the median host timeline of its device calls (ms from the
    call's start: [name, dispatch start, return])."""
    import spark_jax as sj

    sources, params = make_sources(plan), greedy_params(plan)
    sj.generate_batch(model, sources, params)  # compile
    walls, timelines = [], []
    for _ in range(repeats):
        with recording(model) as events:
            start = time.perf_counter()
            sj.generate_batch(model, sources, params)
            walls.append(time.perf_counter() - start)
        timelines.append([(n, (a - start) * 1e3, (b - start) * 1e3) for n, a, b in events])
    middle = sorted(range(repeats), key=lambda i: walls[i])[repeats // 2]
    line = [[n, round(a, 2), round(b, 2)] for n, a, b in timelines[middle]]
    return {"wall_ms": statistics.median(walls) * 1e3, "timeline": line}


LOOP_OPTIONS = {
    "cb": lambda: device_loop_options(),
    "nocb": lambda: {},
    "cbfusion": lambda: {
        **device_loop_options(),
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
    },
}


def decode_chunk_with(options: str) -> Callable[..., Any]:
    """``engine._decode_chunk`` compiled with the XLA options named (``LOOP_OPTIONS``)."""
    from spark_jax.generation import generate as engine

    return jax.jit(
        engine._decode_chunk.__wrapped__,
        static_argnames=("decode_fn", "num_steps", "greedy", "want_logprobs", "exit_early"),
        donate_argnames=("carry",),
        compiler_options=LOOP_OPTIONS[options](),
    )


@contextmanager
def variant(name: str) -> Iterator[None]:
    """The engine and model patched for one variant (restored after)."""
    from spark_jax.generation import generate as engine
    from spark_jax.generation.compile_options import DEVICE_LOOP_OPTIONS
    from spark_jax.models import nllb

    saved = engine.STEPS_PER_SYNC, nllb.prefill, engine._decode_chunk, engine.CHUNKS_EXIT_EARLY
    if name.startswith("loop_"):
        _, options, exit_rule = name.split("_")
        engine._decode_chunk = decode_chunk_with(options)
        engine.CHUNKS_EXIT_EARLY = exit_rule == "early"
    if name.startswith("sync"):
        engine.STEPS_PER_SYNC = int(name.removeprefix("sync"))
    if name == "prefill_graph":
        nllb.prefill = jax.jit(
            nllb.prefill.__wrapped__,
            static_argnames=("config",),
            donate_argnames=("cache",),
            compiler_options=DEVICE_LOOP_OPTIONS,
        )
    try:
        yield
    finally:
        engine.STEPS_PER_SYNC, nllb.prefill, engine._decode_chunk, engine.CHUNKS_EXIT_EARLY = saved


def prefill_ms(model: Any, plan: Plan, repeats: int = 7) -> float:
    """The prefill of the call's 32 sources, synced: dispatch + device, ms (median)."""
    sources, params = make_sources(plan), greedy_params(plan)
    runner, n = model.runner, len(sources)
    times = []
    for _ in range(repeats + 1):
        state = runner.init_state(n, 128, max(map(len, sources)))
        jax.block_until_ready(state)
        start = time.perf_counter()
        jax.block_until_ready(runner.prefill(state, list(range(n)), sources, [params] * n))
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3


def _engine_state(model: Any, plan: Plan) -> Any:
    """A cache of the engine's greedy call's shapes, its rows 40 positions in."""
    import jax.numpy as jnp

    from spark_jax.generation import generate as engine

    sources = make_sources(plan)
    n = len(sources)
    max_len = engine.cache_len(max(map(len, sources)) + plan.new_tokens)
    state = model.runner.init_state(n, max_len, max(map(len, sources)))
    return state.with_lengths(jnp.full((n,), 40))


def fori_steps(model: Any, plan: Plan) -> partial:
    """``steps=k`` -> k decode steps and argmax picks in a fixed-count loop (``_decode_loop``)."""
    import jax.numpy as jnp

    state = _engine_state(model, plan)
    n = state.num_slots
    tokens, active = jnp.full((n,), 5, jnp.int32), jnp.ones((n,), bool)
    return partial(_decode_loop, model.params, model.config, tokens, active, state, width=0)


def step_ms(model: Any, plan: Plan) -> float:
    """The decode step alone in a fixed-count device loop (no dispatch), ms."""
    run = fori_steps(model, plan)
    return _loop_ms_per_step(lambda k: run(steps=k), 16)


def chunk_steps(model: Any, plan: Plan, name: str) -> Callable[..., Any]:
    """k -> the engine's decode chunk of k steps (``engine._decode_chunk`` compiled as the loop
    variant ``name`` says), each call from rows 40 positions in; ``.lower(k)``: its program."""
    import jax.numpy as jnp

    from spark_jax.generation import generate as engine
    from spark_jax.ops.sampling import SamplerBatch

    _, options, exit_rule = name.split("_")
    fn = decode_chunk_with(options)
    state = _engine_state(model, plan)
    n, params = state.num_slots, greedy_params(plan)
    batch = SamplerBatch.from_params([params] * n, plan.vocab_size, model.eos_token_ids)
    mask, counts = jnp.zeros((n, 1), bool), jnp.zeros((n, 1), jnp.int32)
    max_tokens = jnp.full((n,), 10**6, jnp.int32)
    ones = jnp.ones((n,), jnp.int32)
    held = [engine._Carry(state, ones * 5, ones > 0, counts, ones)]

    def args(k: int) -> tuple[tuple, dict[str, Any]]:
        carry = held[0]
        carry = dataclasses.replace(carry, state=carry.state.with_lengths(jnp.full((n,), 40)))
        kwargs = dict(num_steps=k, greedy=True, want_logprobs=False)
        kwargs["exit_early"] = exit_rule == "early"
        return (model.runner.decode_fn, model.params, None, carry, batch, mask, max_tokens), kwargs

    def run(k: int) -> Any:
        positional, kwargs = args(k)
        held[0], out = fn(*positional, **kwargs)
        return out

    def lower(k: int) -> Any:
        positional, kwargs = args(k)
        return fn.lower(*positional, **kwargs)

    run.lower = lower
    return run


def chunk_ms(model: Any, plan: Plan, name: str, repeats: int = 5) -> dict[str, float]:
    """The engine's decode chunk alone, synced per call: device ms per step and the rest of a
    call of 8 steps (dispatch, loop set-up), for the loop variant ``name``."""
    run = chunk_steps(model, plan, name)
    seconds: dict[int, float] = {}
    for steps in (8, 16):
        times = []
        for _ in range(repeats + 1):
            _, elapsed = timed(lambda s=steps: run(s))
            times.append(elapsed)
        seconds[steps] = statistics.median(times[1:])
    per_step = (seconds[16] - seconds[8]) / 8 * 1e3
    return {
        "ms_per_step": per_step,
        "call8_ms": seconds[8] * 1e3,
        "call8_rest_ms": seconds[8] * 1e3 - 8 * per_step,
    }


def _copies(compiled_text: str) -> dict[str, Any]:
    """The copy instructions of a compiled program: how many, and the large ones (>= 64K
    elements: a cache layer copied every step would show here) by result shape and name."""
    import math
    import re

    lines = [ln for ln in compiled_text.splitlines() if " copy(" in ln or "copy-start(" in ln]
    large = []
    for line in lines:
        shape = re.search(r"\[([\d,]*)\]", line.split("=", 1)[1])
        dims = [int(d) for d in shape.group(1).split(",") if d] if shape else []
        if math.prod(dims) >= 65536:
            large.append(line.split("=", 1)[1].split("copy")[0].strip() + line.split("=")[0])
    return {"copies": len(lines), "large": large[:12]}


def _whiles(compiled_text: str) -> dict[str, Any]:
    """The backend configs of the program's while loops (XLA notes a trip count it knows)."""
    lines = [ln for ln in compiled_text.splitlines() if " while(" in ln]
    counts = [
        ln.split('"known_trip_count":')[1][:24] if "known_trip_count" in ln else "-" for ln in lines
    ]
    return {"while_trip_counts": counts}


def loop_profiles(model: Any, plan: Plan, steps: int = 16) -> dict[str, Any]:
    """Kernels per step of the fixed-count loop and of the engine's chunk (no command buffers,
    so the profiler sees every kernel), and the copies in each compiled program."""
    from benchmarks.common import kernel_profile

    out: dict[str, Any] = {}
    fori = fori_steps(model, plan)
    text = _decode_loop.lower(*fori.args, **fori.keywords, steps=steps).compile().as_text()
    out["fori"] = kernel_profile(lambda: fori(steps=steps), per=steps, top=12, gaps=6)
    out["fori"] |= _copies(text) | _whiles(text)
    for name in ("loop_nocb_fixed", "loop_cb_fixed"):
        run = chunk_steps(model, plan, name)
        text = run.lower(steps).compile().as_text()
        out[name] = kernel_profile(lambda r=run: r(steps), per=steps, top=12, gaps=6)
        out[name] |= _copies(text) | _whiles(text)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true", help="kernels of the loops, per step")
    parser.add_argument(
        "--variants",
        default="default,sync64,loop_cb_fixed,loop_nocb_fixed,loop_nocb_early,loop_cbfusion_fixed",
    )
    args = parser.parse_args()
    plan = TINY if args.tiny else FULL
    t0 = time.perf_counter()
    model = build(plan)
    results: dict[str, Any] = {"benchmark": "nllb_call", "tiny": args.tiny}
    results["device"] = str(jax.devices()[0].device_kind)
    results["jax"] = jax.__version__
    step = step_ms(model, plan)
    variants = args.variants.split(",")
    for name in ("loop_cb_early", *variants):  # the engine's own loop first
        if name.startswith("loop_"):
            results[f"chunk_{name}"] = chunk_ms(model, plan, name)
    rows = []
    for name in variants:
        with variant(name):
            prefill = prefill_ms(model, plan)
            floor = prefill + (plan.new_tokens - 1) * step
            r = call_timeline(model, plan, args.repeats)
        r |= {
            "prefill_synced_ms": prefill,
            "floor_ms": floor,
            "floor_fraction": floor / r["wall_ms"],
        }
        results[name] = r
        rows.append([name, r["wall_ms"], prefill, floor, r["floor_fraction"]])
    results["step_ms"] = step
    if args.profile:
        results["profiles"] = loop_profiles(model, plan)
    results["wall_s"] = time.perf_counter() - t0
    emit(results, "nllb_call")
    print_table(["variant", "call_ms", "prefill_ms", "floor_ms", "floor/call"], rows)
    print(f"step alone {step:.3f} ms")
    for key in results:
        if key.startswith("chunk_"):
            print(f"{key}: {results[key]}")
    for name in variants:
        print(f"{name}: {results[name]['timeline']}")
    for name, r in results.get("profiles", {}).items():
        print(f"profile {name}: {r}")


if __name__ == "__main__":
    main()
