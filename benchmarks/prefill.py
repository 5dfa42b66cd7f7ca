"""Prefill speed through the public API on Llama-3-8B shapes, against the same-run matmul rate.

    python -m benchmarks prefill            # on the H200, ~1 minute
    python -m benchmarks prefill --tiny     # tiny fp32 model, any backend, seconds

Random bf16 weights. ``sj.generate_batch`` of 4 prompts of 2048 tokens and one new token
each: its time is the prefill (plus one pick), the median of 5 warm calls after one that
compiles; its figure is the prefill's matmul FLOPs (projections, the causal half of
attention, the LM head of the last tokens) per second. Peers: the bf16 matmul ceiling of
this device measured in the same run, and the same call with the flash prefill kernel off
(``KernelOptions(flash_prefill=False)``: attention by XLA), where the tree has the options.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    Report,
    Unsupported,
    ceilings,
    host_median_seconds,
    kernel_options,
    llama,
    prefill_flops,
    random_params,
    random_prompts,
)


def run(tiny: bool, peer: bool = True) -> Report:
    import spark_jax as sj

    config, dtype = llama(tiny)
    batch, length, repeats = (2, 64, 2) if tiny else (4, 2048, 5)
    report = Report()
    report.peers["matmul_tflop_s"] = ceilings(tiny)["matmul_flop_s"] / 1e12
    params = random_params(config, dtype)
    prompts = random_prompts(config.vocab_size, batch, length, seed=3)
    sampling = sj.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    flops = prefill_flops(config, batch, length)
    variants: list[tuple[str, dict[str, Any]]] = [("prefill", {})]
    try:
        variants.append(("prefill_xla_attention", kernel_options(flash_prefill=False)))
    except Unsupported as why:
        report.notes.append(f"prefill_xla_attention skipped: {why}")
    table = [["case", "ms", "TFLOP/s", "of matmul"]]
    for name, options in variants:
        model = sj.Model(config, params, **options)

        def call(model: Any = model) -> Any:
            return sj.generate_batch(model, prompts, sampling)

        call()
        seconds, _ = host_median_seconds(call, repeats)
        tflop_s = flops / seconds / 1e12
        target = report.figures if name == "prefill" else report.peers
        target[f"{name}_tflop_s"] = tflop_s
        report.ratios[f"{name}_of_matmul"] = tflop_s / report.peers["matmul_tflop_s"]
        table.append(
            [
                f"{name} {batch}x{length}",
                seconds * 1e3,
                tflop_s,
                tflop_s / report.peers["matmul_tflop_s"],
            ]
        )
    if "prefill_xla_attention_tflop_s" in report.peers:
        report.ratios["prefill_over_xla_attention"] = (
            report.figures["prefill_tflop_s"] / report.peers["prefill_xla_attention_tflop_s"]
        )
    report.details |= {"batch": batch, "length": length, "flops": flops}
    report.table = table
    return report
