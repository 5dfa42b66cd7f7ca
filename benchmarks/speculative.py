"""Speculative decoding speed at bs=1 on Llama-3-8B shapes: an oracle drafter and a noisy one.

    python -m benchmarks speculative            # on the H200, ~3 minutes
    python -m benchmarks speculative --tiny     # a tiny fp32 config, any backend

Random bf16 weights (``decoder.init_params``), one sequence. The baseline is
``engine.generate`` (greedy); its output is the target's own continuation, which the oracle
drafter replays, so every draft is accepted (acceptance 1.0). The noisy drafter replays it
too but replaces each draft token with a wrong one with probability ``--corrupt`` (0.5):
a draft is then accepted with probability a = 1 - corrupt, independently, so a verify step
yields E[tokens] = (1 - a^(K+1)) / (1 - a) tokens (1.94 at K=4, a=0.5). Its expected speedup
is E[tokens] x (decode step time / oracle step time), the step times measured in this run.

Both drafters run on the device (``ReplayDrafter``), so the speculative loop is the library's
chunk of several steps per host sync, as with a draft model or a draft head.

The engine part: ``sj.Engine`` with ``speculative_config={"method": "ngram",
"num_speculative_tokens": 4}`` against the same engine without it (both warmed up), at
concurrency 1, 4 and 16 (``--concurrency``): that many requests at once, each an editing
prompt (a random text, then the text again, which the output goes on copying where the
model does) of greedy output. Output tok/s is every request's tokens over the wall time;
the acceptance rate is the engine's kept drafts over verified ones. Random weights copy
only as far as their own greedy output repeats: the figure says what prompt lookup buys on
this workload, not on a trained model's edits.

Figures are decode-phase rates (tokens after the first / time after the first), the median of
``--repeats`` warm runs. ``verify_ms`` and ``decode_ms`` are the bare jitted steps chained
on the device (no host work), so ``oracle_step_ms - verify_ms`` is what the loop adds.
If bf16 rounding makes a verify step's argmax differ from the decode step's (the rows of a
K+1-token matmul round differently), the oracle replays the speculative output instead; the
number of tokens where the two greedy outputs differ is reported (``greedy_mismatches``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import Report, chain_seconds, llama, random_params
from spark_jax import (
    Engine,
    GenerationResult,
    Model,
    SamplingParams,
    generate,
    generate_speculative,
)

ENGINE_CONCURRENCY = (1, 4, 16)


@dataclass(frozen=True)
class ReplayDrafts:
    """A device drafter's program (spark_jax.generation.drafters.DeviceProgram) proposing
    the reference (its params) from each row's output position, each token corrupted with
    probability ``corrupt`` (drawn from the row's draft key: every repeat drafts the same)."""

    vocab: int
    corrupt: float
    needs_hidden = False

    def propose(self, target_params, params, state, carry, keys, temperature, k, sampled):
        at = carry.num_generated[:, None] + jnp.arange(k)[None, :]
        tokens = params[jnp.minimum(at, params.shape[0] - 1)]
        step_keys = jax.vmap(jax.random.fold_in)(keys, carry.num_generated)
        wrong = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(step_keys) < self.corrupt
        return jnp.where(wrong, (tokens + 1) % self.vocab, tokens), None, state

    def accept(self, state, outcome):
        return state


class ReplayDrafter:
    """Drafts ``reference`` (the target's own continuation) on the device: the speculative
    loop runs several steps per host sync, as with a draft model, at no drafting cost."""

    def __init__(self, reference: Sequence[int], vocab: int, corrupt: float = 0.0):
        self.reference = jnp.asarray(list(reference), jnp.int32)
        self.program = ReplayDrafts(vocab, corrupt)

    def params(self, target: Model) -> Any:
        return self.reference

    def start(self, target: Model, prompts: Any, max_len: int, k: int, prefill: Any) -> None:
        return None


def decode_rate(result: GenerationResult) -> float:
    """Tokens per second after the first token."""
    return (len(result.output_tokens) - 1) / (result.timings["total_s"] - result.timings["ttft_s"])


def median_run(run: Callable[[], GenerationResult], repeats: int) -> tuple[float, Any]:
    """(median decode-phase tok/s over warm repeats, the last result); the first call warms."""
    result = run()
    rates = []
    for _ in range(repeats):
        result = run()
        rates.append(decode_rate(result))
    return statistics.median(rates), result


def bare_step_ms(model: Model, context: int, width: int) -> float:
    """Device time of one decode (width 0) or verify (width tokens) step, chained, no host."""
    runner = model.runner
    state = runner.init_state(1, 2 * context)
    _, state = runner.prefill(state, [0], [list(range(1, context + 1))])
    # Each step rolls the length back by what it added, so the context stays the same.
    if width == 0:
        tokens, active = jnp.ones((1,), jnp.int32), jnp.ones((1,), bool)

        def step(s: Any) -> Any:
            s = runner.decode(s, tokens, active)[1]
            return s.with_lengths(s.lengths - 1)
    else:
        tokens, lengths = jnp.ones((1, width), jnp.int32), jnp.full((1,), width, jnp.int32)

        def step(s: Any) -> Any:
            s = runner.verify(s, tokens, lengths)[1]
            return s.with_lengths(s.lengths - width)

    seconds, _, _ = chain_seconds(step, state, steps=16)
    return 1e3 * seconds


def editing_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of a random text of ``length`` tokens given twice: the second copy
    starts the edited version, which prompt lookup can continue from the first."""
    rng = np.random.RandomState(seed)
    texts = [rng.randint(0, vocab, length).tolist() for _ in range(count)]
    return [text + text[: length // 4] for text in texts]


def engine_rates(
    model: Model, tiny: bool, k: int, concurrency: Sequence[int], repeats: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Output tok/s of one engine with prompt lookup and one without, at each concurrency."""
    length, max_tokens = (48, 32) if tiny else (256, 128)
    slots = max(concurrency)
    shapes = dict(
        max_num_seqs=slots,
        max_model_len=length + length // 4 + max_tokens,
        max_batch_tokens=64 if tiny else 512,
        min_chunk=64 if tiny else 512,  # one prefill shape and a decode width per level:
        decode_widths=sorted(set(concurrency)),  # few programs to warm up
        page_size=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": k}
    engines = {
        "plain": Engine(model, **shapes),
        "ngram": Engine(model, **shapes, speculative_config=spec),
    }
    warmup_s = {}
    for name, engine in engines.items():
        start = time.perf_counter()
        engine.warmup()
        warmup_s[name] = time.perf_counter() - start
    rows = []
    for c in concurrency:
        prompts = editing_prompts(model.config.vocab_size, c, length, seed=c)
        row: dict[str, Any] = {"concurrency": c}
        for name, engine in engines.items():
            before = engine.metrics()
            rates = []
            for _ in range(repeats):  # the median: host noise moves one run a lot
                start = time.perf_counter()
                results = engine.generate_many(prompts, params)
                seconds = time.perf_counter() - start
                rates.append(sum(len(r.output_tokens) for r in results) / seconds)
            after = engine.metrics()
            row[f"{name}_tok_s"] = statistics.median(rates)
            if name == "ngram":
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                row["acceptance_rate"] = accepted / drafted if drafted else 0.0
                outputs = [r.output_tokens for r in results]
            else:
                reference = [r.output_tokens for r in results]
        row["speedup"] = row["ngram_tok_s"] / row["plain_tok_s"]
        row["outputs_match"] = outputs == reference
        rows.append(row)
    return rows, warmup_s


def run(tiny: bool, peer: bool = True, concurrency: Sequence[int] = ENGINE_CONCURRENCY) -> Report:
    """The bare decode and verify steps are this suite's peer: always measured; the engine
    without speculation is the engine part's."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        num_drafts=4,
        prompt_len=32 if tiny else 512,
        new_tokens=16 if tiny else 256,
        corrupt=0.5,
        repeats=2 if tiny else 3,
        tiny=tiny,
    )
    config, dtype = llama(tiny)
    model = Model(config, random_params(config, dtype))
    k = args.num_drafts
    prompt = np.random.RandomState(1).randint(0, config.vocab_size, args.prompt_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    base_tok_s, base = median_run(lambda: generate(model, prompt, params), args.repeats)

    # Replay what the speculative path itself outputs, so bf16 argmax flips between the
    # decode and verify steps cannot turn into rejected oracle drafts.
    reference = base.output_tokens
    for _ in range(3):
        probe = generate_speculative(
            model, prompt, params, k, ReplayDrafter(reference, config.vocab_size)
        )
        if probe.spec_stats["acceptance_rate"] == 1.0:
            break
        reference = probe.output_tokens
    mismatches = sum(a != b for a, b in zip(reference, base.output_tokens, strict=True))

    def speculative(corrupt: float) -> tuple[float, Any]:
        return median_run(
            lambda: generate_speculative(
                model, prompt, params, k, ReplayDrafter(reference, config.vocab_size, corrupt)
            ),
            args.repeats,
        )

    oracle_tok_s, oracle = speculative(0.0)
    noisy_tok_s, noisy = speculative(args.corrupt)
    context = args.prompt_len + args.new_tokens // 2
    decode_ms = bare_step_ms(model, context, 0)
    verify_ms = bare_step_ms(model, context, k + 1)

    def step_ms(result: Any) -> float:
        steps = result.timings["decode_steps"]
        return 1e3 * (len(result.output_tokens) - 1) / decode_rate(result) / steps

    a = 1.0 - args.corrupt
    expected_tokens = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
    base_step_ms = 1e3 / base_tok_s
    oracle_step_ms = step_ms(oracle)
    results = {
        "benchmark": "speculative",
        "config": "tiny" if args.tiny else "llama3-8b",
        "dtype": jnp.dtype(dtype).name,
        "device": jax.devices()[0].device_kind,
        "batch_size": 1,
        "num_drafts": k,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "baseline_tok_s": base_tok_s,
        "baseline_step_ms": base_step_ms,
        "decode_ms": decode_ms,
        "verify_ms": verify_ms,
        "greedy_mismatches": mismatches,
        "oracle": {
            "tok_s": oracle_tok_s,
            "speedup": oracle_tok_s / base_tok_s,
            "acceptance_rate": oracle.spec_stats["acceptance_rate"],
            "tokens_per_step": oracle.spec_stats["tokens_per_step"],
            "step_ms": oracle_step_ms,
        },
        "corrupted": {
            "corrupt": args.corrupt,
            "tok_s": noisy_tok_s,
            "speedup": noisy_tok_s / base_tok_s,
            "acceptance_rate": noisy.spec_stats["acceptance_rate"],
            "tokens_per_step": noisy.spec_stats["tokens_per_step"],
            "expected_tokens_per_step": expected_tokens,
            "expected_acceptance_rate": (expected_tokens - 1) / k,  # later drafts die with one
            "expected_speedup": expected_tokens * base_step_ms / oracle_step_ms,
            "step_ms": step_ms(noisy),
            "output_matches_oracle": noisy.output_tokens == oracle.output_tokens,
        },
    }
    engine_rows, warmup_s = engine_rates(model, tiny, k, concurrency, 3)
    results["engine"] = {"num_speculative_tokens": k, "rows": engine_rows, "warmup_s": warmup_s}
    report = Report(details=results)
    report.figures = {
        "oracle_tok_s": oracle_tok_s,
        "corrupted_tok_s": noisy_tok_s,
        "generate_tok_s": base_tok_s,
    }
    report.peers = {"decode_step_ms": decode_ms, "verify_step_ms": verify_ms}
    for row in engine_rows:
        c = row["concurrency"]
        report.figures[f"engine_ngram_c{c}_tok_s"] = row["ngram_tok_s"]
        report.peers[f"engine_plain_c{c}_tok_s"] = row["plain_tok_s"]
        report.ratios[f"engine_ngram_over_plain_c{c}"] = row["speedup"]
    report.ratios = {
        "oracle_over_generate": oracle_tok_s / base_tok_s,
        "corrupted_over_generate": noisy_tok_s / base_tok_s,
        "corrupted_over_expected": (noisy_tok_s / base_tok_s)
        / results["corrupted"]["expected_speedup"],
    }
    report.table = [
        ["run", "tok/s", "speedup", "acceptance", "tokens/step", "ms/step"],
        ["generate", base_tok_s, 1.0, None, 1.0, base_step_ms],
        [
            f"oracle K={k}",
            oracle_tok_s,
            oracle_tok_s / base_tok_s,
            oracle.spec_stats["acceptance_rate"],
            oracle.spec_stats["tokens_per_step"],
            oracle_step_ms,
        ],
        [
            f"{args.corrupt:.0%} corrupted",
            noisy_tok_s,
            noisy_tok_s / base_tok_s,
            noisy.spec_stats["acceptance_rate"],
            noisy.spec_stats["tokens_per_step"],
            step_ms(noisy),
        ],
        [
            "expected",
            None,
            results["corrupted"]["expected_speedup"],
            (expected_tokens - 1) / k,
            expected_tokens,
            None,
        ],
        ["bare decode step", None, None, None, None, decode_ms],
        [f"bare verify step (T={k + 1})", None, None, None, None, verify_ms],
    ]
    for row in engine_rows:
        c = row["concurrency"]
        report.table.append(
            [f"engine C={c}, no speculation", row["plain_tok_s"], 1.0, None, None, None]
        )
        label = f"engine C={c}, ngram K={k}" + ("" if row["outputs_match"] else " (outputs differ)")
        report.table.append(
            [label, row["ngram_tok_s"], row["speedup"], row["acceptance_rate"], None, None]
        )
    return report
