"""NLLB translation speed against HF transformers: beam 4 and greedy, same GPU, same weights.

    PYTHONPATH=. python3 benchmarks/nllb.py            # on the H200: NLLB-200-distilled-600M shapes
    PYTHONPATH=. python3 benchmarks/nllb.py --tiny     # a tiny config on any backend, in seconds

Shapes of NLLB-200-distilled-600M (d_model 1024, 12 + 12 layers, 16 heads, ffn 4096, vocab
256206), random bf16 weights drawn by HF's own init. The HF peer runs first, in a process of
its own (JAX and torch never share the GPU): it builds ``M2M100ForConditionalGeneration``
in bf16 on the device, saves its weights (raw bf16 bits) for this process, and times
``generate(num_beams=4, max_new_tokens=65, forced_bos_token_id=...)`` and greedy with CUDA
events. This process then loads the very same bits through ``nllb.params_from_hf`` and times
``sj.generate_beam`` (num_beams 4, max_new 64) and ``sj.generate_batch`` (temperature 0,
max_tokens 64) on the same 32 sources of 26-34 tokens, eng_Latn → fra_Latn; and greedy
again with fixed-count device chunks (``greedy_fixed_chunks``: ``engine.CHUNKS_EXIT_EARLY``
off), against the same HF greedy figure.

Equal work on both sides: random weights may pick EOS at any step, which would end
hypotheses early and differently on each side. The peer lowers EOS's logit by
``EOS_MARGIN`` through the decoder's final LayerNorm bias (the LM head is tied: the bias
moves along EOS's embedding row), so neither side ever picks EOS and both generate the full
64 tokens after the forced language token with their default generation paths (no extra
logit processor on either side). Every output is checked to hold exactly 64 tokens.

Correctness in the same run: our greedy and beam tokens against HF's (bf16 on both sides, so
near-ties may flip a token and the continuation with it: exact matches and the mean common
prefix are reported), and our teacher-forced logits against HF's on HF's greedy output
(relative error and argmax agreement). Timings: the first call of each mode (compilation
included) apart, then the median of ``--repeats`` calls. ``breakdown`` splits one step into
the device step (decode + pick, dispatched back to back), the host's per-step work, and for
beam the cache reorder and the host search logic. One JSON line on stdout (and
$OUT/nllb.json), then a short table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    chain_seconds,
    emit,
    kernel_profile,
    print_table,
    timed,
    torch_median_seconds,
)

EOS, PAD, DECODER_START = 2, 1, 2
EOS_MARGIN = 40.0  # logits of random bf16 weights spread ~0.6: EOS is never picked
LANGUAGE_CODES_FROM_END = 205  # NLLB: 202 codes from vocab - 205 (256001), then <mask>, ...
SRC_LANG, TGT_LANG = "eng_Latn", "fra_Latn"


@dataclass(frozen=True)
class Plan:
    """The shapes and workload of one benchmark run."""

    vocab_size: int
    d_model: int
    layers: int
    heads: int
    ffn_dim: int
    max_positions: int
    num_sources: int
    source_lengths: tuple[int, int]  # inclusive range, language tag and </s> included
    new_tokens: int
    num_beams: int
    repeats: int


FULL = Plan(256206, 1024, 12, 16, 4096, 1024, 32, (26, 34), 64, 4, 5)
TINY = Plan(512, 32, 2, 4, 64, 128, 4, (8, 12), 8, 4, 2)


def language_ids(vocab_size: int) -> dict[str, int]:
    """NLLB's id layout: the 202 language codes sit just below <mask> at the vocab's end."""
    from spark_jax.tokenizer.nllb_languages import FAIRSEQ_LANGUAGE_CODES

    first = vocab_size - LANGUAGE_CODES_FROM_END
    return {code: first + i for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)}


def hf_config_dict(plan: Plan) -> dict[str, Any]:
    """The M2M100 config of the plan (NLLB-200-distilled-600M's values where they apply)."""
    return dict(
        vocab_size=plan.vocab_size,
        d_model=plan.d_model,
        encoder_layers=plan.layers,
        decoder_layers=plan.layers,
        encoder_attention_heads=plan.heads,
        decoder_attention_heads=plan.heads,
        encoder_ffn_dim=plan.ffn_dim,
        decoder_ffn_dim=plan.ffn_dim,
        max_position_embeddings=plan.max_positions,
        scale_embedding=True,
        activation_function="relu",
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=0,
        decoder_start_token_id=DECODER_START,
        tie_word_embeddings=True,
    )


def make_sources(plan: Plan, seed: int = 0) -> list[list[int]]:
    """``[eng_Latn] pieces </s>`` with random sentencepiece ids, lengths in the plan's range."""
    rng = np.random.default_rng(seed)
    src_lang = language_ids(plan.vocab_size)[SRC_LANG]
    low, high = plan.source_lengths
    first_lang = plan.vocab_size - LANGUAGE_CODES_FROM_END
    sources = []
    for _ in range(plan.num_sources):
        length = int(rng.integers(low, high + 1))
        pieces = rng.integers(4, first_lang, size=length - 2).tolist()
        sources.append([src_lang, *pieces, EOS])
    return sources


# ---------------------------------------------------------------------------------------------
# The HF peer (a child process: torch alone on the device).


def run_peer(plan: Plan, weights_file: str) -> dict[str, Any]:
    """Builds the HF model, saves its weights, times HF beam and greedy generation."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        model = M2M100ForConditionalGeneration(M2M100Config(**hf_config_dict(plan)))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        eos_row = model.model.shared.weight[EOS].float()
        bias = model.model.decoder.layer_norm.bias
        bias.copy_((bias.float() - EOS_MARGIN * eos_row / eos_row.square().sum()).to(bias.dtype))
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    np.savez(weights_file, **{k: v.view(torch.int16).numpy() for k, v in state.items()})
    build_s = time.perf_counter() - start

    sources = make_sources(plan)
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sources):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    ids, mask = ids.to(device), mask.to(device)
    forced = language_ids(plan.vocab_size)[TGT_LANG]
    outputs: dict[str, list[list[int]]] = {}

    def generate(num_beams: int) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    forced_bos_token_id=forced,
                    num_beams=num_beams,
                    max_new_tokens=plan.new_tokens + 1,  # the forced language token counts
                    do_sample=False,
                    early_stopping=True,
                    length_penalty=1.0,
                )
            outputs[f"beam{num_beams}"] = out[:, 2:].tolist()  # drop [decoder_start, forced]

        return run

    results: dict[str, Any] = {"device": device, "build_and_save_s": build_s}
    results["torch"] = torch.__version__
    import transformers

    results["transformers"] = transformers.__version__
    for name, beams in (("beam", plan.num_beams), ("greedy", 1)):
        run = generate(beams)
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        results[f"{name}_first_s"] = time.perf_counter() - start
        results[f"{name}_s"] = torch_median_seconds(run, warmup=1, iters=plan.repeats)
        results[f"{name}_tokens"] = outputs[f"beam{beams}"]

    # Teacher-forced logits on HF's greedy output: the reference for our logits check.
    checked = list(range(min(2, len(sources))))
    with torch.no_grad():
        logits = []
        for i in checked:
            decoder_ids = [DECODER_START, forced, *results["greedy_tokens"][i]]
            out = model(
                input_ids=torch.tensor([sources[i]], device=device),
                decoder_input_ids=torch.tensor([decoder_ids], device=device),
            ).logits
            logits.append(out[0].float().cpu().numpy())
    np.save(weights_file + ".logits.npy", np.stack(logits))
    return results


def peer_in_subprocess(tiny: bool, weights_file: str, timeout_s: float) -> dict[str, Any]:
    out_json = weights_file + ".peer.json"
    command = [sys.executable, __file__, "--peer", weights_file, "--peer-json", out_json]
    command += ["--tiny"] if tiny else []
    proc = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the HF peer failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out_json).read_text())


# ---------------------------------------------------------------------------------------------
# Ours.


def load_ours(plan: Plan, weights_file: str) -> Any:
    """The peer's weights, bit for bit, as a spark_jax Model with a {code: id} language map."""
    import spark_jax as sj
    from spark_jax.config import config_from_hf
    from spark_jax.models import nllb

    config = config_from_hf({"model_type": "m2m_100", **hf_config_dict(plan)})
    with np.load(weights_file) as stored:
        tensors = {k: stored[k].view(jnp.bfloat16) for k in stored.files}
    params = jax.tree_util.tree_map(jnp.asarray, nllb.params_from_hf(config, tensors))
    runner = nllb.NllbRunner(config, params, language_ids(plan.vocab_size), TGT_LANG)
    return sj.Model(config, params, tokenizer=None, runner=runner)


def beam_requests(plan: Plan, sources: Sequence[Sequence[int]]) -> list[Any]:
    import spark_jax as sj

    return [
        sj.BeamRequest(
            prompt_tokens=s,
            src_lang=SRC_LANG,
            tgt_lang=TGT_LANG,
            num_beams=plan.num_beams,
            max_new=plan.new_tokens,
            length_penalty=1.0,
            early_stopping=True,
        )
        for s in sources
    ]


def greedy_params(plan: Plan) -> Any:
    import spark_jax as sj

    return sj.SamplingParams(
        temperature=0.0, max_tokens=plan.new_tokens, src_lang=SRC_LANG, tgt_lang=TGT_LANG
    )


def host_seconds_median(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn()``, whose result is already on the host (lists of ids)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def agreement(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Exact sequence matches and the mean common prefix (tokens) of two lists of outputs."""

    def prefix(a: Sequence[int], b: Sequence[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    pairs = list(zip(ours, theirs, strict=True))
    return {
        "exact": sum(list(a) == list(b) for a, b in pairs),
        "of": len(pairs),
        "mean_common_prefix": float(np.mean([prefix(a, b) for a, b in pairs])),
        "first_token_equal": sum(bool(a) and bool(b) and a[0] == b[0] for a, b in pairs),
    }


def check_lengths(outputs: Sequence[Sequence[int]], plan: Plan, side: str) -> None:
    lengths = {len(o) for o in outputs}
    has_eos = any(EOS in o for o in outputs)
    if lengths != {plan.new_tokens} or has_eos:
        raise AssertionError(
            f"{side}: output lengths {sorted(lengths)}, EOS present: {has_eos}; every output "
            f"must be {plan.new_tokens} tokens without EOS for equal work"
        )


def logits_check(model: Any, plan: Plan, peer: dict[str, Any], weights_file: str) -> dict:
    """Our teacher-forced logits against HF's on HF's greedy outputs (bf16 both sides)."""
    reference = np.load(weights_file + ".logits.npy")
    sources = make_sources(plan)
    forced = language_ids(plan.vocab_size)[TGT_LANG]
    errors, argmax_equal, positions = [], 0, 0
    for i, ref in enumerate(reference):
        decoder_ids = [DECODER_START, forced, *peer["greedy_tokens"][i]]
        ours = model.logits(sources[i], decoder_ids)
        errors.append(float(np.linalg.norm(ours - ref) / np.linalg.norm(ref)))
        argmax_equal += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        positions += len(ref)
    return {
        "relative_error_max": max(errors),
        "argmax_equal": argmax_equal,
        "positions": positions,
    }


# ---------------------------------------------------------------------------------------------
# Where a step's time goes.


class _Timer:
    """Accumulates wall time of the wrapped calls (synced when ``sync``)."""

    def __init__(self, fn: Callable[..., Any], sync: bool):
        self.fn, self.sync, self.seconds, self.calls = fn, sync, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.sync:
            jax.block_until_ready(out)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def beam_breakdown(model: Any, plan: Plan, sources: list[list[int]]) -> dict[str, float]:
    """One beam call with each part timed apart (synced), and the device step alone."""
    import spark_jax as sj
    from spark_jax.generation import beam

    runner = model.runner
    rows = beam.bucket(plan.num_sources * plan.num_beams, minimum=8)
    max_len = beam.bucket(plan.new_tokens + 2)
    width = 2 * plan.num_beams

    # The device step alone: decode + top log-probs of every row, back to back.
    state = runner.init_state(rows, max_len, max(len(s) for s in sources))
    tokens = jnp.full((rows,), 5, jnp.int32)
    active = jnp.ones((rows,), bool)

    def step(s: Any) -> Any:
        logits, s = runner.decode(s, tokens, active)
        beam._top_log_probs(logits, width)
        return s

    steps = max(1, min(16, (max_len - 4) // 4))
    decode_top_s, _, state = chain_seconds(step, state, steps, repeats=2, warmup=1)

    def reorder(s: Any) -> Any:
        return runner.reorder_rows(s, jnp.arange(rows, dtype=jnp.int32)[::-1], False)

    reorder_s, _, state = chain_seconds(reorder, state, steps, repeats=2, warmup=1)
    del state

    # One whole call with its device calls synced and timed: the prefills and the chunks of
    # on-device search steps (decode + top-k + HF bookkeeping + K/V reorder, see beam.py).
    prefill = _Timer(runner.prefill, sync=True)
    chunk = _Timer(beam._search_chunk, sync=True)
    original_chunk = beam._search_chunk
    runner.prefill, beam._search_chunk = prefill, chunk
    try:
        start = time.perf_counter()
        sj.generate_beam(model, beam_requests(plan, sources))
        total = time.perf_counter() - start
    finally:
        del runner.prefill  # the class's method again
        beam._search_chunk = original_chunk
    steps_run = plan.new_tokens  # every row runs the full length (EOS is suppressed)
    return {
        "device_step_ms": decode_top_s * 1e3,
        "reorder_alone_ms": reorder_s * 1e3,
        "synced_total_s": total,
        "prefill_s": prefill.seconds,
        "search_chunks": chunk.calls,
        "search_ms_per_step": chunk.seconds / max(steps_run, 1) * 1e3,
        "other_s": total - prefill.seconds - chunk.seconds,
    }


def greedy_breakdown(model: Any, plan: Plan, sources: list[list[int]]) -> dict[str, float]:
    """The device step alone (decode + argmax, back to back) against the engine's per step."""
    from spark_jax.generation import generate as engine

    runner = model.runner
    n = len(sources)
    max_len = engine.cache_len(max(len(s) for s in sources) + plan.new_tokens)
    state = runner.init_state(n, max_len, max(len(s) for s in sources))
    _, state = runner.prefill(state, list(range(n)), sources, [greedy_params(plan)] * n)
    tokens = jnp.full((n,), 5, jnp.int32)
    active = jnp.ones((n,), bool)

    def step(s: Any) -> Any:
        logits, s = runner.decode(s, tokens, active)
        jnp.argmax(logits, axis=-1)  # the greedy pick the engine fuses into its loop
        return s

    steps = max(1, min(32, (max_len - 8) // 4))
    step_s, _, state = chain_seconds(step, state, steps, repeats=2, warmup=1)
    del state
    prefill_state = runner.init_state(n, max_len, max(len(s) for s in sources))

    def prefill() -> Any:
        return runner.prefill(prefill_state, list(range(n)), sources, [greedy_params(plan)] * n)

    # prefill donates its state: give it a fresh one each call.
    times = []
    for _ in range(3):
        prefill_state = runner.init_state(n, max_len, max(len(s) for s in sources))
        _, seconds = timed(prefill)
        times.append(seconds)
    out = {"device_step_ms": step_s * 1e3, "prefill_ms": statistics.median(times) * 1e3}
    return out | engine_split(model, plan, sources)


def engine_split(model: Any, plan: Plan, sources: list[list[int]], repeats: int = 3) -> dict:
    """Where one ``generate_batch`` call's time goes: its device calls synced and timed apart.

    ``loop_ms_per_step``: the engine's device loop (``_decode_chunk``: decode, argmax and stop
    checks, up to STEPS_PER_SYNC steps per call, its dispatch included) per decode step;
    against ``device_profile``'s ``greedy_len256_device_ms_per_step`` (the same step in a
    fixed-count loop) it shows what the loop's per-call and per-step syncs add.
    ``host_ms_per_step``: the rest of the call (Python bookkeeping, cache allocation,
    transfers) per generated token. Medians of ``repeats`` calls; syncing removes the little
    host/device overlap the engine has, so the parts add up to slightly more than ``ours_s``.
    """
    import spark_jax as sj
    from spark_jax.generation import generate as engine

    runner = model.runner
    prefill = _Timer(runner.prefill, sync=True)
    pick = _Timer(engine._pick, sync=True)
    chunk = _Timer(engine._decode_chunk, sync=True)
    originals = engine._pick, engine._decode_chunk
    runner.prefill, engine._pick, engine._decode_chunk = prefill, pick, chunk
    rows = []
    try:
        for _ in range(repeats):
            for timer in (prefill, pick, chunk):
                timer.seconds, timer.calls = 0.0, 0
            start = time.perf_counter()
            sj.generate_batch(model, sources, greedy_params(plan))
            total = time.perf_counter() - start
            device = prefill.seconds + pick.seconds + chunk.seconds
            rows.append((total, prefill.seconds, pick.seconds, chunk.seconds, chunk.calls, device))
    finally:
        del runner.prefill  # the class's method again
        engine._pick, engine._decode_chunk = originals
    total, prefill_s, pick_s, chunk_s, calls, device = np.median(np.array(rows), axis=0)
    decode_steps = plan.new_tokens - 1  # the first token comes from the prefill's logits
    return {
        "synced_total_ms": total * 1e3,
        "prefill_synced_ms": prefill_s * 1e3,
        "first_pick_ms": pick_s * 1e3,
        "loop_calls": int(calls),
        "loop_ms_per_step": chunk_s / decode_steps * 1e3,
        "host_ms": (total - device) * 1e3,
        "host_ms_per_step": (total - device) / plan.new_tokens * 1e3,
    }


_KERNEL_OPS = ("fusion(", "custom-call(", "gather(", "scatter(", "dot(", "convolution(")


def _entry_lines(compiled_text: str) -> list[str]:
    """The kernel-launching instruction lines of the compiled ENTRY block."""
    entry = compiled_text[compiled_text.index("ENTRY") :]
    entry = entry[: entry.find("\n}")]
    return [line for line in entry.splitlines() if any(k in line for k in _KERNEL_OPS)]


def _entry_kernels(compiled_text: str) -> int:
    """Kernel-launching instructions (fusions, library calls) of the compiled ENTRY block."""
    return len(_entry_lines(compiled_text))


def _kernel_kinds(compiled_text: str) -> dict[str, int]:
    """Those instructions counted by kind: a fusion's kind and the name XLA gave it (loop,
    input reduction, triton_softmax, gemm fusion, ...), a custom call's target (cuBLAS,
    cuDNN). Says which of a step's kernels a change should remove."""
    counts: dict[str, int] = {}
    for line in _entry_lines(compiled_text):
        name = line.split("=")[0].strip().lstrip("%").rstrip("0123456789.")
        if "custom_call_target=" in line:
            kind = "custom-call:" + line.split('custom_call_target="')[1].split('"')[0]
        elif "kind=" in line:
            kind = line.split("kind=")[1].split(",")[0] + ":" + name
        else:
            kind = name
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


@partial(jax.jit, static_argnames=("config", "steps", "width"))
def _decode_loop(params, config, tokens, active, cache, steps: int, width: int):
    """``steps`` decode steps and picks in one device loop: the step's time without dispatch."""
    from spark_jax.models import nllb

    def body(_, carry):
        cache, tokens = carry
        logits, cache = nllb.decode(params, config, tokens, active, cache)
        if width:
            _, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), -1), width)
            return cache, ids[:, 0]
        return cache, jnp.argmax(logits, -1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, tokens))


@partial(jax.jit, static_argnames=("steps",))
def _reorder_loop(cache, source_rows, steps: int):
    return jax.lax.fori_loop(0, steps, lambda _, c: c.gather_rows(source_rows, False), cache)


def _loop_ms_per_step(run: Callable[[int], Any], steps: int) -> float:
    """Device ms per step of ``run(k)`` (k steps in one launch): (T(2k) - T(k)) / k."""
    jax.block_until_ready(run(steps))
    jax.block_until_ready(run(2 * steps))
    _, one = timed(lambda: run(steps))
    _, two = timed(lambda: run(2 * steps))
    return (two - one) / steps * 1e3


def _xla_attention_ms(run: Callable[..., Any], steps: int) -> float:
    """The step of ``run`` with every attention through the jnp reference instead of cuDNN."""
    from spark_jax.ops.attention import forced_implementation

    jax.clear_caches()  # the dispatch acts at trace time: trace the step again
    try:
        with forced_implementation("xla"):
            return _loop_ms_per_step(lambda k: run(steps=k), steps)
    finally:
        jax.clear_caches()


def device_profile(model: Any, plan: Plan, sources: list[list[int]]) -> dict[str, Any]:
    """Per-step device time with no dispatch (fori_loop), dispatch cost, kernels per step."""
    from spark_jax.models import nllb

    runner, out = model.runner, {}
    src_max = max(len(s) for s in sources)
    n = len(sources)
    steps = max(2, min(32, plan.new_tokens // 2))
    cases = [
        ("greedy_len256", n, 256, 0),
        ("greedy_len128", n, 128, 0),
        ("beam_len128", n * plan.num_beams, 128, 2 * plan.num_beams),
    ]
    for name, rows, max_len, width in cases:
        max_len = min(max_len, max(nllb.bucket(3 * steps + 2), nllb.bucket(plan.new_tokens + 2)))
        state = runner.init_state(rows, max_len, src_max)
        tokens = jnp.full((rows,), 5, jnp.int32)
        active = jnp.ones((rows,), bool)
        run = partial(_decode_loop, model.params, model.config, tokens, active, state, width=width)
        out[f"{name}_device_ms_per_step"] = _loop_ms_per_step(lambda k, r=run: r(steps=k), steps)
        if name == "greedy_len256":
            compiled = nllb.decode.lower(model.params, model.config, tokens, active, state)
            text = compiled.compile().as_text()
            out["decode_kernels_per_step"] = _entry_kernels(text)
            out["decode_kernel_kinds"] = _kernel_kinds(text)
            out["decode_argument_arrays"] = len(jax.tree_util.tree_leaves((model.params, state)))
            # Where the step's time goes, kernel by kind, and the gaps between kernels.
            out["greedy_len256_kernels"] = kernel_profile(lambda r=run: r(steps=steps), per=steps)
            out["greedy_len256_xla_attention_ms_per_step"] = _xla_attention_ms(run, steps)
            calls = []
            for _ in range(8):
                start = time.perf_counter()
                _, state = runner.decode(state, tokens, active)
                calls.append(time.perf_counter() - start)
            jax.block_until_ready(state)
            out["decode_dispatch_ms"] = statistics.median(calls[2:]) * 1e3
        if name.startswith("beam"):
            rows_reversed = jnp.arange(rows, dtype=jnp.int32)[::-1]
            # Rows halfway through the search: the reorder moves only each row's used prefix,
            # so a fresh cache (lengths 0) would time a reorder that moves nothing.
            halfway = jnp.full((rows,), plan.new_tokens // 2 + 2, jnp.int32)
            state = dataclasses.replace(state, lengths=halfway)
            run = partial(_reorder_loop, state, rows_reversed)
            out["reorder_device_ms"] = _loop_ms_per_step(lambda k, r=run: r(steps=k), steps)
    return out


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--repeats", type=int, default=0, help="timed calls per mode")
    parser.add_argument("--peer", default="", help=argparse.SUPPRESS)
    parser.add_argument("--peer-json", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = TINY if args.tiny else FULL
    if args.repeats:
        plan = Plan(**{**plan.__dict__, "repeats": args.repeats})
    if args.peer:
        Path(args.peer_json).write_text(json.dumps(run_peer(plan, args.peer)))
        return

    import spark_jax as sj

    t0 = time.perf_counter()
    weights_file = os.path.join(tempfile.mkdtemp(prefix="nllb_bench_"), "weights.npz")
    peer = peer_in_subprocess(args.tiny, weights_file, timeout_s=400)
    peer_s = time.perf_counter() - t0
    check_lengths(peer["beam_tokens"], plan, "HF beam")
    check_lengths(peer["greedy_tokens"], plan, "HF greedy")

    results: dict[str, Any] = {"benchmark": "nllb", "tiny": args.tiny, "plan": plan.__dict__}
    results["device"] = str(jax.devices()[0].device_kind)
    results["jax"] = jax.__version__
    results["peer_versions"] = {k: peer[k] for k in ("torch", "transformers", "device")}
    model, load_s = timed(lambda: load_ours(plan, weights_file))
    results["load_s"] = load_s
    sources = make_sources(plan)
    results["source_len_mean"] = float(np.mean([len(s) for s in sources]))

    def beam() -> list[list[int]]:
        return [r.sequences[0] for r in sj.generate_beam(model, beam_requests(plan, sources))]

    def greedy() -> list[list[int]]:
        return [r.output_tokens for r in sj.generate_batch(model, sources, greedy_params(plan))]

    def greedy_fixed_chunks() -> list[list[int]]:
        """Greedy with every device chunk running all its steps (no predicate read back per
        step: ``engine.CHUNKS_EXIT_EARLY = False``), against the same HF greedy figure."""
        from spark_jax.generation import generate as engine

        saved, engine.CHUNKS_EXIT_EARLY = engine.CHUNKS_EXIT_EARLY, False
        try:
            return greedy()
        finally:
            engine.CHUNKS_EXIT_EARLY = saved

    rows = []
    modes = (("beam", beam), ("greedy", greedy), ("greedy_fixed_chunks", greedy_fixed_chunks))
    for name, fn in modes:
        peer_name = name.removesuffix("_fixed_chunks")
        tokens, first_s = timed(fn)
        check_lengths(tokens, plan, f"ours {name}")
        seconds = host_seconds_median(fn, plan.repeats)
        hf_s = peer[f"{peer_name}_s"]
        results[name] = {
            "ours_s": seconds,
            "ours_first_call_s": first_s,
            "ours_compile_s_approx": first_s - seconds,
            "ours_sentences_per_s": plan.num_sources / seconds,
            "hf_s": hf_s,
            "hf_first_call_s": peer[f"{peer_name}_first_s"],
            "hf_sentences_per_s": plan.num_sources / hf_s,
            "speedup": hf_s / seconds,
            "target": 5.0 if name == "beam" else 10.0,
            "agreement_with_hf": agreement(tokens, peer[f"{peer_name}_tokens"]),
        }
        r = results[name]
        rows.append(
            [
                name,
                seconds,
                r["ours_sentences_per_s"],
                hf_s,
                r["hf_sentences_per_s"],
                r["speedup"],
                r["target"],
                first_s,
                f"{r['agreement_with_hf']['exact']}/{plan.num_sources}",
            ]
        )
    results["logits_check"] = logits_check(model, plan, peer, weights_file)
    results["breakdown"] = {
        "beam": beam_breakdown(model, plan, sources),
        "greedy": greedy_breakdown(model, plan, sources),
        "device": device_profile(model, plan, sources),
    }
    g = results["breakdown"]["greedy"]
    g["engine_ms_per_step"] = results["greedy"]["ours_s"] / plan.new_tokens * 1e3
    results["wall_s"] = time.perf_counter() - t0
    results["peer_wall_s"] = peer_s
    emit(results, "nllb")
    print_table(
        ["mode", "ours_s", "ours_sent/s", "hf_s", "hf_sent/s", "x_hf", "target", "first_s", "=hf"],
        rows,
    )
    b = results["breakdown"]["beam"]
    print(
        f"beam: decode+top-k alone {b['device_step_ms']:.2f} ms/step, reorder alone "
        f"{b['reorder_alone_ms']:.2f} ms; whole call synced: search {b['search_ms_per_step']:.2f}"
        f" ms/step in {b['search_chunks']} chunks, prefill {b['prefill_s'] * 1e3:.1f} ms,"
        f" other {b['other_s'] * 1e3:.1f} ms"
    )
    d = results["breakdown"]["device"]
    print(
        f"greedy step: device {g['device_step_ms']:.2f} ms, engine {g['engine_ms_per_step']:.2f}"
        f" ms/step, prefill {g['prefill_ms']:.1f} ms; logits check {results['logits_check']}"
    )
    print(
        f"greedy call synced {g['synced_total_ms']:.1f} ms = prefill {g['prefill_synced_ms']:.1f}"
        f" + first pick {g['first_pick_ms']:.1f} + device loop {g['loop_ms_per_step']:.3f} ms/step"
        f" x {plan.new_tokens - 1} in {g['loop_calls']} calls (the step alone, fixed-count loop:"
        f" {d['greedy_len256_device_ms_per_step']:.3f}) + host {g['host_ms']:.1f} ms"
        f" ({g['host_ms_per_step']:.3f} ms/token)"
    )
    kernels = d.get("greedy_len256_kernels", {})
    if "by_kind_count_us" in kernels:
        kinds = list(kernels["by_kind_count_us"].items())[:10]
        print(
            f"greedy step kernels: {kernels['kernels']:.0f}, busy {kernels['busy_us']:.0f} us,"
            f" span {kernels['span_us']:.0f} us; by kind [count, us]: {kinds}"
        )
    print(f"device profile: {results['breakdown']['device']}")


if __name__ == "__main__":
    main()
