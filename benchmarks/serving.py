"""Serving throughput and latency of ``sj.Engine`` on Llama-3-8B shapes, against HF transformers
and a gpt-fast-style PyTorch peer, with the workload's roofline.

    python -m benchmarks serving           # on the H200 (several minutes)
    python -m benchmarks serving --tiny    # a tiny config on any backend, seconds

Workload: ``--requests`` (512) requests with random bf16 weights, greedy, EOS ignored (random
weights would stop at random places), lengths drawn once from a seeded ShareGPT-like
distribution: lognormal fits to the shape of the ShareGPT V3 conversations vLLM's
``benchmark_serving`` uses (long right tails, median well below the mean):

    prompt tokens ~ round(lognormal(mu=ln 128, sigma=1.0)), clipped to [4, 1024]  (mean ~210)
    output tokens ~ round(lognormal(mu=ln 128, sigma=0.9)), clipped to [4, 512]   (mean ~190)

Clients: closed loop at each concurrency C (1, 64, 128, 256): C requests are kept in flight, a
new one is submitted as one finishes, until ``min(requests, max(32, 4C))`` have finished (C=1
over all 512 would take most of an hour). One engine (256 slots, 16-token pages, max_model_len
2048, every shape compiled by ``warmup`` first) serves all levels; its decode step runs the
smallest width of its ladder (1, 2, 4, ... 256) that holds the decoding rows, 4 decode steps
per device call while nothing is admitted (``--num-scheduler-steps N``, vLLM's multi-step
scheduling; on an H100 with the suite's requests, 4 gave 13% more throughput at C=64 and 7%
at C=256 than 1, and a higher TTFT p50: an arrival waits for the call in flight;
``benchmarks/NOTES.md``).

Shared-prefix workload: every request is one 1,000-token system prompt, then a 64-token
question, and asks for 128 tokens, at concurrency 8; run once on that engine (prefix caching
on) and once on a second engine with it off (same shapes: nothing compiles again), both one
decode step per call (``Plan.shared_num_scheduler_steps``): a multi-step call in flight delays
every arrival, the uncached prefills' waves most, which would flatter the cache.

Every level starts with an empty prefix cache (``Engine.reset_prefix_cache``): the levels
share requests, and an earlier level's pages would prefill a later one's prompts for free.

Per level: output tokens/s (tokens of finished requests / wall time) and in the steady state
(every client's request in flight: from the first finish to the last submit; the whole run also
counts the drain, where fewer than C requests remain), TTFT (submit to first token) and TPOT
((finish - first token) / (tokens - 1)), p50 and p99; the host's CPU time per output token and
per engine step (the driving thread's: waits on the device take none); the workload's roofline:
the decode steps it needs (output tokens / C) each reading the weights once, every generated
token reading its context's keys and values once, at the read ceiling, plus its prompts' FLOPs
at the matmul rate, both ceilings measured in this run. The roofline assumes C requests in flight
throughout; the closed loop's own floor is its longest chain: each client's requests one after
another, a step for a prompt and one a token (``chain_steps``). Each level's TPOT is compared
with the bare decode step at its width and mean context (device-timed), and its throughput with
the chain's at that step (``chain_bound_tok_s``: every step as short as a bare decode step, no
prefill costing anything) and with the prompts' FLOPs at the matmul rate added
(``chain_prompts_tok_s``: what the loop can reach when a prompt's compute does not hide under
the decode's reads; riding decode rows hide a little of it, so it is a reference, not a
floor). At the profiled level (``--profile-concurrency``, default 64) a profile of 24 steps, in
a pass of its own after the level (the profiler stalls the engine), gives the device's idle
fraction (all gaps, and the gaps between programs: between steps), each program's device time
and what the host was inside.

Peers, each in a child process run first so torch and JAX never share GPU memory: HF
``LlamaForCausalLM`` (torch, bf16, sdpa) with ``generate`` over static batches of
``--hf-batch`` (64) requests (prompts left-padded to the batch's longest, every row
generating the batch's longest output), and a gpt-fast-style model (static KV cache,
``torch.compile(mode="reduce-overhead")``) over the same static batches. Their throughput
counts only the tokens each request asked for, so padding and rows kept running past their
own end are the cost of static batching they are. ``--tiny`` runs fp32 on the CPU.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import gc
import glob
import hashlib
import heapq
import inspect
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.common import (
    LLAMA3_8B,
    TINY_LLAMA,
    CompileCounter,
    Report,
    ceilings,
    chain_seconds,
    hf_llama_kwargs,
    kv_bytes_per_token,
    peer_in_subprocess,
    prefill_flops,
    random_params,
    ratio,
    torch_available,
    weight_bytes_per_step,
)
from spark_jax.config import ModelConfig
from spark_jax.serving.scheduler import rung


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    config: ModelConfig
    requests: int = 512
    concurrency: tuple[int, ...] = (1, 64, 128, 256)
    prompt_median: int = 128
    prompt_sigma: float = 1.0
    prompt_range: tuple[int, int] = (4, 1024)
    output_median: int = 128
    output_sigma: float = 0.9
    output_range: tuple[int, int] = (4, 512)
    max_model_len: int = 2048
    engine_slots: int = 256
    page_size: int = 16
    max_batch_tokens: int = 1024
    # Prompts a prefill batch: the engine's default. A wave of 8 cached requests then prefills
    # in one batch (the shared-prefix level's TTFT p50 25.4 ms on an H100, all 8 together,
    # against two batches of 4 at 18-20 and 26-28 ms); C=64 unchanged within noise.
    max_prefill_seqs: int = 8
    # The prefill ladder starts at 128 tokens: a short chunk (a question after a cached prefix,
    # a short prompt) pads to 128, not 256; each rung is a few more compiles of the 8B.
    min_chunk: int = 128
    min_decode_pages: int = 32
    # The engine's prefill ladder (None: its default, every 128 tokens here; ``--prefill-sizes``).
    # Steps of 64 would prefill a cached wave of 8 x 72 new tokens at 576, not 640.
    prefill_sizes: tuple[int, ...] | None = None
    num_scheduler_steps: int = 4  # decode steps per device call when a step only decodes
    shared_num_scheduler_steps: int = 1  # the same, for the shared-prefix TTFT comparison
    ragged_prefill: bool = True  # prefill batches ragged (``--prefill-batches``)
    mixed_batches: bool = True  # the decode rows ride in them (``--prefill-batches mixed``)
    # The page pool: this share of the device's memory (vLLM's default is 0.9). One row of
    # max_model_len per slot (the engine's default without it) is 69 GB at 256 slots: more
    # than an 80 GB H100 holds beside the weights.
    gpu_memory_utilization: float | None = 0.85
    # The page pool's size in pages, in place of the share above (None: the share). Where the
    # device reports no memory limit (XLA's GPU flag
    # --xla_gpu_command_buffer_update_mode=SKIP_TEMP), only this sizes the pool.
    kv_pages: int | None = None
    hf_batch: int = 64
    hf_requests: int = 128
    dtype: str = "bfloat16"
    shared_prefix: int = 1000  # the shared-prefix workload: system prompt, question, answer
    question: int = 64
    answer: int = 128
    shared_requests: int = 48
    shared_concurrency: int = 8
    profile_concurrency: int = 64  # the level whose steps are profiled (device idle time)
    http_concurrency: tuple[int, ...] = (1, 64)  # --http: levels driven through the server

    def http_requests(self, concurrency: int) -> int:
        """Requests of an HTTP comparison level (and of its direct twin)."""
        return min(self.requests, max(16, 2 * concurrency))

    def engine_kwargs(self) -> dict[str, Any]:
        """``sj.Engine`` keyword arguments of this plan's engine (those left None: left out,
        the engine's defaults)."""
        optional = {
            "gpu_memory_utilization": self.gpu_memory_utilization if not self.kv_pages else None,
            "kv_pages": self.kv_pages,
            "prefill_sizes": self.prefill_sizes,
        }
        return {k: v for k, v in optional.items() if v is not None} | dict(
            max_num_seqs=self.engine_slots,
            max_batch_tokens=self.max_batch_tokens,
            page_size=self.page_size,
            max_model_len=self.max_model_len,
            max_prefill_seqs=self.max_prefill_seqs,
            min_chunk=self.min_chunk,
            min_decode_pages=self.min_decode_pages,
            num_scheduler_steps=self.num_scheduler_steps,
            ragged_prefill=self.ragged_prefill,
            mixed_batches=self.mixed_batches,
        )


FULL = Plan(LLAMA3_8B)
SMALL = Plan(
    dataclasses.replace(TINY_LLAMA, max_position_embeddings=512),
    requests=24,
    concurrency=(1, 8),
    prompt_median=16,
    prompt_range=(2, 96),
    output_median=12,
    output_range=(2, 48),
    max_model_len=256,
    engine_slots=8,  # the highest level: fewer decode widths to warm up
    max_batch_tokens=128,
    max_prefill_seqs=4,
    min_chunk=16,
    min_decode_pages=8,
    hf_batch=8,
    hf_requests=8,
    dtype="float32",  # the CPU backend has no bf16 x bf16 -> f32 batched dot
    gpu_memory_utilization=None,  # the CPU reports no memory limit: a row per slot
    shared_prefix=100,
    question=8,
    answer=8,
    shared_requests=12,
    shared_concurrency=4,
    profile_concurrency=8,
    http_concurrency=(1, 8),
)


def workload(plan: Plan, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) per request, from the documented distribution."""
    rng = np.random.default_rng(seed)

    def lengths(median: int, sigma: float, bounds: tuple[int, int]) -> np.ndarray:
        raw = np.rint(rng.lognormal(math.log(median), sigma, plan.requests))
        return np.clip(raw, *bounds).astype(int)

    prompts = lengths(plan.prompt_median, plan.prompt_sigma, plan.prompt_range)
    outputs = lengths(plan.output_median, plan.output_sigma, plan.output_range)
    vocab = plan.config.vocab_size
    return [
        (rng.integers(0, vocab, int(p)).tolist(), int(o))
        for p, o in zip(prompts, outputs, strict=True)
    ]


def shared_prefix_workload(plan: Plan, seed: int = 1) -> list[tuple[list[int], int]]:
    """One system prompt for all, a question of its own each, a fixed answer length."""
    rng = np.random.default_rng(seed)
    vocab = plan.config.vocab_size
    system = rng.integers(0, vocab, plan.shared_prefix).tolist()
    return [
        (system + rng.integers(0, vocab, plan.question).tolist(), plan.answer)
        for _ in range(plan.shared_requests)
    ]


def roofline(
    plan: Plan, done: list[tuple[int, int]], concurrency: int, peaks: dict[str, float]
) -> dict[str, float]:
    """The least time the finished requests ((prompt, output) lengths) need at ``concurrency``:
    output / C decode steps each reading the weights once, every generated token reading its
    context's K/V once (read ceiling), and the prompts' FLOPs at the matmul rate."""
    c = plan.config
    outputs = sum(n for _, n in done)
    kv = kv_bytes_per_token(c) * sum(n * p + n * (n - 1) / 2 for p, n in done)
    decode_bytes = outputs / concurrency * weight_bytes_per_step(c) + kv
    flops = sum(prefill_flops(c, 1, p) for p, _ in done)
    seconds = decode_bytes / peaks["read_bytes_per_s"] + flops / peaks["matmul_flop_s"]
    return {"bytes": decode_bytes, "flops": flops, "seconds": seconds, "tok_s": outputs / seconds}


def chain_steps(requests: list[tuple[list[int], int]], concurrency: int) -> int:
    """The closed loop's floor in steps: every step as long as any other, each client takes
    the next queued request as its last one ends (a step for its prompt, then one a token),
    and the level ends with its longest chain. Its wall time is at least this many steps,
    whatever the device does between."""
    clients = [(0, i) for i in range(concurrency)]
    last = 0
    for _, output in requests:
        start, client = heapq.heappop(clients)
        last = max(last, start + 1 + output)
        heapq.heappush(clients, (start + 1 + output, client))
    return last


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


# ---------------------------------------------------------------------------------------------
# The engine.


def build_engine(plan: Plan, **options: Any) -> tuple[Any, dict[str, float]]:
    """``sj.Engine`` over a random model, every shape compiled by ``warmup``."""
    import spark_jax as sj

    start = time.perf_counter()
    model = sj.Model(plan.config, random_params(plan.config, plan.dtype))
    # A tree from before multi-step decode (``--against``) runs one step per call.
    taken = inspect.signature(sj.Engine).parameters
    kwargs = {k: v for k, v in plan.engine_kwargs().items() if k in taken}
    engine = sj.Engine(model, **kwargs, **options)
    built = time.perf_counter()
    engine.warmup()
    return engine, {"init_s": built - start, "warmup_s": time.perf_counter() - built}


def bare_decode_seconds(engine: Any, context: int, steps: int = 40, rows: int = 1) -> float:
    """The device's time for one decode step of ``rows`` rows (a width of the engine's ladder)
    around ``context`` keys each (the engine's own program), dispatched back to back: what a
    step costs with no serving around it. Each step adds a key, so the run starts half its
    steps before ``context``. Run while the engine is idle: it writes into pages nobody holds."""
    from spark_jax.serving.executor import commit

    ex = engine.executor
    page, total = ex.state.page_size, steps * 5  # chain_seconds: 2 warm-up + 3 timed rounds
    start = max(1, context - total // 2)
    table = np.full((rows, ex.width_ladder[-1]), ex.num_pages, np.int32)
    used = min(table.shape[1], -(-(start + total + 1) // page))
    if rows * used > ex.num_pages:
        raise ValueError(f"{rows} rows of {used} pages do not fit the pool's {ex.num_pages}")
    table[:, :used] = np.arange(rows * used).reshape(rows, used)
    # Committed, as the engine's inputs are (a jitted program's cache key tells them apart).
    tokens, active, lengths, table = commit(
        (
            np.zeros((rows,), np.int32),
            np.ones((rows,), bool),
            np.full((rows,), start, np.int32),
            table,
        )
    )
    state = ex.state.with_block_table(table).with_lengths(lengths)

    # The engine's own program (its inputs handed back, donated): a program of its own would
    # compile here, and on the GPU every compile drops the command buffers (CUDA graphs) XLA
    # recorded for the engine's programs, to be recorded again on their next runs.
    def step(carry: Any) -> Any:
        (tok, act), _, st = ex.runner.decode(carry[2], *carry[:2], returning_inputs=True)
        return tok, act, st

    seconds, _, (_, _, ex.state) = chain_seconds(step, (tokens, active, state), steps)
    return seconds


def run_level(
    engine: Any,
    requests: list[tuple[list[int], int]],
    concurrency: int,
    profile_steps: tuple[int, int] | None = None,
    python_tracer: bool = True,
    every_ttft: bool = False,
    fresh_cache: bool = True,
) -> dict:
    """Closed-loop clients: ``concurrency`` requests in flight until all have finished.
    ``profile_steps`` (first, count): those engine steps are traced (``device_idle``), the
    host's Python calls too if ``python_tracer``. ``every_ttft``: each request's TTFT too, in
    submission order (``ttft_ms``: where a percentile falls, wave by wave).

    ``fresh_cache`` (the default): the level starts with an empty prefix cache, as on a
    fresh engine: the levels share requests (C=64's are C=256's first half), and pages an
    earlier level left would prefill them for free (an older tree without
    ``reset_prefix_cache``: as it ran there)."""
    import spark_jax as sj

    if fresh_cache:
        empty_prefix_cache(engine)
    queue = list(requests)
    inflight: dict[int, dict[str, float]] = {}
    done: list[dict[str, float]] = []
    emitted: list[tuple[float, int]] = []  # (time, tokens) of each step's outputs
    trace_dir, steps, host_cpu = None, 0, 0.0
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            prompt, n = queue.pop(0)
            params = sj.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            record = {"submit": time.perf_counter(), "prompt": len(prompt)}
            inflight[engine.add_request(prompt, params)] = record
        if profile_steps and steps == profile_steps[0]:
            trace_dir = tempfile.mkdtemp()
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = int(python_tracer)
            jax.profiler.start_trace(trace_dir, profiler_options=options)
        cpu = time.thread_time()  # the host's own work: waits on the device take no CPU
        outputs = engine.step()
        host_cpu += time.thread_time() - cpu
        steps += 1
        if trace_dir and steps == profile_steps[0] + profile_steps[1]:
            jax.profiler.stop_trace()
        emitted.append((time.perf_counter(), sum(len(out.new_token_ids) for out in outputs)))
        for out in outputs:
            now = time.perf_counter()
            record = inflight[out.request_id]
            record.setdefault("first", now)
            if out.finished:
                record["end"], record["tokens"] = now, len(out.result.output_tokens)
                record["output"] = out.result.output_tokens
                done.append(inflight.pop(out.request_id))
    if trace_dir and steps < profile_steps[0] + profile_steps[1]:
        jax.profiler.stop_trace()  # the level ended first: its figures stay out (below)
    level = summary(done, time.perf_counter() - start, concurrency)
    if every_ttft:
        ordered = sorted(done, key=lambda r: r["submit"])
        level["ttft_ms"] = [round((r["first"] - r["submit"]) * 1e3, 2) for r in ordered]
    level |= steady_state(emitted, done)
    level["output_digest"] = output_digest(done)
    level["engine_steps"] = steps
    level["host_cpu_ms_per_step"] = host_cpu / steps * 1e3
    level["host_cpu_us_per_token"] = host_cpu / level["output_tokens"] * 1e6
    if trace_dir and steps >= profile_steps[0] + profile_steps[1]:
        level["device_idle"] = device_idle(trace_dir)
    return level


def empty_prefix_cache(engine: Any) -> None:
    """Empties the engine's prefix cache before a level (an older tree's engine, without
    ``reset_prefix_cache``, runs as it did there)."""
    if hasattr(engine, "reset_prefix_cache"):
        engine.reset_prefix_cache()


def output_digest(done: list[dict[str, Any]]) -> str:
    """A hash of every request's output tokens in submission order: two runs of a level (two
    trees, two XLA settings) that print the same digest gave the same tokens."""
    h = hashlib.blake2b(digest_size=8)
    for record in sorted(done, key=lambda r: r["submit"]):
        h.update(np.asarray(record["output"], np.int64).tobytes())
    return h.hexdigest()


def summary(done: list[dict[str, float]], wall: float, concurrency: int) -> dict[str, Any]:
    """A level's figures from its finished requests' records (submit, first, end, tokens,
    prompt) and its wall time."""
    ttft = [r["first"] - r["submit"] for r in done]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in done)
    return {
        "concurrency": concurrency,
        "requests": len(done),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "ttft_s": percentiles(ttft),
        "tpot_s": percentiles(tpot),
        "lengths": [(int(r["prompt"]), int(r["tokens"])) for r in done],
        "mean_context": float(np.mean([r["prompt"] + r["tokens"] / 2 for r in done])),
    }


def profiled_idle(
    engine: Any,
    requests: list[tuple[list[int], int]],
    concurrency: int,
    python_tracer: bool = False,
) -> dict:
    """``device_idle`` of 24 steady-state steps (past the first admissions' prefills, before
    the queue runs dry) of a pass of its own over the level's first ``2C`` requests. Its own
    pass, because the profiler stalls the engine: stopping it writes the trace (0.7 s on the
    CPU for a few tiny steps; the GPU's 24 steps were over 16 MB) and the python tracer slows
    the host while it runs. Inside the measured level it put a 94 ms TPOT p99 beside a 12 ms
    p50 at C=64 on an H100 (C=256, unprofiled: 54 and 45).

    ``python_tracer``: the host's Python calls are traced too (``host_during_idle_ms``: what
    the host did while the device waited). Off, the idle measures the engine, not the tracer:
    tracing every call slows the host, and a host-paced step's gaps with it."""
    traced = run_level(
        engine, requests[: 2 * concurrency], concurrency, (concurrency, 24), python_tracer
    )
    return traced.get("device_idle", {"error": "the pass ended before the traced steps"})


def steady_state(emitted: list[tuple[float, int]], done: list[dict[str, float]]) -> dict:
    """Output tokens/s while every client has a request in flight: from the first finish
    (before it, all requests started together and their prefills bunch) to the last submit
    (after it, the queue is dry and the level drains at falling concurrency). On an H100 the
    whole run read 21% below the steady state at C=64 over 256 of the workload's requests
    (4 415 against 5 595 tok/s) and 2% at C=256 (``benchmarks/NOTES.md``). ``emitted``:
    (time, tokens) per engine step; ``done``: the finished requests' records. Empty when
    there is no such window (every request was submitted at the start)."""
    first_finish = min(r["end"] for r in done)
    last_submit = max(r["submit"] for r in done)
    if last_submit <= first_finish:
        return {}
    tokens = sum(n for t, n in emitted if first_finish < t <= last_submit)
    window = last_submit - first_finish
    return {"steady_window_s": window, "steady_output_tok_s": tokens / window}


def http_levels(engine: Any, plan: Plan, requests: list, report: Report) -> list[list[Any]]:
    """The same requests at each ``plan.http_concurrency`` level, directly and then through
    the HTTP server over the same engine; the table's rows."""
    from benchmarks.http_driver import run_http_level
    from spark_jax.serving.server import RunningServer, ServerOptions, build_app

    direct = {}
    for c in plan.http_concurrency:
        direct[c] = run_level(engine, requests[: plan.http_requests(c)], c)
    server = RunningServer(build_app(engine, ServerOptions("bench"))).start()
    try:
        rows = []
        for c in plan.http_concurrency:
            empty_prefix_cache(engine)  # its direct twin's pages would prefill it for free
            done, wall = run_http_level(server.url, "bench", requests[: plan.http_requests(c)], c)
            http, own = summary(done, wall, c), direct[c]
            for level in (http, own):
                level.pop("lengths")
            report.details[f"http_c{c}"] = {"http": http, "direct": own}
            report.figures[f"http_c{c}_tok_s"] = http["output_tok_s"]
            report.ratios[f"http_c{c}_over_direct"] = ratio(
                http["output_tok_s"], own["output_tok_s"]
            )
            added = (http["ttft_s"]["p50"] - own["ttft_s"]["p50"]) * 1e3
            report.figures[f"http_c{c}_ttft_added_ms"] = added
            progress(f"HTTP C={c}", http)
            rows.append([f"HTTP {c}", http["output_tok_s"], own["output_tok_s"], added])
        return rows
    finally:
        server.stop()


def device_idle(trace_dir: str) -> dict[str, Any]:
    """The device's idle time inside a trace: the gaps between its kernels on every stream,
    merged, over the span from the first kernel to the last; and what the host's Python
    thread was inside during those gaps (``host_during_idle_ms``: each traced function's
    time overlapping a gap, nested calls counted in each of their callers). With ``$OUT`` set
    the trace is kept there (``serving_trace.xplane.pb``) to be read again off the device."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        return {"error": "no trace written"}
    if os.environ.get("OUT"):
        shutil.copy(paths[0], os.path.join(os.environ["OUT"], "serving_trace.xplane.pb"))
    return idle_of_trace(paths[0])


def merged_gaps(
    spans: list[tuple[int, int, str]],
) -> tuple[float, list[tuple[int, int]], list[tuple[int, int, str, str]]]:
    """Kernels (start, end, program) of every stream merged: (the time some kernel runs, the
    gaps between, the gaps between two programs' kernels with the programs: (start, end,
    before, after)). A gap between the program whose kernel ended last before it and another's
    after it is the device waiting for the host between steps; one inside a program is
    between its kernels (launch gaps, which tracing every kernel lengthens)."""
    spans = sorted(spans)
    gaps, busy, between = [], 0.0, []
    lo, hi, last = spans[0]
    for a, b, program in spans[1:]:
        if a > hi:
            busy += hi - lo
            gaps.append((hi, a))
            if program != last:
                between.append((hi, a, last, program))
            lo = a
        if b >= hi:
            hi, last = b, program
    return busy + hi - lo, gaps, between


def device_kernels(data: Any) -> list[tuple[int, int, str, str]]:
    """Every kernel on a device stream of a trace (``jax.profiler.ProfileData``): (start,
    end, kernel name, the program that ran it), in ns."""
    return [
        (
            e.start_ns,
            e.start_ns + e.duration_ns,
            e.name,
            str(dict(e.stats).get("hlo_module", "(no program)")),
        )
        for plane in data.planes
        if plane.name.startswith("/device:")
        for line in plane.lines
        if line.name.startswith("Stream")
        for e in line.events
    ]


def idle_of_trace(path: str) -> dict[str, Any]:
    """``device_idle``'s figures from one ``.xplane.pb`` file."""
    data = jax.profiler.ProfileData.from_file(path)
    spans, by_name, host = [], collections.Counter(), []
    modules = collections.Counter()  # kernel time by the program that ran the kernel
    kernels = collections.defaultdict(collections.Counter)  # program -> kernel -> time
    host_lines = collections.Counter()  # the host threads traced: events each
    for start, end, name, program in device_kernels(data):
        spans.append((start, end, program))
        by_name[name[:80]] += end - start
        modules[program[:80]] += end - start
        kernels[program[:80]][name[:60]] += end - start
    for plane in data.planes:
        for line in plane.lines:
            if plane.name == "/host:CPU":
                events = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events]
                host_lines[line.name] += len(events)
                if line.name.startswith("python"):  # the driving thread (python, python3)
                    host.extend(events)
    if not spans:
        return {"error": "no device events in the trace (a CPU backend)"}
    busy, gaps, between = merged_gaps(spans)
    total = max(b for _, b, _ in spans) - min(a for a, _, _ in spans)
    changes = collections.Counter()  # the idle between programs by (before, after)
    for a, b, before, after in between:
        changes[f"{before[:40]} -> {after[:40]}"] += b - a
    top = {name: ns / 1e6 for name, ns in by_name.most_common(12)}  # where the time goes
    origin = min(a for a, _, _ in spans)
    runs = program_runs(spans, origin)
    short = {}  # a short trace (a wave's steps): the programs' runs and the host's dispatches
    if len(runs) <= 64:
        calls = [
            (name, round((a - origin) / 1e6, 3), round((b - a) / 1e6, 3))
            for a, b, name in sorted(host)
            if name.startswith("PjitFunction")
        ]
        short = {"program_runs": runs, "host_calls": calls}
    host_total = collections.Counter()  # whatever the device did meanwhile
    for start, end, name in host:
        host_total[name[:100]] += end - start
    during = _host_during(host, gaps)
    during_between = _host_during(host, [(a, b) for a, b, _, _ in between])
    return {
        "span_ms": total / 1e6,
        "busy_ms": busy / 1e6,
        "idle_fraction": 1 - busy / total,
        "idle_between_programs_fraction": sum(b - a for a, b, _, _ in between) / total,
        "between_programs_ms": {n: ns / 1e6 for n, ns in changes.most_common(12)},
        "gaps": len(gaps),
        "gaps_over_100us": sum(b - a > 100_000 for a, b in gaps),
        "top_kernels_ms": top,
        "programs_ms": {n: ns / 1e6 for n, ns in modules.most_common(12)},
        # Inside the programs that take the most time: their kernels that do.
        "kernels_by_program_ms": {
            program: {name: ns / 1e6 for name, ns in kernels[program].most_common(8)}
            for program, _ in modules.most_common(3)
        },
        "host_during_idle_ms": {n: ns / 1e6 for n, ns in during.most_common(40)},
        "host_between_programs_ms": {n: ns / 1e6 for n, ns in during_between.most_common(20)},
        # A host function long here but short above waited on the device (a blocking read,
        # or a donated buffer that a queued program still reads).
        "host_total_ms": {n: ns / 1e6 for n, ns in host_total.most_common(40)},
        "host_lines": dict(host_lines.most_common(12)),
    } | short


def program_runs(spans: list[tuple[int, int, str]], origin: int) -> list[tuple[str, float, float]]:
    """The programs in the order they ran, each run of one program's kernels as (program,
    its first kernel's start, its last kernel's end), in ms from ``origin``."""
    runs: list[list] = []
    for a, b, program in sorted(spans):
        if runs and runs[-1][0] == program:
            runs[-1][2] = max(runs[-1][2], b)
        else:
            runs.append([program, a, b])
    return [(p, round((a - origin) / 1e6, 3), round((b - origin) / 1e6, 3)) for p, a, b in runs]


def _host_during(
    host: list[tuple[int, int, str]], gaps: list[tuple[int, int]]
) -> collections.Counter:
    """Each host function's time overlapping ``gaps`` (sorted, disjoint), nested calls
    counted in each of their callers."""
    during, starts = collections.Counter(), [a for a, _ in gaps]
    for start, end, name in host:
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        while i < len(gaps) and gaps[i][0] < end:
            a, b = gaps[i]
            if start < b:
                during[name[:100]] += min(b, end) - max(a, start)
            i += 1
    return during


# ---------------------------------------------------------------------------------------------
# The HF peer (its own process).


def peer(tiny: bool, arg: str = "") -> dict[str, Any]:
    """HF ``generate`` over static batches: left padding, every row to the batch's longest."""
    plan = SMALL if tiny else FULL
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = plan.config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    hf_config = LlamaConfig(
        **hf_llama_kwargs(
            c,
            max_position_embeddings=plan.max_model_len,
            pad_token_id=0,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config).eval()
    model.set_attn_implementation("sdpa")
    requests = workload(plan)[: plan.hf_requests]
    useful, start = 0, None
    for first in range(0, len(requests), plan.hf_batch):
        batch = requests[first : first + plan.hf_batch]
        width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        if start is None:  # one untimed batch first: CUDA kernels and allocator warm-up
            _hf_generate(model, ids[:, :8], mask[:, :8], 4, device)
            start = time.perf_counter()
        _hf_generate(model, ids, mask, new, device)
        useful += sum(n for _, n in batch)
    wall = time.perf_counter() - (start or time.perf_counter())
    return {
        "device": device,
        "batch": plan.hf_batch,
        "requests": len(requests),
        "useful_output_tokens": useful,
        "wall_s": wall,
        "output_tok_s": useful / wall,
    }


def peer_from_file(path: str) -> dict[str, Any]:
    """A peer's JSON written earlier by its ``--peer-json`` run, with where and when it was
    written; ``{"error": ...}`` when there is none."""
    if not os.path.isfile(path):
        return {"error": f"no peer results at {path}: run the peer with --peer-json there first"}
    written = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(os.path.getmtime(path)))
    return json.loads(Path(path).read_text()) | {"read_from": f"{path}, written {written} UTC"}


def _hf_generate(model: Any, ids: Any, mask: Any, new: int, device: str) -> None:
    import torch

    with torch.inference_mode():
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    if device == "cuda":
        torch.cuda.synchronize()


def progress(name: str, level: dict[str, Any]) -> None:
    """One line per finished level on stderr, so a run cut short still tells what it got."""
    keys = ("output_tok_s", "ttft_s", "tpot_s", "host_cpu_us_per_token", "roofline")
    keys += ("output_digest", "device_idle")
    print(name, json.dumps({k: level[k] for k in keys if k in level}), file=sys.stderr)


def run(
    tiny: bool,
    peer: bool = True,
    http: bool = False,
    peers_from: str | None = None,
    **overrides: Any,
) -> Report:
    """The suite; ``overrides`` replace plan fields (``concurrency``, ``requests``), and a
    level then finishes ``requests`` requests whatever its concurrency. ``http``: only the
    comparison of the engine driven directly and through the HTTP server (C=1 and 64).
    ``peers_from``: a folder holding the peers' JSON (``<name>.json``, each written by the
    peer's ``--peer-json`` run on this device just before), read in place of running them:
    the peers and the engine then fit two device calls where one would run past its limit."""
    plan = dataclasses.replace(SMALL if tiny else FULL, **overrides)
    if http:
        return run_http(plan)
    per_level = (lambda c: plan.requests) if "requests" in overrides else None
    report = Report()
    peers = {
        "hf_static_batches": ("serving", ""),
        "gpt_fast_static_batches": ("gpt_fast", "serving"),
    }
    peer_results = {}
    for name, (suite, arg) in peers.items():
        if not peer:
            peer_results[name] = {"error": "left out (--no-peer)"}
        elif peers_from:
            peer_results[name] = peer_from_file(os.path.join(peers_from, f"{name}.json"))
            report.notes.append(f"{name} peer read from {peer_results[name].get('read_from')}")
        elif not torch_available():
            peer_results[name] = {"error": "torch/transformers not installed"}
        else:
            peer_results[name] = peer_in_subprocess(suite, tiny, timeout_s=1800, arg=arg)
        tok_s = peer_results[name].get("output_tok_s")
        if tok_s:
            report.peers[f"{name}_tok_s"] = tok_s
        else:
            report.notes.append(f"{name} peer: {peer_results[name].get('error', '')[-300:]}")
    peaks = ceilings(tiny)
    report.peers |= peaks
    engine, timings = build_engine(plan)
    report.details |= timings
    print("engine", json.dumps(timings), file=sys.stderr)
    built = CompileCounter().start()  # the engine's and the suite's own, until the second engine
    requests = workload(plan)
    counts = {
        c: per_level(c) if per_level else min(plan.requests, max(32, 4 * c))
        for c in plan.concurrency
    }
    for c in sorted(counts):
        # The bare step at the width and mean context the level will see, while idle: C=1's
        # TPOT target, and at every level what its steps cost with no serving around.
        mean_context = np.mean([len(p) + n / 2 for p, n in requests[: counts[c]]])
        width = rung(engine.executor.decode_widths, c)
        ms = bare_decode_seconds(engine, int(mean_context), rows=width) * 1e3
        report.peers[f"bare_decode_bs{c}_ms"] = ms
        print(f"bare decode bs={c} ms", ms, file=sys.stderr)
    hf_tok_s = report.peers.get("hf_static_batches_tok_s")
    gpt_tok_s = report.peers.get("gpt_fast_static_batches_tok_s")
    table = [
        [
            "C",
            "tok/s",
            "steady tok/s",
            "roofline",
            "chain bound",
            "chain + prompts",
            "x HF",
            "x gpt-fast",
            "TTFT p50 ms",
            "TPOT p50 ms",
            "TPOT p99 ms",
        ]
    ]
    for c in plan.concurrency:
        level = run_level(engine, requests[: counts[c]], c)
        level["roofline"] = roofline(plan, level.pop("lengths"), c, peaks)
        level["chain_steps"] = chain_steps(requests[: counts[c]], c)
        bare_s = report.peers[f"bare_decode_bs{c}_ms"] / 1e3
        level["chain_bound_tok_s"] = level["output_tokens"] / (level["chain_steps"] * bare_s)
        report.peers[f"c{c}_chain_bound_tok_s"] = level["chain_bound_tok_s"]
        report.ratios[f"c{c}_of_chain_bound"] = ratio(
            level["output_tok_s"], level["chain_bound_tok_s"]
        )
        prompts_s = level["roofline"]["flops"] / peaks["matmul_flop_s"]
        level["chain_prompts_tok_s"] = level["output_tokens"] / (
            level["chain_steps"] * bare_s + prompts_s
        )
        report.peers[f"c{c}_chain_prompts_tok_s"] = level["chain_prompts_tok_s"]
        report.ratios[f"c{c}_of_chain_prompts"] = ratio(
            level["output_tok_s"], level["chain_prompts_tok_s"]
        )
        if c == plan.profile_concurrency:
            level["device_idle"] = profiled_idle(engine, requests, c)
        report.details[f"c{c}"] = level
        progress(f"C={c}", level)
        report.figures[f"c{c}_tok_s"] = level["output_tok_s"]
        if "steady_output_tok_s" in level:
            report.figures[f"c{c}_steady_tok_s"] = level["steady_output_tok_s"]
            report.ratios[f"c{c}_steady_of_roofline"] = ratio(
                level["steady_output_tok_s"], level["roofline"]["tok_s"]
            )
        report.figures[f"c{c}_tpot_p50_ms"] = level["tpot_s"]["p50"] * 1e3
        report.figures[f"c{c}_host_cpu_us_per_token"] = level["host_cpu_us_per_token"]
        report.peers[f"c{c}_roofline_tok_s"] = level["roofline"]["tok_s"]
        report.ratios[f"c{c}_of_roofline"] = ratio(
            level["output_tok_s"], level["roofline"]["tok_s"]
        )
        report.ratios[f"c{c}_over_hf"] = ratio(level["output_tok_s"], hf_tok_s)
        report.ratios[f"c{c}_over_gpt_fast"] = ratio(level["output_tok_s"], gpt_tok_s)
        idle = level.get("device_idle", {})
        if "idle_fraction" in idle:
            report.figures[f"c{c}_device_idle_fraction"] = idle["idle_fraction"]
            between = idle["idle_between_programs_fraction"]
            report.figures[f"c{c}_device_idle_between_programs_fraction"] = between
        table.append(
            [
                c,
                level["output_tok_s"],
                level.get("steady_output_tok_s", ""),
                level["roofline"]["tok_s"],
                level["chain_bound_tok_s"],
                level["chain_prompts_tok_s"],
                report.ratios[f"c{c}_over_hf"],
                report.ratios[f"c{c}_over_gpt_fast"],
                level["ttft_s"]["p50"] * 1e3,
                level["tpot_s"]["p50"] * 1e3,
                level["tpot_s"]["p99"] * 1e3,
            ]
        )
    c = plan.profile_concurrency
    if f"bare_decode_bs{c}_ms" in report.peers and f"c{c}_tpot_p50_ms" in report.figures:
        report.ratios[f"bare_step_over_c{c}_tpot"] = ratio(
            report.peers[f"bare_decode_bs{c}_ms"], report.figures[f"c{c}_tpot_p50_ms"]
        )
    if "bare_decode_bs1_ms" in report.peers and "c1_tpot_p50_ms" in report.figures:
        # > 1 would be a TPOT below the bare step; the target is >= 1 / 1.10.
        report.ratios["bare_step_over_c1_tpot"] = ratio(
            report.peers["bare_decode_bs1_ms"], report.figures["c1_tpot_p50_ms"]
        )
    if not hasattr(engine, "metrics"):  # a tree from before prefix caching (``--against``)
        report.notes.append("this tree's engine has no metrics and no prefix cache")
        report.details["peers"] = peer_results
        report.table = table
        return report
    report.details["metrics"] = dataclasses.asdict(engine.metrics())
    shared = shared_prefix_workload(plan)
    engine.num_scheduler_steps = plan.shared_num_scheduler_steps
    on = run_level(engine, shared, plan.shared_concurrency, every_ttft=True)
    progress("shared prefix, cache on", on)
    # Each program built after warm-up would have cost the levels after it (``CompileCounter``).
    report.details["programs_built_after_warmup"] = built.stop()
    if built.count:
        report.notes.append(f"{built.count} programs were built after the engine's warm-up")
    del engine  # its page pool, before the second engine takes one of its own
    gc.collect()
    engine, _ = build_engine(plan, enable_prefix_caching=False)
    engine.num_scheduler_steps = plan.shared_num_scheduler_steps
    off = run_level(engine, shared, plan.shared_concurrency, every_ttft=True)
    progress("shared prefix, cache off", off)
    for name, level in (("on", on), ("off", off)):
        level.pop("lengths")
        report.details[f"shared_prefix_cache_{name}"] = level
        report.figures[f"shared_prefix_cache_{name}_ttft_p50_ms"] = level["ttft_s"]["p50"] * 1e3
        report.figures[f"shared_prefix_cache_{name}_tok_s"] = level["output_tok_s"]
        ttft, tpot = level["ttft_s"]["p50"] * 1e3, level["tpot_s"]["p50"] * 1e3
        row = ["shared prefix", f"cache {name}", "", "", "", "", "", "", ttft, tpot, ""]
        table.append(row)
    report.ratios["shared_prefix_ttft_off_over_on"] = ratio(
        off["ttft_s"]["p50"], on["ttft_s"]["p50"]
    )
    report.details["peers"] = peer_results
    report.table = table
    return report


def run_http(plan: Plan) -> Report:
    """``--http``: the engine's throughput and TTFT directly and through the server."""
    report = Report()
    engine, timings = build_engine(plan)
    report.details |= timings
    rows = http_levels(engine, plan, workload(plan), report)
    report.table = [["C", "HTTP tok/s", "direct tok/s", "TTFT added p50 ms"], *rows]
    return report
