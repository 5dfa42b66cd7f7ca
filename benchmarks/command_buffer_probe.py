"""Probe (kept out of the suites): does a decode step whose arguments sit in new device buffers
cost the device time, through XLA updating the program's CUDA graph before its launch?

    PYTHONPATH=. python benchmarks/command_buffer_probe.py [--layers 8] [--rows 64]

Llama-3-8B shapes cut to ``--layers`` layers, the serving engine's own decode program at
``--rows`` rows over its paged cache, dispatched back to back (one sync per round):

- ``same``: the same token and activity arrays every step (the cache, donated, keeps its
  buffers): the graph is recorded once.
- ``fresh``: new token and activity arrays every step, as the engine's steps have (their
  inputs are uploaded or computed each step): XLA re-records the commands that read them.
- ``fresh_alternating``: the same, alternating two compilations of the program, so each
  graph is updated while the other one runs.
- ``fresh_in_place``: new values every step, written by a small program into the donated
  buffers of the last step's arrays, so the decode program sees the same addresses.

Per variant: seconds a step (device-bound chain: the device's time if the host keeps up) and
the host's median time inside one dispatch. If ``fresh`` is slower than ``same`` and the
alternation recovers it, the update waits for the graph's previous launch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from functools import partial

import jax
import numpy as np

from benchmarks.common import LLAMA3_8B, random_params
from spark_jax.models import decoder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--context", type=int, default=288)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    import spark_jax as sj
    from spark_jax.serving.executor import upload

    config = dataclasses.replace(LLAMA3_8B, num_layers=args.layers)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    model = sj.Model(config, random_params(config, dtype))
    engine = sj.Engine(model, max_num_seqs=args.rows, decode_widths=[args.rows], max_model_len=2048)
    ex, runner = engine.executor, engine.executor.runner
    page = ex.state.page_size
    used = -(-(args.context + 6 * args.steps + 1) // page)
    table = np.full((args.rows, ex.width_ladder[-1]), ex.num_pages, np.int32)
    table[:, :used] = np.arange(args.rows * used).reshape(args.rows, used)
    host_lengths = np.full((args.rows,), args.context, np.int32)
    state = ex.state.with_block_table(upload(table)).with_lengths(upload(host_lengths))
    host_tokens, host_active = np.zeros((args.rows,), np.int32), np.ones((args.rows,), bool)
    tokens, active = upload(host_tokens), upload(host_active)
    # A second compilation of the same program: its own executable, its own CUDA graph.
    twin = jax.jit(
        decoder.decode.__wrapped__,
        static_argnames=("config", "options", "with_hidden"),
        donate_argnames=("kv",),
    )
    programs = {"one": decoder.decode, "two": twin}

    @partial(jax.jit, donate_argnums=(0,), keep_unused=True)  # kept: its buffers are reused
    def refill(previous: tuple, packed: jax.Array) -> tuple:
        """New values in the donated buffers of the last step's inputs (same addresses)."""
        del previous
        return packed[: args.rows], packed[args.rows :].astype(bool)

    held = [upload(host_tokens), upload(host_active)]
    packed_host = np.concatenate([host_tokens, host_active.astype(np.int32)])

    def run(variant: str, state):
        fresh = variant != "same"
        order = ["one", "two"] if variant == "fresh_alternating" else ["one"]
        per_step, dispatch, addresses = [], [], set()
        for repeat in range(4):  # the first round warms up (compiles the twin)
            start = time.perf_counter()
            for i in range(args.steps):
                if variant == "fresh_in_place":
                    held[:] = refill(tuple(held), upload(packed_host))
                    t, a = held
                elif fresh:
                    t, a = upload(host_tokens), upload(host_active)
                else:
                    t, a = tokens, active
                addresses.add(t.unsafe_buffer_pointer())
                call = time.perf_counter()
                _, state = programs[order[i % len(order)]](
                    runner.params, runner.config, t, a, state, None, options=runner.options
                )
                dispatch.append(time.perf_counter() - call)
            jax.block_until_ready(state)
            if repeat:
                per_step.append((time.perf_counter() - start) / args.steps)
        return {
            "ms_per_step": statistics.median(per_step) * 1e3,
            "dispatch_ms_p50": statistics.median(dispatch[args.steps :]) * 1e3,
            "token_buffer_addresses": len(addresses),
        }, state.with_lengths(upload(host_lengths))  # the cache (lengths too) was donated

    results = {}
    for name in ("same", "fresh", "fresh_alternating", "fresh_in_place", "same_again"):
        results[name], state = run(name.removesuffix("_again"), state)
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps({"device": jax.devices()[0].device_kind, "layers": args.layers} | results))


if __name__ == "__main__":
    main()
