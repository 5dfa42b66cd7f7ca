"""Probe (kept out of the suites): the serving suite's engine under two prefill ladders, on one
warm engine, then a cached wave's steps and a short trace at C=64.

    PYTHONPATH=. python benchmarks/prefill_ladder_probe.py [--repeats 1] [--gather] [--tiny]

The engine is the suite's full plan with a ladder in steps of 64 tokens
(``sj.Engine(prefill_sizes=...)``), which holds every rung of the default (steps of 128), so
both ladders run on the same compiled programs: the scheduler's ladder is swapped between
levels. Per ladder and repeat: the shared-prefix level with the prefix cache and with its
lookups off (same engine: the comparison of the suite's 4c, not its two engines), each
cached request's TTFT in submission order, and the C=64 level (the suite's requests). The
ladders take turns (fine first on even repeats, the default first on odd ones). Every level
starts with an empty prefix cache (``run_level``): the first form of this probe ran the same
requests again with their prompts cached, which read as a faster engine. Then
``serving_profile_probe.shared_timeline`` (a wave's steps, traced) and 8 steps at C=64
traced without the Python tracer (the suite's decode steps per call: its item-5 setting; the
first form traced one step per call). ``--gather``: the model's prefills read the gathered
rows (``KernelOptions(paged_flash_prefill=False)``), else the pages in place.
With ``$OUT`` set, everything also goes to ``$OUT/prefill_ladder_probe.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from benchmarks.common import random_params, write_probe_json
from benchmarks.serving import FULL, SMALL, run_level, shared_prefix_workload, workload
from benchmarks.serving_profile_probe import shared_timeline
from spark_jax.ops.options import KernelOptions
from spark_jax.serving.scheduler import ragged_ladder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--gather", action="store_true", help="prefills over gathered rows")
    parser.add_argument("--tiny", action="store_true", help="the suite's tiny plan (any backend)")
    args = parser.parse_args()
    import spark_jax as sj

    base = SMALL if args.tiny else FULL
    top = base.max_batch_tokens
    fine = tuple(range(top // 8, top + 1, top // 16))
    plan = dataclasses.replace(base, prefill_sizes=fine)
    start = time.perf_counter()
    options = KernelOptions(paged_flash_prefill=not args.gather)
    model = sj.Model(plan.config, random_params(plan.config, plan.dtype), options=options)
    engine = sj.Engine(model, **plan.engine_kwargs())
    built = time.perf_counter()
    engine.warmup()
    out: dict = {"timings": {"init_s": built - start, "warmup_s": time.perf_counter() - built}}
    print("engine", json.dumps(out["timings"]), flush=True)
    ladders = {"fine": list(fine), "eighths": ragged_ladder(plan.min_chunk, top)}
    assert set(ladders["eighths"]) <= set(fine)  # the default's programs are all compiled
    shared = shared_prefix_workload(plan)
    c = plan.profile_concurrency
    requests = workload(plan)[: min(plan.requests, 4 * c)]
    chunks, pages = engine.scheduler.chunks, engine.scheduler.pages

    def level(*level_args, **kwargs) -> dict:
        got = run_level(engine, *level_args, **kwargs)
        got.pop("lengths", None)
        return got

    for rep in range(args.repeats):
        order = list(ladders) if rep % 2 == 0 else list(ladders)[::-1]
        for name in order:
            engine.scheduler.chunks = dataclasses.replace(chunks, chunk_ladder=ladders[name])
            engine.num_scheduler_steps = plan.shared_num_scheduler_steps
            on = level(shared, plan.shared_concurrency, every_ttft=True)
            pages.enable_prefix_caching = False
            off = level(shared, plan.shared_concurrency, every_ttft=True)
            pages.enable_prefix_caching = True
            engine.num_scheduler_steps = plan.num_scheduler_steps
            busy = level(requests, c)
            p50 = lambda x: x["ttft_s"]["p50"] * 1e3  # noqa: E731
            row = {
                "on_p50": p50(on),
                "off_p50": p50(off),
                "ratio": p50(off) / p50(on),
                "on_ttft_ms": on["ttft_ms"],
                f"c{c}_tok_s": busy["output_tok_s"],
                f"c{c}_steady": busy.get("steady_output_tok_s"),
                f"c{c}_tpot_p50_ms": busy["tpot_s"]["p50"] * 1e3,
            }
            print(rep, name, json.dumps(row), flush=True)
            out[f"{name}_{rep}"] = row
    engine.scheduler.chunks = dataclasses.replace(chunks, chunk_ladder=ladders["fine"])
    shared_timeline(engine, plan)
    engine.num_scheduler_steps = plan.num_scheduler_steps  # the suite's C=64 setting again
    traced = level(requests[: 2 * c], c, (c, 8), python_tracer=False)
    out[f"trace_c{c}"] = traced.get("device_idle")
    print(f"C={c} traced:", json.dumps(traced.get("device_idle"), indent=1), flush=True)
    write_probe_json(out, "prefill_ladder_probe")


if __name__ == "__main__":
    main()
