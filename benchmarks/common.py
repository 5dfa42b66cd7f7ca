"""Shared helpers of the GPU benchmarks: timing with device sync, floors, peers and output.

Every benchmark measures its two ceilings in the same run (``copy_bandwidth`` and
``matmul_rate``), times device work only after a sync (``median_seconds``, ``chain_seconds``,
``back_to_back_seconds``) or with CUDA events for torch peers (``torch_median_seconds``), and
ends with one JSON line (``emit``) and a short table (``print_table``). Nothing here imports
torch at module level: the torch peers run in their own process so JAX and torch never share
the GPU's memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

HBM_BYTES_PER_S = 4.3e12  # DESIGN.md: torch device copy on the H200, bytes read + written
State = TypeVar("State")


# ---------------------------------------------------------------------------------------------
# Timing (JAX).


def median_seconds(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn()`` with the device synced after every call."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain_seconds(
    step: Callable[[State], State], state: State, steps: int, repeats: int = 3, warmup: int = 2
) -> tuple[float, list[float], State]:
    """Seconds per step of ``state = step(state)`` dispatched back to back, one sync per repeat.

    Returns the median over repeats of (repeat time / steps), every repeat's figure and the
    final state (the steps may donate their input, so the caller must use the returned one).
    """
    for _ in range(warmup):
        state = step(state)
    jax.block_until_ready(state)
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state = step(state)
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step), per_step, state


def back_to_back_seconds(
    fn: Callable[[], Any], calls: int, repeats: int = 5, warmup: int = 1
) -> float:
    """Seconds per call of ``fn()`` dispatched back to back, without a chain's fixed cost (the
    first launch and the final sync, ~150 us on the H200: 17% of ten 90-us kernels): the
    median over repeats of (a chain of 2 x ``calls`` - a chain of ``calls``) / ``calls``. The
    device's time per call, as CUDA events time a torch peer."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    differences = []
    for _ in range(repeats):
        short, _, _ = chain_seconds(lambda _: fn(), None, calls, repeats=1, warmup=0)
        long, _, _ = chain_seconds(lambda _: fn(), None, 2 * calls, repeats=1, warmup=0)
        differences.append(2 * long - short)  # (2n long - n short) / n
    return statistics.median(differences)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of one call, synced: for compile and first-call times."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Ceilings measured in the run, and floors.


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s of an elementwise pass (bytes read + written)."""
    x = jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32)
    touch = jax.jit(lambda a: a * 1.0001)
    seconds = median_seconds(lambda: touch(x), iters=iters)
    return 2 * nbytes / seconds


def add_flash_prefill_flag(parser: argparse.ArgumentParser) -> None:
    """``--flash-prefill`` / ``--no-flash-prefill``: our flash kernel in the default prefill
    dispatch of the run or not (``spark_jax.ops.attention.FLASH_PREFILL_BY_DEFAULT``, on by
    default as in the library); the caller sets the flag from it."""
    parser.add_argument(
        "--flash-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="our flash kernel in the default prefill (attention.FLASH_PREFILL_BY_DEFAULT)",
    )


def read_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s of a read-only pass (a sum: nothing written back),
    the ceiling of a decode step, which reads weights and cache and writes almost nothing."""
    x = jax.random.normal(jax.random.key(3), (nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    seconds = median_seconds(lambda: total(x), iters=iters)
    return nbytes / seconds


def matmul_rate(n: int = 8192, iters: int = 10) -> float:
    """bf16 matrix product rate in FLOP/s on random [n, n] operands (fp32 accumulation)."""
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    seconds = median_seconds(lambda: product(a, b), iters=iters)
    return 2 * n**3 / seconds


def floor_seconds(nbytes: float, bytes_per_s: float = HBM_BYTES_PER_S) -> float:
    """The time to move ``nbytes`` once at the given bandwidth."""
    return nbytes / bytes_per_s


# ---------------------------------------------------------------------------------------------
# Timing (torch peers; imported lazily, run in a process of their own).


def torch_median_seconds(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median time of ``fn()`` measured with CUDA events (host clock + sync on a CPU torch)."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def kernel_profile(
    fn: Callable[[], Any], calls: int = 3, top: int = 25, per: int = 1, gaps: int = 0
) -> dict[str, Any]:
    """The GPU kernels of ``fn()`` (already compiled), from a JAX profiler trace of ``calls``
    calls, per call (per ``per``-th of one: a loop of ``per`` steps gives figures per step):
    summed time by kind (the name without its numbers), the ``top`` kernels by time, the
    kernel count, the summed kernel time (busy) and the span from the first kernel's start to
    the last one's end (span - busy = gaps between kernels, and between calls). ``gaps`` > 0
    adds where the GPU idles: the idle time in gaps of >= 20 us per call, and the ``gaps``
    longest, each with the kernels either side and its offset from the first kernel."""
    import glob
    import re
    import tempfile

    jax.block_until_ready(fn())
    folder = tempfile.mkdtemp(prefix="kernel_profile_")
    with jax.profiler.trace(folder):
        for _ in range(calls):
            jax.block_until_ready(fn())
    (path,) = glob.glob(f"{folder}/**/*.xplane.pb", recursive=True)
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    events += [(e.name, e.start_ns, e.duration_ns) for e in line.events]
    if not events:
        return {"error": "no GPU kernel events in the trace"}
    n = calls * per
    by_name: dict[str, float] = {}
    by_kind: dict[str, list[float]] = {}
    for name, _, ns in events:
        by_name[name] = by_name.get(name, 0.0) + ns / 1e3 / n
        kind = re.sub(r"(_\d+)+(?=_|$)|\.\d+", "", name)[:80]
        entry = by_kind.setdefault(kind, [0.0, 0.0])
        entry[0] += 1 / n
        entry[1] += ns / 1e3 / n
    start = min(e[1] for e in events)
    end = max(e[1] + e[2] for e in events)
    ranked = sorted(by_kind.items(), key=lambda item: -item[1][1])
    summary: dict[str, Any] = {}
    if gaps:
        idle, last_end, last_name = [], start, ""
        for name, begin, ns in sorted(events, key=lambda e: e[1]):
            if begin - last_end >= 20_000:
                idle.append(((begin - last_end) / 1e3, last_name[:50], name[:50], last_end))
            if begin + ns > last_end:
                last_end, last_name = begin + ns, name
        summary["idle_us_in_gaps"] = sum(g[0] for g in idle) / calls
        summary["idle_gaps"] = len(idle) / calls
        summary["longest_gaps"] = [
            [round(us, 1), after, before, round((at - start) / 1e6, 2)]
            for us, after, before, at in sorted(idle, key=lambda g: -g[0])[:gaps]
        ]
    return summary | {
        "kernels": len(events) / n,
        "busy_us": sum(e[2] for e in events) / 1e3 / n,
        "span_us": (end - start) / 1e3 / n,
        "by_kind_count_us": {k: [round(c, 1), round(us, 1)] for k, (c, us) in ranked},
        "top_kernels_us": {
            k[:100]: round(us, 2) for k, us in sorted(by_name.items(), key=lambda i: -i[1])[:top]
        },
    }


# ---------------------------------------------------------------------------------------------
# Output.


def out_dir() -> Path | None:
    """$OUT (the device run's result folder) when set."""
    out = os.environ.get("OUT")
    return Path(out) if out else None


def emit(results: dict[str, Any], name: str) -> None:
    """Prints ``results`` as one JSON line and writes it to $OUT/<name>.json when $OUT is set."""
    line = json.dumps(results, sort_keys=True, default=str)
    print(line, flush=True)
    out = out_dir()
    if out is not None:
        (out / f"{name}.json").write_text(line + "\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table; floats with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return "-" if value is None else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
