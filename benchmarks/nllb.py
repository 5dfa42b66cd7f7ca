"""NLLB translation speed through the public API against HF transformers: greedy and beam 4.

    python -m benchmarks nllb            # on the H200: NLLB-200-distilled-600M shapes, ~2 min
    python -m benchmarks nllb --tiny     # a tiny config on any backend, seconds

Shapes of NLLB-200-distilled-600M (d_model 1024, 12 + 12 layers, 16 heads, ffn 4096, vocab
256206), random bf16 weights drawn by HF's own init. The HF peer runs first, in a process of
its own (JAX and torch never share the GPU): it builds ``M2M100ForConditionalGeneration``
on the device, saves its weights (raw bits) for this process, and times
``generate(num_beams=4, max_new_tokens=65, forced_bos_token_id=...)`` and greedy with CUDA
events, median of ``repeats``. This process loads the very same bits and times
``sj.generate_beam`` (num_beams 4, max_new 64) and ``sj.generate_batch`` (temperature 0,
max_tokens 64) on the same 32 sources of 26-34 tokens, eng_Latn to fra_Latn: the first call
(compiles) apart, then the median of ``repeats`` calls; and greedy again with every device
chunk running all its steps (``LoopOptions(exit_early=False)``, where the tree has it).

Equal work on both sides: random weights may pick EOS at any step. The peer lowers EOS's
logit by ``EOS_MARGIN`` through the decoder's final LayerNorm bias (the LM head is tied: the
bias moves along EOS's embedding row), so neither side picks EOS and both generate the full
64 tokens with their default generation paths; every output is checked to hold 64 tokens.
Correctness in the same run: our tokens against HF's (bf16 on both sides: near-ties may flip
a token and the continuation with it) and our teacher-forced logits against HF's. With
``--no-peer`` the HF process still draws and saves the weights, but times nothing.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    Report,
    Unsupported,
    host_median_seconds,
    loop_options,
    peer_in_subprocess,
    ratio,
    torch_available,
    torch_median_seconds,
)

EOS, PAD, DECODER_START = 2, 1, 2
EOS_MARGIN = 40.0  # logits of random bf16 weights spread ~0.6: EOS is never picked
LANGUAGE_CODES_FROM_END = 205  # NLLB: 202 codes from vocab - 205 (256001), then <mask>, ...
SRC_LANG, TGT_LANG = "eng_Latn", "fra_Latn"
WEIGHTS_ONLY = "weights-only:"


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
    try:
        from spark_jax.tokenizer.nllb_languages import FAIRSEQ_LANGUAGE_CODES
    except ImportError:  # a tree from before the tokenizer package (for --against)
        from spark_jax.nllb_languages import FAIRSEQ_LANGUAGE_CODES

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


def peer(tiny: bool, arg: str) -> dict[str, Any]:
    """Builds the HF model, saves its weights to ``arg`` and times HF beam and greedy
    generation (only saves them when ``arg`` starts with ``weights-only:``)."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    plan = TINY if tiny else FULL
    weights_only = arg.startswith(WEIGHTS_ONLY)
    weights_file = arg.removeprefix(WEIGHTS_ONLY)

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
    if weights_only:
        return {"build_and_save_s": build_s}

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


def load_ours(plan: Plan, weights_file: str) -> Any:
    """The peer's weights, bit for bit, as an ``sj.Model`` with a {code: id} language map."""
    import spark_jax as sj
    from spark_jax.config import config_from_hf
    from spark_jax.models import nllb, params_from_hf

    config = config_from_hf({"model_type": "m2m_100", **hf_config_dict(plan)})
    with np.load(weights_file) as stored:
        tensors = {k: stored[k].view(jnp.bfloat16) for k in stored.files}
    params = jax.tree_util.tree_map(jnp.asarray, params_from_hf(config, tensors))
    # The runner maps language codes to ids with a plain dict (no tokenizer to detokenize).
    runner = nllb.NllbRunner(config, params, language_ids(plan.vocab_size), TGT_LANG)
    return sj.Model(config, params, tokenizer=None, runner=runner)


def run(tiny: bool, peer: bool = True) -> Report:
    import spark_jax as sj

    plan = TINY if tiny else FULL
    report = Report()
    if not torch_available():
        raise Unsupported("the nllb suite draws its weights with HF: torch/transformers needed")
    weights_file = os.path.join(tempfile.mkdtemp(prefix="nllb_bench_"), "weights.npz")
    arg = weights_file if peer else WEIGHTS_ONLY + weights_file
    hf = peer_in_subprocess("nllb", tiny, timeout_s=900, arg=arg)
    if "error" in hf:
        raise RuntimeError(f"the HF process failed:\n{hf['error']}")
    if peer:
        check_lengths(hf["beam_tokens"], plan, "HF beam")
        check_lengths(hf["greedy_tokens"], plan, "HF greedy")
    else:
        report.notes.append("HF peer left out (--no-peer); weights still drawn by HF")
    model = load_ours(plan, weights_file)
    sources = make_sources(plan)
    requests = beam_requests(plan, sources)
    sampling = greedy_params(plan)

    def beam() -> list[list[int]]:
        return [r.sequences[0] for r in sj.generate_beam(model, requests)]

    def greedy(**loop: Any) -> Callable[[], list[list[int]]]:
        return lambda: [
            r.output_tokens for r in sj.generate_batch(model, sources, sampling, **loop)
        ]

    modes: list[tuple[str, str, Callable[[], list[list[int]]]]] = [
        ("beam", "beam", beam),
        ("greedy", "greedy", greedy()),
    ]
    try:
        modes.append(("greedy_fixed_chunks", "greedy", greedy(**loop_options(exit_early=False))))
    except Unsupported as why:
        report.notes.append(f"greedy_fixed_chunks skipped: {why}")
    table = [["mode", "ours s", "ours sent/s", "HF s", "HF sent/s", "x HF", "first s", "=HF"]]
    for name, peer_name, fn in modes:
        start = time.perf_counter()
        tokens = fn()
        first_s = time.perf_counter() - start
        check_lengths(tokens, plan, f"ours {name}")
        seconds, tokens = host_median_seconds(fn, plan.repeats)
        report.figures[f"{name}_sent_s"] = plan.num_sources / seconds
        report.details[f"{name}_s"] = seconds
        report.details[f"{name}_first_call_s"] = first_s
        hf_s = hf.get(f"{peer_name}_s")
        same = None
        if hf_s:
            report.peers[f"hf_{peer_name}_sent_s"] = plan.num_sources / hf_s
            report.ratios[f"{name}_over_hf"] = ratio(hf_s, seconds)
            same = agreement(tokens, hf[f"{peer_name}_tokens"])
            report.details[f"{name}_agreement_with_hf"] = same
        table.append(
            [
                name,
                seconds,
                plan.num_sources / seconds,
                hf_s,
                plan.num_sources / hf_s if hf_s else None,
                report.ratios.get(f"{name}_over_hf"),
                first_s,
                f"{same['exact']}/{same['of']}" if same else None,
            ]
        )
    if peer:
        report.details["logits_check"] = logits_check(model, plan, hf, weights_file)
        report.details["hf"] = {k: v for k, v in hf.items() if not k.endswith("_tokens")}
    Path(weights_file).unlink(missing_ok=True)
    report.details["plan"] = plan.__dict__
    report.table = table
    return report
