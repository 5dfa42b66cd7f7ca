"""Probe (kept out of the suites): the serving engine's decode step alone, at several widths
and attention choices, device-timed; then a profile of each choice's widest step.

    PYTHONPATH=. python benchmarks/decode_width_probe.py [--widths 64 128 256] [--context 275]
        [--implementations auto pallas xla] [--tiny]

Each choice builds the suite's engine (``benchmarks/serving.py``'s plan, its page pool sized
as the suite sizes it) over the same random weights, without its warm-up: only the decode
programs timed are compiled. Prints one JSON line per choice: the step's milliseconds per
width, and the kernels that took the widest step's time (summed over the profiled steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import glob
import json
import tempfile

import jax

from benchmarks.common import random_params
from benchmarks.serving import FULL, SMALL, bare_decode_seconds, idle_of_trace
from spark_jax.ops.options import KernelOptions


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--context", type=int, default=275, help="keys per row, mid-run")
    parser.add_argument("--implementations", nargs="+", default=["auto", "pallas", "xla"])
    parser.add_argument("--tiny", action="store_true", help="the suite's tiny plan (any backend)")
    args = parser.parse_args()
    import spark_jax as sj

    plan = SMALL if args.tiny else FULL
    plan = dataclasses.replace(plan, engine_slots=max(args.widths))
    params = random_params(plan.config, plan.dtype)
    for name in args.implementations:
        options = KernelOptions(implementation=None if name == "auto" else name)
        model = sj.Model(plan.config, params, options=options)
        engine = sj.Engine(model, **plan.engine_kwargs())
        ms = {w: bare_decode_seconds(engine, args.context, rows=w) * 1e3 for w in args.widths}
        with tempfile.TemporaryDirectory() as trace:
            with jax.profiler.trace(trace):
                bare_decode_seconds(engine, args.context, steps=4, rows=max(args.widths))
            paths = glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)
            kernels = idle_of_trace(paths[0]).get("top_kernels_ms") if paths else None
        print(json.dumps({"implementation": name, "step_ms": ms, "widest_kernels_ms": kernels}))
        del model, engine
        gc.collect()


if __name__ == "__main__":
    main()
