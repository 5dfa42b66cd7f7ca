"""Guided decoding's cost: a batch with JSON-schema rows against the same batch unconstrained.

    python -m benchmarks guided            # H200: Llama-3-8B shapes, B=64, ~3 minutes
    python -m benchmarks guided --tiny     # any backend, seconds

Random bf16 weights and a synthetic byte-level BPE tokenizer of the model's vocabulary size
(128,256 tokens: the 256 bytes, then merges of existing tokens with one more character, biased
to letters, none longer than 8 bytes; the mask work of llguidance scales with the vocabulary's
token trie, so its shape matters more than its words). ``sj.generate_batch`` of 64 prompts of
512 random tokens, 64 new tokens each, greedy:

- free: every row unconstrained (EOS ignored), the default device loop (8 steps per sync);
- free_sync1: the same with one step per sync (a guided batch's sync pattern, no masks);
- split: the free rows through the guided loop's shape (``LoopOptions(split_step=True)``):
  each step two programs, the forward then the pick, with an all-ones mask uploaded between
  them; no grammar. Against free_sync1 it is the cost of that shape; guided against it, the
  cost of the grammars' work;
- guided: half the rows held to a JSON schema, the other half free. The schema's first field
  is a string of at least 9 bytes per step, so every guided row stays constrained (its mask
  computed on the host each step) for the whole run.

Each figure is the decode-phase time per step (after the first token), the median of 3 warm
calls after one that compiles. ``guided_overhead`` is guided over free, minus 1 (the target:
<= 0.10). Also measured apart: the host's matcher work per step for the guided rows
(``advance`` then ``fill_bitmask``), which the guided loop overlaps with the step's forward.

Where the host's time goes, per step of the same median call (the loop's ``timings``): how
long it waited for the device's tokens, dispatched the steps, filled and uploaded the masks.
A variant whose host waits ~0 is bound by the host (the device waits for it instead): its
step time is the host's work, and the step minus the wait is the host's busy time.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import Report, llama, random_params, random_prompts


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    batch: int = 64
    prompt: int = 512
    new_tokens: int = 64
    repeats: int = 3


FULL = Plan()
TINY = Plan(batch=8, prompt=16, new_tokens=16, repeats=2)
EOS = "<|end_of_text|>"
LONGEST_TOKEN = 8  # bytes


def synthetic_tokenizer(vocab_size: int, directory: Path, seed: int = 0) -> Any:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` tokens (the last one EOS)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from spark_jax.tokenizer import Tokenizer

    spelled = _byte_chars()  # one character per byte, so a token's length is its bytes'
    if set(spelled) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the byte alphabet differs from the tokenizers library's")
    tokens = list(spelled)
    vocab = {t: i for i, t in enumerate(tokens)}
    # Appended characters: letters often, else digits, space, punctuation (JSON's included).
    letters = [spelled[b] for b in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    others = [spelled[b] for b in b" 0123456789.,:;\"'{}[]()-_/!?"]
    rng = np.random.default_rng(seed)
    merges = []
    while len(tokens) < vocab_size - 1:
        first = tokens[int(rng.integers(0, len(tokens)))]
        pool = letters if rng.random() < 0.8 else others
        merged = first + pool[int(rng.integers(0, len(pool)))]
        if merged in vocab or len(merged) > LONGEST_TOKEN:
            continue
        vocab[merged] = len(tokens)
        tokens.append(merged)
        merges.append((first, merged[-1]))
    hf_tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tokenizer.decoder = decoders.ByteLevel()
    hf_tokenizer.add_special_tokens([AddedToken(EOS, special=True)])
    hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    tokenizer = Tokenizer.from_dir(directory)
    if tokenizer.vocab_size != vocab_size:
        raise RuntimeError(f"built {tokenizer.vocab_size} tokens, wanted {vocab_size}")
    return tokenizer


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte, in byte order."""
    kept = [b for b in range(256) if chr(b).isprintable() and b not in (0x20, 0xA0, 0xAD)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def schema(new_tokens: int) -> dict[str, Any]:
    """An object whose first field, a string, outlasts ``new_tokens`` steps of any tokens."""
    longest = LONGEST_TOKEN + 1  # a token may be one character past the string's end
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": longest * (new_tokens + 1)},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
            "score": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["name", "tags", "score"],
    }


@dataclass(frozen=True)
class StepTime:
    """One call's decode phase per step (ms): its time, and the host's waits for the device,
    its dispatches and its mask work within it (None: the tree under test does not say)."""

    step: float
    wait: float | None
    dispatch: float | None
    mask: float | None

    @classmethod
    def of(cls, results: list[Any]) -> StepTime:
        """The time after the first token over the steps after the first."""
        timings = results[0].timings
        steps = max(len(r.output_tokens) for r in results) - 1
        per_step = lambda key: timings[key] / steps * 1e3 if key in timings else None
        return cls(
            (timings["total_s"] - timings["ttft_s"]) / steps * 1e3,
            per_step("wait_s"),
            per_step("dispatch_s"),
            per_step("mask_s"),
        )

    def row(self, label: str, free: StepTime) -> list[Any]:
        return [label, self.step, self.step / free.step - 1.0, self.wait, self.dispatch, self.mask]


def measure(call: Any, repeats: int) -> tuple[StepTime, list[Any]]:
    """One call that compiles, then the call of the median step time of ``repeats``."""
    call()
    measured = []
    for _ in range(repeats):
        results = call()
        measured.append((StepTime.of(results), results))
    measured.sort(key=lambda m: m[0].step)
    return measured[len(measured) // 2]


def host_mask_ms(model: Any, params: list[Any], outputs: list[list[int]]) -> tuple[float, bool]:
    """The guided rows' host work per step, replayed: each row advances by its output token,
    then the batch's bitmask is filled (the median over the steps); and whether every output
    kept its grammar (no matcher failed)."""
    from spark_jax.generation.guided import fill_bitmask, guided_row

    guides = [guided_row(model, p) for p in params]
    vocab = model.config.vocab_size
    times = []
    for step in range(min(len(o) for o in outputs)):
        start = time.perf_counter()
        for guide, output in zip(guides, outputs, strict=True):
            guide.advance(output[step])
        fill_bitmask(guides, vocab)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3, not any(g.error for g in guides)


def run(tiny: bool, peer: bool = True) -> Report:
    """The unconstrained batch is this suite's peer: always measured."""
    import spark_jax as sj

    plan = TINY if tiny else FULL
    config, dtype = llama(tiny)
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = synthetic_tokenizer(config.vocab_size, Path(scratch))
    model = sj.Model(config, random_params(config, dtype), tokenizer)
    prompts = random_prompts(config.vocab_size - 1, plan.batch, plan.prompt, seed=2)
    free = sj.SamplingParams(temperature=0.0, max_tokens=plan.new_tokens, ignore_eos=True)
    constraint = sj.GuidedDecodingParams(json=schema(plan.new_tokens))
    half = plan.batch // 2
    guided = [sj.SamplingParams(temperature=0.0, max_tokens=plan.new_tokens, guided=constraint)]
    mixed = guided * half + [free] * (plan.batch - half)
    one_step = sj.LoopOptions(steps_per_sync=1)
    try:
        split_step = sj.LoopOptions(split_step=True)
    except TypeError:  # a tree from before the option
        split_step = None

    report = Report()
    free_t, _ = measure(lambda: sj.generate_batch(model, prompts, free), plan.repeats)
    sync1_t, free_results = measure(
        lambda: sj.generate_batch(model, prompts, free, loop=one_step), plan.repeats
    )
    split_t = None
    if split_step is not None:
        split_t, split_results = measure(
            lambda: sj.generate_batch(model, prompts, free, loop=split_step), plan.repeats
        )
        if [r.output_tokens for r in split_results] != [r.output_tokens for r in free_results]:
            report.notes.append("the split steps changed the free rows' tokens: check failed")
    else:
        report.notes.append("split: this tree has no LoopOptions.split_step")
    guided_t, results = measure(lambda: sj.generate_batch(model, prompts, mixed), plan.repeats)
    outputs = [r.output_tokens for r in results[:half]]
    mask_ms, kept = host_mask_ms(model, mixed[:half], outputs)

    report.figures["guided_ms_step"] = guided_t.step
    report.figures["host_mask_ms_step"] = mask_ms
    report.peers["free_ms_step"] = free_t.step
    report.peers["free_sync1_ms_step"] = sync1_t.step
    report.ratios["guided_overhead"] = guided_t.step / free_t.step - 1.0
    report.ratios["guided_over_sync1"] = guided_t.step / sync1_t.step - 1.0
    if split_t is not None:
        report.figures["split_ms_step"] = split_t.step
        report.ratios["split_over_sync1"] = split_t.step / sync1_t.step - 1.0
        report.ratios["guided_over_split"] = guided_t.step / split_t.step - 1.0
    still_guided = sum(r.finish_reason == "length" for r in results[:half])
    variants = {"free": free_t, "free_sync1": sync1_t, "split": split_t, "guided": guided_t}
    report.details = {
        "plan": plan.__dict__,
        "guided_rows": half,
        "guided_rows_constrained_to_the_end": still_guided,
        "guided_text_sample": results[0].text[:80] if results[0].text else "",
        "host_ms_per_step": {k: t.__dict__ for k, t in variants.items() if t is not None},
    }
    if still_guided != half:
        report.notes.append(f"only {still_guided} of {half} guided rows ran every step")
    if not kept:
        report.notes.append("a guided row picked a token its grammar forbids: check failed")
    report.table = [
        ["batch", "ms/step", "vs free", "host waits", "dispatch", "masks"],
        free_t.row(f"free, {plan.batch} rows, 8 steps/sync", free_t),
        sync1_t.row(f"free, {plan.batch} rows, 1 step/sync", free_t),
    ]
    if split_t is not None:
        report.table.append(split_t.row("free, split steps (all-ones masks)", free_t))
    report.table += [
        guided_t.row(f"{half} JSON-schema rows + {plan.batch - half} free", free_t),
        [f"host matcher work, {half} rows (overlapped)", mask_ms, None, None, None, None],
    ]
    return report
