"""Probe (kept out of the suites): how long a prefill program leaves the device idle after
its call, with XLA's command buffers (one CUDA graph, updated and launched whole) and
without (each kernel launched as the host reaches it).

    PYTHONPATH=. python benchmarks/prefill_launch_probe.py [--rows 4] [--tokens 72] [--tiny]

The batch is a cached wave's: ``--rows`` questions of ``--tokens`` tokens each, appended to
rows that hold ``--cached`` tokens already, ragged, padded to the engine's ladder. Per
variant: the device's time a call (a chain of calls, one sync), the latency of one call
from an idle device to its result (median of ``--trials``), the host's time inside the call,
and latency minus device time: what the launch adds to a lone prefill's time to first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import chain_seconds, random_params
from benchmarks.serving import FULL, SMALL
from spark_jax.models import decoder
from spark_jax.serving.scheduler import ragged_ladder, rung

VARIANTS = {
    "command_buffers": None,  # XLA's default: the module-level program
    "no_command_buffers": {"xla_gpu_enable_command_buffer": ""},
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=72)
    parser.add_argument("--cached", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="the suite's tiny plan (any backend)")
    args = parser.parse_args()
    import spark_jax as sj

    plan = SMALL if args.tiny else FULL
    cached = min(args.cached, plan.max_model_len // 2)
    model = sj.Model(plan.config, random_params(plan.config, plan.dtype))
    runner = model.runner
    state = runner.init_state(args.rows, plan.max_model_len)
    slots = list(range(args.rows))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, plan.config.vocab_size, args.tokens).tolist()] * args.rows
    total = rung(ragged_ladder(plan.min_chunk, plan.max_batch_tokens), args.rows * args.tokens)
    statics = ("config", "fresh", "options", "with_hidden", "ragged")
    results = {"device": jax.devices()[0].device_kind, "tokens": args.rows * args.tokens}
    results["padded"] = total
    for name, compiler_options in VARIANTS.items():
        program = decoder.prefill
        if compiler_options is not None:
            program = jax.jit(
                decoder.prefill.__wrapped__,
                static_argnames=statics,
                donate_argnames=("kv",),
                compiler_options=compiler_options,
            )

        def call(st, program=program):
            # As if the rows held the cached prefix (new lengths: the call donates them).
            st = st.with_lengths(jnp.full((args.rows,), cached, jnp.int32))
            args_, kwargs = runner._prefill_args(
                st, slots, prompts, True, None, total, False, True, None, None
            )
            return program(*args_, **kwargs)

        try:
            device_s, _, state = chain_seconds(lambda st, call=call: call(st)[1], state, 5)
            latency, inside = [], []
            for _ in range(args.trials):
                jax.block_until_ready(state)
                begin = time.perf_counter()
                logits, state = call(state)
                returned = time.perf_counter()
                jax.block_until_ready(logits)
                latency.append(time.perf_counter() - begin)
                inside.append(returned - begin)
        except Exception as error:  # an option this XLA does not take: say so, go on
            results[name] = {"error": str(error)[:300]}
            print(name, json.dumps(results[name]), flush=True)
            state = runner.init_state(args.rows, plan.max_model_len)  # it may be donated
            continue
        results[name] = {
            "device_ms": device_s * 1e3,
            "latency_ms_p50": statistics.median(latency) * 1e3,
            "call_ms_p50": statistics.median(inside) * 1e3,
            "latency_over_device_ms": (statistics.median(latency) - device_s) * 1e3,
        }
        print(name, json.dumps(results[name]), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
