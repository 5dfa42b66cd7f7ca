"""Probe (kept out of the suites): one serving level of ``benchmarks/serving.py`` with its
steps traced, to see what the host does while the device idles.

    PYTHONPATH=. python benchmarks/serving_profile_probe.py [--concurrency 64] [--slots 64]

Prints the bare decode step at the level's width and mean context (device-timed, the
engine's own program), the level's throughput, TPOT and host CPU per step, then
``device_idle``'s figures: the idle fraction over the traced steps, the kernels and programs
that take the time, and the Python functions the host was inside during the device's gaps.
With ``$OUT`` set the trace is kept there (``serving_trace.xplane.pb``) to be read again with
``serving.idle_of_trace``. Its throughput and TPOT count the profiler's start and stop (seconds):
take those from the suite, which profiles in a pass of its own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np

from benchmarks.serving import FULL, bare_decode_seconds, build_engine, run_level, workload
from spark_jax.serving.scheduler import rung


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--slots", type=int, default=64, help="the engine's max_num_seqs")
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--traced-steps", type=int, default=24)
    args = parser.parse_args()
    plan = dataclasses.replace(FULL, engine_slots=args.slots, requests=args.requests)
    engine, timings = build_engine(plan)
    print("engine", json.dumps(timings), flush=True)
    requests = workload(plan)[: args.requests]
    width = rung(engine.executor.decode_widths, args.concurrency)
    context = int(np.mean([len(p) + n / 2 for p, n in requests]))
    bare = bare_decode_seconds(engine, context, rows=width) * 1e3
    print(f"bare decode step, {width} rows, ~{context} keys: {bare:.2f} ms", flush=True)
    # Past the first admissions' prefills, before the queue runs dry.
    level = run_level(engine, requests, args.concurrency, (args.requests, args.traced_steps))
    level.pop("lengths", None)
    idle = level.pop("device_idle", {})
    keys = ("output_tok_s", "tpot_s", "ttft_s", "engine_steps", "host_cpu_ms_per_step")
    print(json.dumps({k: level.get(k) for k in keys}, indent=1))
    print(json.dumps(idle, indent=1))


if __name__ == "__main__":
    main()
