"""Decode speed through the public API on Llama-3-8B shapes, against HF and the read floor.

    python -m benchmarks decode            # on the H200, ~3 minutes
    python -m benchmarks decode --tiny     # tiny fp32 model, any backend, seconds
    python -m benchmarks decode --quantize fp8 int8 --kv-cache-dtype fp8   # side by side

Random bf16 weights. ``bs1``: ``sj.generate`` of one prompt of 3968 tokens, 128 new (greedy,
EOS ignored), the decode phase's tokens/s (tokens after the first over the time after it).
``bs64``: ``sj.generate_batch`` of 64 prompts of 1920 tokens, 128 new each, likewise. Each is
the median of 3 warm calls after one call that compiles. Floor: the bytes a step must read
(weights but the embedding table, plus every row's K/V at the mean context) over the
read-only ceiling measured in this run. Peer: HF transformers ``LlamaForCausalLM`` (torch,
bf16, eager and sdpa attention, same GPU, a process of its own run first), per-token time by
CUDA events after a prompt of the same length at bs=1 and of 512 tokens at bs=64 (a longer
eager prefill of 64 rows runs out of memory); its ratio is ours over HF's best.

``--quantize fp8 int8``: the same cases again with the linear layers' weights quantized
(weight-only, per output channel, ``spark_jax.ops.quant``) from the same random weights, in the
same process after the float model; ``bs1_fp8_over_bf16`` and the like are their speed over
the float model's. ``--kv-cache-dtype fp8``: a batch case at ``kv_prompt`` keys (64 rows of
3,968 to 4,096) with the float and the fp8 K/V cache (``kv_fp8_over_bf16``: the default
dispatch, our kernel reading the E4M3 pages in place on the GPU), and the fp8 cache through
XLA's fallback (``kv_fp8_xla_over_bf16``: ``KernelOptions(pallas_fp8_cache=False)``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    Report,
    ceilings,
    hf_llama_kwargs,
    kernel_options,
    kv_bytes_per_token,
    llama,
    peer_in_subprocess,
    random_params,
    random_prompts,
    ratio,
    torch_available,
    torch_median_seconds,
    weight_bytes_per_step,
)


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    bs1_prompt: int = 3968
    batch: int = 64
    batch_prompt: int = 1920
    new_tokens: int = 128
    repeats: int = 3
    hf_batch_prompt: int = 512
    hf_steps: int = 20
    # Prompt and new tokens end at 4,096 keys: one more and the cache's power-of-two length
    # doubles to 8,192 (a bf16 cache of 64 such rows, 69 GB, no longer fits an 80 GB card).
    kv_prompt: int = 3968


FULL = Plan()
TINY = Plan(
    bs1_prompt=48,
    batch=4,
    batch_prompt=32,
    new_tokens=16,
    repeats=2,
    hf_batch_prompt=32,
    hf_steps=4,
    kv_prompt=96,
)


def decode_tok_s(results: list[Any]) -> float:
    """Decode-phase tokens/s of one generation call: tokens after each row's first over the
    call's time after its first token."""
    timings = results[0].timings
    tokens = sum(len(r.output_tokens) - 1 for r in results)
    return tokens / (timings["total_s"] - timings["ttft_s"])


def measure(call: Any, repeats: int) -> dict[str, float]:
    """First call (compiles), then the median of ``repeats`` calls' decode-phase rates."""
    start = time.perf_counter()
    call()
    first_s = time.perf_counter() - start
    rates, ttfts = [], []
    for _ in range(repeats):
        results = call()
        rates.append(decode_tok_s(results))
        ttfts.append(results[0].timings["ttft_s"])
    rates.sort()
    ttfts.sort()
    return {"tok_s": rates[len(rates) // 2], "ttft_s": ttfts[len(ttfts) // 2], "first_s": first_s}


def run(
    tiny: bool,
    peer: bool = True,
    quantize: tuple[str, ...] = (),
    kv_cache_dtype: str | None = None,
    tensor_parallel: int = 1,
) -> Report:
    """``tensor_parallel``: the model sharded over that many devices (``--tensor-parallel``);
    the figures are then of the sharded model, the peer's of one device."""
    import spark_jax as sj

    if tensor_parallel != 1 and (quantize or kv_cache_dtype):
        raise ValueError(
            "--tensor-parallel runs the float model alone; leave out --quantize and "
            "--kv-cache-dtype."
        )
    plan = TINY if tiny else FULL
    config, dtype = llama(tiny)
    report = Report()
    hf = peer_figures(tiny) if peer else {"error": "left out (--no-peer)"}
    ceiling = ceilings(tiny)
    params = random_params(config, dtype)
    if tensor_parallel == 1:
        model = sj.Model(config, params)
    else:  # imported here: a tree from before tensor parallelism runs ``--against``
        from spark_jax.model import shard_params

        config, params, mesh = shard_params(config, params, tensor_parallel)
        model = sj.Model(config, params, mesh=mesh)
        report.figures["tensor_parallel"] = tensor_parallel
    sampling = sj.SamplingParams(temperature=0.0, max_tokens=plan.new_tokens, ignore_eos=True)
    prompt = random_prompts(config.vocab_size, 1, plan.bs1_prompt, seed=1)[0]
    prompts = random_prompts(config.vocab_size, plan.batch, plan.batch_prompt, seed=2)
    bs1 = measure(lambda m=model: [sj.generate(m, prompt, sampling)], plan.repeats)
    batch = measure(lambda m=model: sj.generate_batch(m, prompts, sampling), plan.repeats)
    del model  # its cache's pages go before the next model's: an 80 GB card holds one at a time
    if kv_cache_dtype:
        kv_case(report, params, config, plan, sampling, kv_cache_dtype)
    if quantize:
        quantized_cases(report, params, config, plan, sampling, quantize, prompt, prompts)
    del params
    itemsize = 4 if dtype == "float32" else 2
    for name, figure, rows, prompt_len in (
        ("bs1", bs1, 1, plan.bs1_prompt),
        (f"bs{plan.batch}", batch, plan.batch, plan.batch_prompt),
    ):
        context = prompt_len + plan.new_tokens // 2
        nbytes = weight_bytes_per_step(config, itemsize)
        nbytes += rows * context * kv_bytes_per_token(config, itemsize)
        floor_tok_s = rows * ceiling["read_bytes_per_s"] / nbytes
        report.figures[f"{name}_tok_s"] = figure["tok_s"]
        report.figures[f"{name}_ttft_s"] = figure["ttft_s"]
        report.details[f"{name}_first_call_s"] = figure["first_s"]
        report.peers[f"{name}_floor_tok_s"] = floor_tok_s
        report.ratios[f"{name}_of_floor"] = figure["tok_s"] / floor_tok_s
    report.details["ceilings"] = ceiling
    report.details["plan"] = plan.__dict__
    rows = [["case", "ours tok/s", "floor tok/s", "of floor", "HF eager", "HF sdpa", "x HF best"]]
    if "error" in hf:
        report.notes.append(f"HF peer: {hf['error'][-300:]}")
    for name, rows_ in (("bs1", 1), (f"bs{plan.batch}", plan.batch)):
        eager, sdpa = hf.get(f"eager_bs{rows_}_tok_s"), hf.get(f"sdpa_bs{rows_}_tok_s")
        best = max((x for x in (eager, sdpa) if x), default=None)
        if best:
            report.peers[f"{name}_hf_eager_tok_s"] = eager
            report.peers[f"{name}_hf_sdpa_tok_s"] = sdpa
            report.ratios[f"{name}_over_hf"] = ratio(report.figures[f"{name}_tok_s"], best)
        ours = report.figures[f"{name}_tok_s"]
        rows.append(
            [
                name,
                ours,
                report.peers[f"{name}_floor_tok_s"],
                report.ratios[f"{name}_of_floor"],
                eager,
                sdpa,
                report.ratios.get(f"{name}_over_hf"),
            ]
        )
    if not tiny:
        report.notes.append(
            f"HF bs={plan.batch} decodes after {plan.hf_batch_prompt}-token prompts, ours after "
            f"{plan.batch_prompt}: its ratio flatters HF"
        )
    for scheme in quantize:
        for name in ("bs1", f"bs{plan.batch}"):
            ours = report.figures[f"{name}_{scheme}_tok_s"]
            report.ratios[f"{name}_{scheme}_over_bf16"] = ours / report.figures[f"{name}_tok_s"]
            rows.append([f"{name} {scheme}", ours, None, None, None, None, None])
    if kv_cache_dtype:
        float_kv = report.figures.get("kv_tok_s")  # None where that case failed (noted)
        rows.append([f"kv bs{plan.batch} {dtype}", float_kv, *[None] * 5])
        for name in (f"kv_{kv_cache_dtype}", f"kv_{kv_cache_dtype}_xla"):
            kv = report.figures.get(f"{name}_tok_s")
            rows.append([f"{name.replace('kv_', f'kv bs{plan.batch} ')}", kv, *[None] * 5])
            report.ratios[f"{name}_over_bf16"] = ratio(kv, float_kv)
    report.details["hf"] = hf
    report.table = rows
    return report


def quantized_cases(
    report: Report,
    params: Any,
    config: Any,
    plan: Plan,
    sampling: Any,
    schemes: tuple[str, ...],
    prompt: list[int],
    prompts: list[list[int]],
) -> None:
    """The bs=1 and batch cases with each weight quantization of the same random weights."""
    import dataclasses

    import spark_jax as sj
    from spark_jax.config import QuantizationConfig
    from spark_jax.models import declare

    for scheme in schemes:
        quantized = dataclasses.replace(config, quantization=QuantizationConfig(scheme))
        model = sj.Model(quantized, declare(quantized).quantize(params))
        bs1 = measure(lambda m=model: [sj.generate(m, prompt, sampling)], plan.repeats)
        batch = measure(lambda m=model: sj.generate_batch(m, prompts, sampling), plan.repeats)
        for name, figure in (("bs1", bs1), (f"bs{plan.batch}", batch)):
            report.figures[f"{name}_{scheme}_tok_s"] = figure["tok_s"]
            report.details[f"{name}_{scheme}_first_call_s"] = figure["first_s"]
        del model


def kv_case(
    report: Report, params: Any, config: Any, plan: Plan, sampling: Any, kv_cache_dtype: str
) -> None:
    """A batch over ``plan.kv_prompt`` keys per row, with the float and the narrow K/V cache,
    the narrow one through the default dispatch (our kernel reads it in place) and through
    XLA's fallback (``KernelOptions(pallas_fp8_cache=False)``); a case that fails is noted,
    not fatal."""
    import spark_jax as sj

    prompts = random_prompts(config.vocab_size, plan.batch, plan.kv_prompt, seed=3)
    cases = (
        ("kv", "auto", {}),
        (f"kv_{kv_cache_dtype}", kv_cache_dtype, {}),
        (f"kv_{kv_cache_dtype}_xla", kv_cache_dtype, {"pallas_fp8_cache": False}),
    )
    for name, cache_dtype, fields in cases:
        model = None  # the last case's model (and its cache) gone before this one's is built
        try:
            options = kernel_options(**fields)
            model = sj.Model(config, params, kv_cache_dtype=cache_dtype, **options)
            figure = measure(lambda m=model: sj.generate_batch(m, prompts, sampling), plan.repeats)
        except Exception as error:  # out of memory, or a kernel that does not compile here
            report.notes.append(f"{name}: {type(error).__name__}: {str(error)[:300]}")
            continue
        report.figures[f"{name}_tok_s"] = figure["tok_s"]
        report.details[f"{name}_first_call_s"] = figure["first_s"]


# ---------------------------------------------------------------------------------------------
# The peer: HF transformers on the same device, in its own process.


def peer_figures(tiny: bool) -> dict[str, Any]:
    if not torch_available():
        return {"error": "torch/transformers not installed"}
    return peer_in_subprocess("decode", tiny, timeout_s=900)


def peer(tiny: bool, arg: str = "") -> dict[str, Any]:
    """HF ``LlamaForCausalLM`` (random weights): per-token decode time after a prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    plan = TINY if tiny else FULL
    config, dtype = llama(tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, dtype))
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf_llama_kwargs(config))).eval()
    results: dict[str, Any] = {"device": device, "torch": torch.__version__}
    cases = [(1, plan.bs1_prompt), (plan.batch, plan.hf_batch_prompt)]
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        for batch, prompt in cases:
            try:
                seconds = _hf_decode_seconds(model, batch, prompt, plan.hf_steps, device)
                results[f"{impl}_bs{batch}_tok_s"] = batch / seconds
            except Exception as exc:  # out of memory at a shape: recorded, the rest goes on
                results[f"{impl}_bs{batch}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def _hf_decode_seconds(model: Any, batch: int, prompt: int, steps: int, device: str) -> float:
    import torch

    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        state = {"token": out.logits[:, -1:].argmax(-1)}

        def step() -> None:
            out = model(input_ids=state["token"], past_key_values=cache, use_cache=True)
            state["token"] = out.logits[:, -1:].argmax(-1)

        return torch_median_seconds(step, warmup=3, iters=steps)
