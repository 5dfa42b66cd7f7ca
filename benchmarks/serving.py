"""Serving throughput and latency of ``sj.Engine`` on Llama-3-8B shapes, against HF transformers.

    PYTHONPATH=. python3 benchmarks/serving.py           # on the H200 (several minutes)
    PYTHONPATH=. python3 benchmarks/serving.py --tiny    # a tiny config on any backend (smoke)

Workload: ``--requests`` (512) requests with random bf16 weights, greedy, EOS ignored (random
weights would stop at random places), lengths drawn once from a seeded ShareGPT-like
distribution: lognormal fits to the shape of the ShareGPT V3 conversations vLLM's
``benchmark_serving`` uses (long right tails, median well below the mean):

    prompt tokens ~ round(lognormal(mu=ln 128, sigma=1.0)), clipped to [4, 1024]  (mean ~210)
    output tokens ~ round(lognormal(mu=ln 128, sigma=0.9)), clipped to [4, 512]   (mean ~190)

Clients: closed loop at each concurrency C of ``--concurrency`` (1..128): C requests are kept
in flight, a new one is submitted as one finishes, until ``min(requests, max(32, 4C))`` have
finished (C=1 over all 512 would take most of an hour). One engine (128 slots, 16-token pages,
max_model_len 2048, every shape compiled by ``warmup`` first) serves all levels; its decode
step runs all 128 rows at every C, so low-C latency carries that cost.

Per level: output tokens/s (tokens of finished requests / wall time), TTFT (submit to first
token) and TPOT ((finish - first token) / (tokens - 1)), p50 and p99.

Peer: HF ``LlamaForCausalLM`` (torch, bf16, sdpa, same GPU, in a child process run first so
torch and JAX never share GPU memory) with ``generate`` over static batches of ``--hf-batch``
(64) requests: prompts left-padded to the batch's longest, every row generating the batch's
longest output. Its throughput counts only the tokens each request asked for, so padding and
rows kept running past their own end are the cost of static batching they are.
Results: one JSON line (and $OUT/serving.json) and a table. ``--tiny`` runs fp32 on the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import emit, print_table
from benchmarks.shapes import LLAMA3_8B, TINY, hf_llama_kwargs
from spark_jax.config import ModelConfig


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    config: ModelConfig
    requests: int = 512
    concurrency: tuple[int, ...] = (1, 8, 32, 64, 128)
    prompt_median: int = 128
    prompt_sigma: float = 1.0
    prompt_range: tuple[int, int] = (4, 1024)
    output_median: int = 128
    output_sigma: float = 0.9
    output_range: tuple[int, int] = (4, 512)
    max_model_len: int = 2048
    engine_slots: int = 128
    page_size: int = 16
    max_batch_tokens: int = 1024
    max_prefill_seqs: int = 4
    min_chunk: int = 256  # few prefill shapes: each compile of the unrolled 8B costs ~25 s
    min_decode_pages: int = 32
    hf_batch: int = 64
    hf_requests: int = 128
    dtype: str = "bfloat16"

    def engine_kwargs(self) -> dict[str, int]:
        """``sj.Engine`` keyword arguments of this plan's engine."""
        return dict(
            max_num_seqs=self.engine_slots,
            max_batch_tokens=self.max_batch_tokens,
            page_size=self.page_size,
            max_model_len=self.max_model_len,
            max_prefill_seqs=self.max_prefill_seqs,
            min_chunk=self.min_chunk,
            min_decode_pages=self.min_decode_pages,
        )


FULL = Plan(LLAMA3_8B)
SMALL = Plan(
    dataclasses.replace(TINY, max_position_embeddings=512),
    requests=48,
    concurrency=(1, 4, 16),
    prompt_median=16,
    prompt_range=(2, 96),
    output_median=12,
    output_range=(2, 48),
    max_model_len=256,
    engine_slots=16,
    max_batch_tokens=128,
    max_prefill_seqs=4,
    min_chunk=16,
    min_decode_pages=8,
    hf_batch=8,
    hf_requests=16,
    dtype="float32",  # the CPU backend has no bf16 x bf16 -> f32 batched dot
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


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99))}


# ---------------------------------------------------------------------------------------------
# The engine.


def build_engine(plan: Plan) -> tuple[Any, dict[str, float]]:
    import jax

    import spark_jax as sj
    from spark_jax.models import decoder
    from spark_jax.serving.engine import Engine

    start = time.perf_counter()
    params = decoder.init_params(plan.config, jax.random.key(0), plan.dtype)
    model = sj.Model(plan.config, params)
    engine = Engine(model, **plan.engine_kwargs())
    built = time.perf_counter()
    engine.warmup()
    timings = {"init_s": built - start, "warmup_s": time.perf_counter() - built}
    timings["compiled_shapes"] = len(engine.width_ladder) + len(engine.prefill_shapes())
    return engine, timings


def run_level(engine: Any, requests: list[tuple[list[int], int]], concurrency: int) -> dict:
    """Closed-loop clients: ``concurrency`` requests in flight until all have finished."""
    import spark_jax as sj

    queue = list(requests)
    inflight: dict[int, dict[str, float]] = {}
    done: list[dict[str, float]] = []
    start = time.perf_counter()
    while queue or inflight:
        while queue and len(inflight) < concurrency:
            prompt, n = queue.pop(0)
            params = sj.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            inflight[engine.add_request(prompt, params)] = {"submit": time.perf_counter()}
        for out in engine.step():
            now = time.perf_counter()
            record = inflight[out.request_id]
            record.setdefault("first", now)
            if out.finished:
                record["end"], record["tokens"] = now, len(out.result.output_tokens)
                done.append(inflight.pop(out.request_id))
    wall = time.perf_counter() - start
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
        "preemptions": engine.num_preemptions,
    }


# ---------------------------------------------------------------------------------------------
# The HF peer (its own process).


def run_peer(plan: Plan) -> dict[str, Any]:
    """HF ``generate`` over static batches: left padding, every row to the batch's longest."""
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


def peer_in_subprocess(tiny: bool, timeout_s: float) -> dict[str, Any]:
    path = "/tmp/spark_jax_serving_peer.json"
    command = [sys.executable, __file__, "--peer-only", "--peer-json", path]
    command += ["--tiny"] if tiny else []
    try:
        proc = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# Main.


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--requests", type=int, default=0, help="override the plan's 512")
    parser.add_argument("--concurrency", default="", help="comma list, e.g. 1,8,64")
    parser.add_argument("--no-peer", action="store_true", help="skip HF transformers")
    parser.add_argument("--peer-timeout-s", type=float, default=420.0)
    parser.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = SMALL if args.tiny else FULL
    if args.requests:
        plan = dataclasses.replace(plan, requests=args.requests)
    if args.concurrency:
        plan = dataclasses.replace(
            plan, concurrency=tuple(int(c) for c in args.concurrency.split(","))
        )
    if args.peer_only:
        with open(args.peer_json, "w") as f:
            json.dump(run_peer(plan), f)
        return
    results: dict[str, Any] = {"benchmark": "serving", "tiny": args.tiny}
    if not args.no_peer:  # first: the child must have the GPU to itself
        results["hf"] = peer_in_subprocess(args.tiny, args.peer_timeout_s)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    import jax

    jax.config.update("jax_compilation_cache_dir", "/tmp/spark_jax_compile_cache")
    results["device"] = str(jax.devices()[0].device_kind)
    engine, results["engine"] = build_engine(plan)
    requests = workload(plan)
    results["workload"] = {
        "prompt_mean": statistics.mean(len(p) for p, _ in requests),
        "output_mean": statistics.mean(n for _, n in requests),
    }
    results["levels"] = []
    for c in plan.concurrency:
        count = min(plan.requests, max(32, 4 * c))
        results["levels"].append(run_level(engine, requests[:count], c))
        print(f"concurrency {c}: done", flush=True)
    hf = results.get("hf", {}).get("output_tok_s")
    for level in results["levels"]:
        level["x_hf"] = level["output_tok_s"] / hf if hf else None
    emit(results, "serving")
    print_table(*summary(results))


def summary(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["C", "req", "tok/s", "x HF", "TTFT p50 ms", "p99", "TPOT p50 ms", "p99"]
    rows = []
    for r in results["levels"]:
        ms = lambda d, k: None if d[k] is None else 1e3 * d[k]  # noqa: E731
        rows.append(
            [
                r["concurrency"],
                r["requests"],
                r["output_tok_s"],
                r["x_hf"],
                ms(r["ttft_s"], "p50"),
                ms(r["ttft_s"], "p99"),
                ms(r["tpot_s"], "p50"),
                ms(r["tpot_s"], "p99"),
            ]
        )
    hf = results.get("hf", {})
    rows.append(
        [f"HF bs{hf.get('batch')}", hf.get("requests"), hf.get("output_tok_s")] + [None] * 5
    )
    return headers, rows


if __name__ == "__main__":
    main()
