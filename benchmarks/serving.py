"""Serving throughput and latency of ``sj.Engine`` on Llama-3-8B shapes, against HF transformers.

    python -m benchmarks serving           # on the H200 (several minutes)
    python -m benchmarks serving --tiny    # a tiny config on any backend, seconds

Workload: ``--requests`` (512) requests with random bf16 weights, greedy, EOS ignored (random
weights would stop at random places), lengths drawn once from a seeded ShareGPT-like
distribution: lognormal fits to the shape of the ShareGPT V3 conversations vLLM's
``benchmark_serving`` uses (long right tails, median well below the mean):

    prompt tokens ~ round(lognormal(mu=ln 128, sigma=1.0)), clipped to [4, 1024]  (mean ~210)
    output tokens ~ round(lognormal(mu=ln 128, sigma=0.9)), clipped to [4, 512]   (mean ~190)

Clients: closed loop at each concurrency C (1, 64, 128): C requests are kept
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
``--tiny`` runs fp32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.common import (
    LLAMA3_8B,
    TINY_LLAMA,
    Report,
    hf_llama_kwargs,
    peer_in_subprocess,
    random_params,
    ratio,
    torch_available,
)
from spark_jax.config import ModelConfig


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    config: ModelConfig
    requests: int = 512
    concurrency: tuple[int, ...] = (1, 64, 128)
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
    dataclasses.replace(TINY_LLAMA, max_position_embeddings=512),
    requests=24,
    concurrency=(1, 8),
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
    hf_requests=8,
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
    """``sj.Engine`` over a random model, every shape compiled by ``warmup``."""
    import spark_jax as sj

    start = time.perf_counter()
    model = sj.Model(plan.config, random_params(plan.config, plan.dtype))
    engine = sj.Engine(model, **plan.engine_kwargs())
    built = time.perf_counter()
    engine.warmup()
    return engine, {"init_s": built - start, "warmup_s": time.perf_counter() - built}


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
    }


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


def run(tiny: bool, peer: bool = True, **overrides: Any) -> Report:
    """The suite; ``overrides`` replace plan fields (``concurrency``, ``requests``), and a
    level then finishes ``requests`` requests whatever its concurrency."""
    plan = dataclasses.replace(SMALL if tiny else FULL, **overrides)
    per_level = (lambda c: plan.requests) if "requests" in overrides else None
    report = Report()
    if not peer:
        hf: dict[str, Any] = {"error": "left out (--no-peer)"}
    elif not torch_available():
        hf = {"error": "torch/transformers not installed"}
    else:
        hf = peer_in_subprocess("serving", tiny, timeout_s=1800)
    engine, timings = build_engine(plan)
    report.details |= timings
    requests = workload(plan)
    hf_tok_s = hf.get("output_tok_s")
    if hf_tok_s:
        report.peers["hf_static_batches_tok_s"] = hf_tok_s
    else:
        report.notes.append(f"HF peer: {hf.get('error', '')[-300:]}")
    table = [["C", "tok/s", "x HF", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]]
    for c in plan.concurrency:
        count = per_level(c) if per_level else min(plan.requests, max(32, 4 * c))
        level = run_level(engine, requests[:count], c)
        report.details[f"c{c}"] = level
        report.figures[f"c{c}_tok_s"] = level["output_tok_s"]
        report.figures[f"c{c}_tpot_p50_ms"] = level["tpot_s"]["p50"] * 1e3
        report.ratios[f"c{c}_over_hf"] = ratio(level["output_tok_s"], hf_tok_s)
        table.append(
            [
                c,
                level["output_tok_s"],
                report.ratios[f"c{c}_over_hf"],
                level["ttft_s"]["p50"] * 1e3,
                level["ttft_s"]["p99"] * 1e3,
                level["tpot_s"]["p50"] * 1e3,
                level["tpot_s"]["p99"] * 1e3,
            ]
        )
    report.details["hf"] = hf
    report.table = table
    return report
