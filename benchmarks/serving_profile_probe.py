"""Probe (kept out of the suites): one serving level of ``benchmarks/serving.py`` on one engine,
once per decode-steps-per-call setting, each then profiled in a pass of its own, to see what
the host does while the device idles.

    PYTHONPATH=. python benchmarks/serving_profile_probe.py [--concurrency 64 256] [--slots 64]
        [--num-scheduler-steps 1 4] [--step-token-budgets 0 256 512] [--no-profile]
        [--prefill-batches padded ragged mixed] [--max-batch-tokens 512 1024]
        [--max-prefill-seqs 4 8] [--python-tracer on|off]
        [--shared] [--shared-first] [--rerun-warm-steps] [--kv-pages N] [--tiny]

``--prefill-batches`` builds the suite's engine once per kind of prefill batch, [B, T]
(padded), ragged (``sj.Engine(ragged_prefill=True)``) and ragged with the decode rows riding
in them (``mixed_batches=True``), and runs every level on each: a same-call A/B.
``--step-token-budgets`` runs each level under each cap of the scheduler's tokens a step
(``max_num_batched_tokens``) on the same engine. ``--max-batch-tokens`` and
``--max-prefill-seqs`` build an engine per step budget
and per most prompts in a prefill batch (a smaller budget hides more of the riding decode
rows' weight reads under the prefill's matmuls, at more steps a prompt; more prompts admit a
wave of requests in one step, at a wider attention layout). Each level
takes the suite's requests and count (``--requests`` overrides it). Prints
the bare decode step at each level's width and mean context (device-timed, the engine's own
program); then per level and setting (the engine is built for the largest, its
multi-step programs compiled, and runs one step per call for 1) the level's throughput,
steady-state throughput, TPOT and host CPU per step, and ``profiled_idle``'s figures: the
idle fraction over the traced steps, the kernels and programs that take the time, and the
Python functions the host was inside (during the device's gaps and in all; with
``--python-tracer off`` only the device's gaps, unslowed by the tracer). ``--shared`` then
times a cached wave of the suite's shared-prefix workload step by step (``shared_timeline``);
``--shared-first`` runs the shared-prefix level twice more on the fresh engine, before any
other level, each request's TTFT printed wave by wave both times (do its slow waves follow
the levels before it?). ``--rerun-warm-steps`` runs every warm-up step once more after the
engine's warm-up (``warmup.run_steps_again``, which the engine's own warm-up now ends with on
the GPU: there the flag adds a second such pass).
``--kv-pages`` sizes the page pool in pages instead of by the device's free memory (needed
under XLA flags that hide the memory limit, such as
``--xla_gpu_command_buffer_update_mode=SKIP_TEMP``).
With ``$OUT`` set the last trace is kept there (``serving_trace.xplane.pb``) to be read again
with ``serving.idle_of_trace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import time
from typing import Any

import numpy as np

from benchmarks.common import profile_as_run
from benchmarks.serving import (
    FULL,
    SMALL,
    bare_decode_seconds,
    build_engine,
    profiled_idle,
    run_level,
    shared_prefix_workload,
    workload,
)
from spark_jax.serving.scheduler import rung
from spark_jax.serving.warmup import run_steps_again

BATCHES = ("padded", "ragged", "mixed")  # the prefill batches of ``--prefill-batches``


def main() -> None:
    profile_as_run()  # before jax starts its backend
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="*", default=[64])
    parser.add_argument("--slots", type=int, default=64, help="the engine's max_num_seqs")
    parser.add_argument("--requests", type=int, help="per level (default: the suite's count)")
    parser.add_argument("--no-profile", action="store_true", help="no profiled pass")
    parser.add_argument(
        "--prefill-batches",
        nargs="+",
        choices=BATCHES,
        default=["ragged"],
        help="[B, T] (padded), ragged, or ragged with the decode rows (mixed): an engine each",
    )
    parser.add_argument("--num-scheduler-steps", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--step-token-budgets",
        type=int,
        nargs="+",
        default=[0],
        help="the scheduler's max_num_batched_tokens (decode rows included; 0: none), each "
        "run on the same engine (no new programs: the budget only cuts the chunks)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        nargs="+",
        default=None,
        help="the engine's step budget in tokens: an engine each (default: the plan's)",
    )
    parser.add_argument(
        "--max-prefill-seqs",
        type=int,
        nargs="+",
        default=None,
        help="the most rows of one prefill batch: an engine each (default: the plan's)",
    )
    parser.add_argument(
        "--python-tracer",
        choices=("on", "off"),
        default="on",
        help="profiled passes trace the host's Python calls too (off: the idle of the engine, "
        "not of the traced host)",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="also the suite's shared-prefix workload, cache on: each step of a wave's "
        "admission timed, then the wave traced",
    )
    parser.add_argument(
        "--shared-first",
        action="store_true",
        help="the shared-prefix level on the fresh engine too, before the other levels",
    )
    parser.add_argument(
        "--rerun-warm-steps",
        action="store_true",
        help="every warm-up step run once more after warm-up (their CUDA graphs recorded)",
    )
    parser.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help="the page pool in pages (default: the plan's share of the device's memory)",
    )
    parser.add_argument("--tiny", action="store_true", help="the suite's tiny plan (any backend)")
    args = parser.parse_args()
    most = max(args.num_scheduler_steps)
    base = SMALL if args.tiny else FULL
    for batches in args.prefill_batches:
        for budget, seqs in itertools.product(
            args.max_batch_tokens or [base.max_batch_tokens],
            args.max_prefill_seqs or [base.max_prefill_seqs],
        ):
            plan = dataclasses.replace(
                base,
                engine_slots=args.slots,
                num_scheduler_steps=most,
                ragged_prefill=batches != "padded",
                mixed_batches=batches == "mixed",
                max_batch_tokens=budget,
                max_prefill_seqs=seqs,
                kv_pages=args.kv_pages,
            )
            engine, timings = build_engine(plan)
            name = f"{batches} prefill batches, {budget} tokens and {seqs} prompts a step"
            print(f"engine, {name}", json.dumps(timings), flush=True)
            if args.rerun_warm_steps:
                began = time.perf_counter()
                admitted = engine.scheduler.row_ladder[-1]
                run_steps_again(engine.executor, engine.prefill_shapes(), admitted)
                print(f"warm-up steps run again: {time.perf_counter() - began:.2f} s", flush=True)
            if args.shared_first:  # twice: are its slow waves its programs' first runs?
                shared_level(engine, plan, "fresh engine")
                shared_level(engine, plan, "fresh engine, again")
            run_levels(engine, plan, args)
            if args.shared:
                shared_timeline(engine, plan)
            del engine  # its page pool, before the next engine takes one of its own
            gc.collect()


def run_levels(engine: Any, plan: Any, args: argparse.Namespace) -> None:
    """Each level of ``args`` on ``engine``, once per steps-per-call setting."""
    # The suite's requests: the plan's whole draw, then the first ones (a draw of fewer gives
    # other output lengths: prompts and outputs come from one stream, in turn).
    drawn = workload(plan)
    keys = ("output_tok_s", "steady_output_tok_s", "tpot_s", "ttft_s", "engine_steps")
    keys += ("host_cpu_ms_per_step", "host_cpu_us_per_token")
    for c in args.concurrency:
        count = args.requests or min(plan.requests, max(32, 4 * c))  # the suite's rule
        requests = drawn[:count]
        width = rung(engine.executor.decode_widths, c)
        context = int(np.mean([len(p) + n / 2 for p, n in requests]))
        bare = bare_decode_seconds(engine, context, rows=width) * 1e3
        print(f"C={c}: bare decode step, {width} rows, ~{context} keys: {bare:.2f} ms", flush=True)
        for steps, budget in itertools.product(args.num_scheduler_steps, args.step_token_budgets):
            if budget and budget < c + plan.min_chunk:
                print(f"C={c}: step budget {budget} leaves no chunk beside {c} rows: skipped")
                continue
            engine.num_scheduler_steps = steps  # the chunk's programs are compiled for ``most``
            # Past the engine's check (room for a chunk beside every slot): a probe's budget
            # need only leave room beside this level's rows.
            engine.scheduler.max_num_batched_tokens = budget or None
            calls = engine.executor.num_multi_step_calls
            mixed = engine.executor.num_mixed_steps
            level = run_level(engine, requests, c)
            figures = {k: level.get(k) for k in keys}
            figures["multi_step_calls"] = engine.executor.num_multi_step_calls - calls
            figures["mixed_steps"] = engine.executor.num_mixed_steps - mixed
            name = f"C={c}, steps per call {steps}, step budget {budget or 'none'}"
            print(f"{name}:", json.dumps(figures, indent=1), flush=True)
            if not args.no_profile:
                idle = profiled_idle(engine, requests, c, args.python_tracer == "on")
                print(f"{name}, profiled:", json.dumps(idle, indent=1))


def shared_level(engine: Any, plan: Any, when: str) -> list[tuple[list[int], int]]:
    """The suite's shared-prefix level, cache on, as the suite runs it: its TTFT p50 and each
    request's TTFT in submission order, a wave (``shared_concurrency`` requests) a line.
    Returns the level's requests."""
    shared = shared_prefix_workload(plan)
    engine.num_scheduler_steps = plan.shared_num_scheduler_steps
    c = plan.shared_concurrency
    level = run_level(engine, shared, c, every_ttft=True)
    p50 = level["ttft_s"]["p50"] * 1e3
    print(f"shared prefix, cache on, {when}: TTFT p50 {p50:.2f} ms; waves:", flush=True)
    for i in range(0, len(level["ttft_ms"]), c):
        print("  ", level["ttft_ms"][i : i + c], flush=True)
    return shared


def shared_timeline(engine: Any, plan: Any, steps: int = 6) -> None:
    """Where a cached request's TTFT goes: the shared-prefix level once (it caches the
    prefix, as the suite's run does), then one wave of ``shared_concurrency`` requests
    submitted together, each of its first ``steps`` engine steps timed on the host (when
    the first tokens come out), then another wave under the profiler: the programs' runs on
    the device against the host's dispatches, and their kernels. Each wave is the level's
    requests with questions of their own (the prefix cached, not the questions: a wave that
    ran before would find its whole prompts cached)."""
    import spark_jax as sj

    shared = shared_level(engine, plan, "after the levels")
    c = plan.shared_concurrency
    params = sj.SamplingParams(temperature=0.0, max_tokens=plan.answer, ignore_eos=True)
    # The same prefix, questions not asked before.
    rng, system = np.random.default_rng(2), shared[0][0][: plan.shared_prefix]
    questions = rng.integers(0, plan.config.vocab_size, (2 * c, plan.question)).tolist()
    shared = [(system + q, plan.answer) for q in questions]
    start = time.perf_counter()
    waiting = {engine.add_request(p, params) for p, _ in shared[:c]}
    for i in range(steps):
        began = time.perf_counter()
        firsts = [out for out in engine.step() if out.request_id in waiting]
        waiting -= {out.request_id for out in firsts}
        ended = time.perf_counter()
        print(
            f"shared wave step {i}: from {1e3 * (began - start):.2f} ms, "
            f"{1e3 * (ended - began):.2f} ms, first tokens {len(firsts)}",
            flush=True,
        )
    while engine.has_unfinished():
        engine.step()
    # The host's Python untraced: its dispatches (``host_calls``) against the programs'
    # runs on the device (``program_runs``), in ms from the first kernel.
    wave = shared[c : 2 * c]
    trace = run_level(engine, wave, c, (0, steps), python_tracer=False, fresh_cache=False)
    print("shared wave, traced:", json.dumps(trace.get("device_idle"), indent=1))


if __name__ == "__main__":
    main()
