"""Probe (kept out of the suites): the decode suite's KV case alone, the bf16 then the fp8 K/V
cache, with nothing before it (the suite runs it after its bs=1 and bs=64 cases).

    PYTHONPATH=. python benchmarks/kv_decode_probe.py [--repeats 3] [--tiny]

Llama-3-8B shapes with random weights, 64 rows of ``Plan.kv_prompt`` (3,968) prompt tokens and
128 new ones each, ``sj.generate_batch``; the figure is the suite's own (``measure``: a first
call that compiles, then the median decode-phase tok/s of ``--repeats`` calls). Prints one JSON
line (also written to ``$OUT/kv_decode_probe.json`` when ``OUT`` is set): each cache's tok/s and
``fp8_over_bf16``, the suite's ``kv_fp8_over_bf16``. It takes about two minutes of an H100,
where the whole suite takes eight.
"""

from __future__ import annotations

import argparse
import json

import jax

import spark_jax as sj
from benchmarks.common import llama, random_params, random_prompts, write_probe_json
from benchmarks.decode import FULL, TINY, measure


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU: a smoke run)")
    args = parser.parse_args()
    plan = TINY if args.tiny else FULL
    config, dtype = llama(args.tiny)
    params = random_params(config, dtype)
    sampling = sj.SamplingParams(temperature=0.0, max_tokens=plan.new_tokens, ignore_eos=True)
    prompts = random_prompts(config.vocab_size, plan.batch, plan.kv_prompt, seed=3)
    results = {"device": jax.devices()[0].device_kind, "rows": plan.batch}
    results["prompt_tokens"] = plan.kv_prompt
    for name, cache_dtype in (("bf16", "auto"), ("fp8", "fp8")):
        model = sj.Model(config, params, kv_cache_dtype=cache_dtype)
        call = lambda m=model: sj.generate_batch(m, prompts, sampling)
        results[name] = measure(call, args.repeats)
        del model, call  # one cache at a time: an 80 GB card holds no more
        print(name, json.dumps(results[name]), flush=True)
    results["fp8_over_bf16"] = results["fp8"]["tok_s"] / results["bf16"]["tok_s"]
    print(json.dumps(results))
    write_probe_json(results, "kv_decode_probe")


if __name__ == "__main__":
    main()
