"""Probe (kept out of the suites): a scheduling policy's serving throughput predicted on the
CPU, before any device time is spent on it.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/schedule_replay_probe.py
        [--concurrency 64 256] [--step-token-budgets 0 256 384 512]
        [--decode-ms 1:5.80 64:6.90 256:12.92] [--token-ms 0.0235] [--launch-ms 1.5]
        [--weight-read-ms 5.3] [--call-ms 3.0]

Replays the serving suite's closed-loop levels (its requests, its engine's options: 256
slots, ragged mixed prefill batches, 4 decode steps a call) through the real engine and
scheduler over a tiny random model, records every device call the engine makes (its decode
rows, steps, prefill tokens after padding, riding rows), and prices each call with a cost
model of the 8B on the device:

- a decode call: its steps x the bare decode step at its width (``--decode-ms``, linear
  between the widths given; defaults: the suite's bare steps on an H100, 2026-12-07);
- a prefill call of N padded tokens: its GEMMs ``launch + N x token`` ms (``--token-ms``:
  25.82 ms for 1 024 positions on an H100, ``decode_step_probe.py``), at least the weight
  read; with riding decode rows it is bracketed by two forms: *optimistic*, the riding rows'
  decode step hides the prefill's GEMMs up to its own time; *pessimistic*, the riding rows'
  decode step plus every prefill GEMM millisecond past the weight read (``--weight-read-ms``);
- every call: ``--call-ms`` more (the host's work and the programs around the forward: the
  sampler's pick, the rows' updates). Its default is fitted to a measured A/B: without it
  the model put a 256-token cap at C=64 3.6-7.1% ahead of none, and an H100 measured them
  equal on a 64-slot engine (5 194 against 5 208 tok/s, 492 calls against 362); at
  ~3 ms a call the model puts them within 1.5% of each other, one form each way.

Each level under each ``--step-token-budgets`` cap (the scheduler's
``max_num_batched_tokens``, set on the same engine: 0 is none) prints its calls, prefill
calls, modeled seconds and tok/s in both forms, and the chain bound of the same model (the
longest client's steps at the bare step of the level's width). Tokens are the engine's own
(greedy, random weights): the output digest is the same under every cap. The model leaves
out what a call costs beyond ``--call-ms``, so compare caps with each other, not with a
measured figure.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np

from benchmarks.common import TINY_LLAMA
from benchmarks.serving import FULL, build_engine, chain_steps, run_level, workload
from spark_jax.serving.scheduler import rung


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Milliseconds of the 8B's device calls (see the module docstring)."""

    decode_ms: dict[int, float]  # width -> bare decode step
    token_ms: float
    launch_ms: float
    weight_read_ms: float
    call_ms: float

    def decode(self, width: int) -> float:
        widths = sorted(self.decode_ms)
        return float(np.interp(width, widths, [self.decode_ms[w] for w in widths]))

    def gemm(self, tokens: int) -> float:
        return max(self.weight_read_ms, self.launch_ms + tokens * self.token_ms)

    def prefill(self, tokens: int, riding_width: int) -> tuple[float, float]:
        """(optimistic, pessimistic) ms of a prefill call of ``tokens`` padded tokens, its
        decode rows riding at ``riding_width`` (0: none)."""
        if not riding_width:
            return self.gemm(tokens), self.gemm(tokens)
        step = self.decode(riding_width)
        optimistic = max(step, self.gemm(tokens))
        pessimistic = step + max(0.0, self.gemm(tokens) - self.gemm(riding_width))
        return optimistic, pessimistic


def record_calls(engine: Any) -> list[tuple[int, int, int, bool]]:
    """Wraps the engine's executor so each call it makes is logged as (decode rows, steps,
    padded prefill tokens (0: none), whether the decode rows ride in the prefill)."""
    executor, calls = engine.executor, []
    run = executor.run

    def logged(plan: Any, slots: Any, before_pick: Any = None) -> Any:
        riding = bool(plan.decode) and executor._rides(plan)
        tokens = plan.prefill_len if plan.prefill else 0
        calls.append((len(plan.decode), plan.num_steps, tokens, riding))
        return run(plan, slots, before_pick)

    executor.run = logged
    return calls


def price(calls: list[tuple[int, int, int, bool]], widths: list[int], model: CostModel) -> Any:
    """(optimistic, pessimistic) modeled seconds of ``calls``."""
    total = np.full(2, len(calls) * model.call_ms)
    for rows, steps, tokens, riding in calls:
        width = rung(widths, rows) if rows else 0
        if tokens:
            total += model.prefill(tokens, width if riding else 0)
            if rows and not riding:
                total += model.decode(width)
        elif rows:
            total += steps * model.decode(width)
    return total / 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--step-token-budgets", type=int, nargs="+", default=[0, 256, 384, 512])
    parser.add_argument("--decode-ms", nargs="+", default=["1:5.80", "64:6.90", "256:12.92"])
    parser.add_argument("--token-ms", type=float, default=0.0235)
    parser.add_argument("--launch-ms", type=float, default=1.5)
    parser.add_argument("--weight-read-ms", type=float, default=5.3)
    parser.add_argument("--call-ms", type=float, default=3.0)
    args = parser.parse_args()
    decode = {int(w): float(ms) for w, ms in (pair.split(":") for pair in args.decode_ms)}
    model = CostModel(decode, args.token_ms, args.launch_ms, args.weight_read_ms, args.call_ms)
    config = dataclasses.replace(TINY_LLAMA, max_position_embeddings=FULL.max_model_len)
    # The suite's engine and requests over the tiny model (fp32: the CPU has no bf16 dot).
    plan = dataclasses.replace(FULL, config=config, dtype="float32", gpu_memory_utilization=None)
    engine, timings = build_engine(plan)
    print("engine", timings, flush=True)
    calls, widths = record_calls(engine), engine.executor.decode_widths
    drawn = workload(plan)
    for c in args.concurrency:
        requests = drawn[: min(plan.requests, max(32, 4 * c))]  # the suite's count
        chain = chain_steps(requests, c) * model.decode(rung(widths, c)) / 1e3
        for budget in args.step_token_budgets:
            if budget and budget < c + plan.min_chunk:
                print(f"C={c}: step budget {budget} leaves no chunk beside {c} rows: skipped")
                continue
            engine.scheduler.max_num_batched_tokens = budget or None
            calls.clear()
            level = run_level(engine, requests, c)
            seconds, tokens = price(calls, widths, model), level["output_tokens"]
            prefills = sum(1 for call in calls if call[2])
            print(
                f"C={c}, step budget {budget or 'none'}: {len(calls)} calls, {prefills} "
                f"prefill; modeled {seconds[0]:.2f} / {seconds[1]:.2f} s, "
                f"{tokens / seconds[0]:.0f} / {tokens / seconds[1]:.0f} tok/s "
                f"(optimistic / pessimistic); chain bound {tokens / chain:.0f}; "
                f"digest {level['output_digest']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
