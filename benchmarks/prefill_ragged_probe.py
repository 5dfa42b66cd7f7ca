"""Probe (kept out of the suites): one prefill batch as the serving engine forms it, [B, T]
(each row padded to the longest's rung) against ragged (the rows' tokens one after another,
only their total padded; attention over ``rows`` rows as long as the batch), device-timed.

    PYTHONPATH=. python benchmarks/prefill_ragged_probe.py [--rows 4] [--tiny]

Each case is a batch of the serving suite's kind: prompt chunks of given lengths, appended to
empty cache rows as the engine appends (``continuing``: attention over the rows' cache). Prints
one JSON line per case: both programs' milliseconds, the positions each computes, and the
ragged program's time over the [B, T] one's.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np

from benchmarks.common import chain_seconds, random_params
from benchmarks.serving import FULL, SMALL
from spark_jax.serving.scheduler import pow2_ladder, ragged_ladder, rung

# (chunk lengths, [B, T] rows): rows of one batch as the suite's schedule makes them.
CASES = (
    ((150, 180, 220, 250), 4),  # four short prompts: (4, 256)
    ((300, 400), 2),  # two medium ones: (2, 512)
    ((90, 40), 2),  # two short ones: (2, 128) against a ragged 256 of 130 tokens
    ((1000,), 1),  # one long chunk: (1, 1024), ragged with its padding rows
    ((700, 300), 2),  # a long chunk's rest beside a new prompt: (2, 1024) has no room
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4, help="a ragged batch's rows")
    parser.add_argument("--tiny", action="store_true", help="the suite's tiny plan (any backend)")
    args = parser.parse_args()
    import spark_jax as sj

    plan = SMALL if args.tiny else FULL
    cap = plan.max_batch_tokens
    model = sj.Model(plan.config, random_params(plan.config, plan.dtype))
    runner = model.runner
    state = runner.init_state(args.rows, 2 * cap)
    slots = list(range(args.rows))
    rng = np.random.default_rng(0)
    for lengths, b in CASES:
        lengths = tuple(max(1, n * cap // 1024) for n in lengths)  # the tiny plan: scaled
        chunks = [rng.integers(0, plan.config.vocab_size, n).tolist() for n in lengths]
        t = rung(pow2_ladder(plan.min_chunk, 2 * cap), max(lengths))
        n = rung(ragged_ladder(plan.min_chunk, cap), sum(lengths))  # the engine's ladder
        padded = chunks + [[]] * (args.rows - len(chunks))

        def dense(st, chunks=chunks, b=b, t=t):
            st = st.with_lengths(jnp.zeros((args.rows,), jnp.int32))  # the step donates it
            return runner.prefill(st, slots[:b], chunks, continuing=True, min_len=t)[1]

        def ragged(st, padded=padded, n=n):
            st = st.with_lengths(jnp.zeros((args.rows,), jnp.int32))  # the step donates it
            return runner.prefill(st, slots, padded, continuing=True, min_len=n, ragged=True)[1]

        ms_dense, _, state = chain_seconds(dense, state, 5)
        ms_ragged, _, state = chain_seconds(ragged, state, 5)
        line = dict(lengths=lengths, dense_shape=(b, t), ragged_tokens=n, rows=args.rows)
        line |= dict(dense_ms=ms_dense * 1e3, ragged_ms=ms_ragged * 1e3)
        line |= dict(ragged_over_dense=ms_ragged / ms_dense)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
