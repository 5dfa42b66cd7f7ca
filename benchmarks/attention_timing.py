"""How the timing method moves the prefill figures: one kernel, five clocks.

    PYTHONPATH=. python3 benchmarks/attention_timing.py    # on the H200, ~1 minute

For the prefill cases of ``benchmarks/attention.py`` (causal GQA 32/8, head dim 128, bf16)
and two implementations (our persistent flash kernel, the model's prefill, and cuDNN via
``jax.nn.dot_product_attention``), TFLOP/s from:

- ``chain10``: 10 calls back to back after one sync, the chain's launch and sync included
  (the attention benchmark's ``us`` until run e4 of BENCHMARKS.md),
- ``back_to_back``: chains of 5 and 10 calls, their difference (its ``us`` since run e7),
- ``chain40``: 40 calls back to back (a sustained burst, lower clocks),
- ``kernel``: the kernels' own durations in a JAX profiler trace of 20 calls (the profiler
  spaces the calls out),
- ``chain10_rested``: ``chain10`` again after 2 s idle,

against torch SDPA's best backend timed by CUDA events (22 calls, the median of the last 20)
in the same run. One JSON line, then a table.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import jax

from benchmarks.attention import FULL, implementations, inputs, torch_sdpa_in_subprocess
from benchmarks.common import (
    back_to_back_seconds,
    chain_seconds,
    emit,
    kernel_profile,
    print_table,
)

CASES = ("prefill_s8192", "prefill_s2048", "prefill_b1_s2048")
IMPLEMENTATIONS = ("pallas_ws2_k128_s2_pingpong_persistent", "cudnn")


def clocks(call) -> dict[str, float]:
    """Seconds per call of ``call`` by each method."""
    jax.block_until_ready(call())
    chained = partial(chain_seconds, lambda _: call(), None, repeats=3, warmup=1)
    seconds = {
        "chain10": chained(10)[0],
        "back_to_back": back_to_back_seconds(call, 5),
        "chain40": chained(40)[0],
        "kernel": kernel_profile(call, calls=20)["busy_us"] * 1e-6,
    }
    time.sleep(2)
    seconds["chain10_rested"] = chained(10)[0]
    return seconds


def main() -> None:
    torch = torch_sdpa_in_subprocess(list(CASES), 20)
    results: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rows = []
    for case in (c for c in FULL if c.name in CASES):
        q, k, v, lengths = inputs(case)
        every = implementations(case)
        entry: dict[str, Any] = {}
        for name in IMPLEMENTATIONS:
            call = partial(jax.jit(every[name]), q, k, v, lengths)
            entry[name] = {m: case.work() / s / 1e12 for m, s in clocks(call).items()}
            rows.append([case.name, name, *entry[name].values()])
        peer = torch.get(case.name, {}).get("best", {}).get("tflop_s")
        entry["torch_sdpa_best"] = peer
        rows.append([case.name, "torch_sdpa_best (CUDA events)", peer, "", "", "", ""])
        results[case.name] = entry
    emit(results, "attention_timing")
    methods = ["chain10", "back_to_back", "chain40", "kernel", "chain10_rested"]
    print_table(["case", "impl", *methods], rows)


if __name__ == "__main__":
    main()
