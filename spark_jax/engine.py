"""Host loops over the jitted steps: generate, stream, generate_streaming, generate_batch.

The seed engine's shape: prefill → decode → pick → stop check, with every sequence's slot
given back on every path, errors included. The loop is plain Python and imports no model
file: it drives the ``Runner`` protocol of ``spark_jax.model``. Each step it dispatches the
next decode before reading the previous step's tokens, so the host's stop checks overlap the
device's work, and it copies only token ids (and logprobs when asked) to the host.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.sampling import SampleOutput, SamplerBatch, SamplingParams, count_tokens, sample
from spark_jax.tokenizer import IncrementalDetokenizer

MIN_CACHE_LEN = 256


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class GenerationResult:
    """What one request produced."""

    output_tokens: list[int]
    finish_reason: str  # "stop" | "length"
    text: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamOutput:
    """One streamed token: its id, the text it completes (may be empty) and its logprobs."""

    index: int  # which request of the batch
    token_id: int
    text_delta: str
    logprobs: TokenLogprobs | None = None


def cache_len(n: int) -> int:
    """The cache-length ladder: powers of two from MIN_CACHE_LEN, so decode compiles rarely."""
    size = MIN_CACHE_LEN
    while size < n:
        size *= 2
    return size


# ---------------------------------------------------------------------------------------------
# Device-side picking: one jitted function per step, so changing parameters never recompiles.


@partial(jax.jit, donate_argnames=("token_counts",))
def _pick(logits, batch: SamplerBatch, token_counts, prompt_mask, num_generated, active):
    out = sample(logits, batch, token_counts, prompt_mask, num_generated)
    token_counts = count_tokens(token_counts, out.tokens, active)
    return out, token_counts, num_generated + active.astype(jnp.int32)


@jax.jit
def _pick_greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _plain_greedy(params: SamplingParams) -> bool:
    """True when the token is the plain argmax: no penalties, biases or logprobs to compute."""
    return (
        params.greedy
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and not params.logit_bias
        and params.min_tokens == 0
        and params.logprobs is None
    )


# ---------------------------------------------------------------------------------------------
# Host-side bookkeeping of one request.


class _Request:
    """One row's output so far: tokens, text, stop checks."""

    def __init__(self, index: int, prompt: Sequence[int], params: SamplingParams, model: Any):
        self.index = index
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        eos = () if params.ignore_eos else model.eos_token_ids
        self.stop_ids = frozenset(params.stop_token_ids) | frozenset(eos)
        self.detok = None
        if model.tokenizer is not None:
            self.detok = IncrementalDetokenizer(model.tokenizer)
        self.text = ""  # text decoded so far (before stop-string truncation)
        self.emitted = 0  # characters of text already streamed
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Text that might be the start of a stop string is held back from the stream.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def add(self, token: int, logprobs: TokenLogprobs | None) -> str:
        """Records one token; returns the text it releases to the stream."""
        self.tokens.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detok is not None:
            self.text += self.detok.add(token)
        counted = len(self.tokens) >= self.params.min_tokens
        if token in self.stop_ids and counted:
            self._finish("stop", token)
        elif self.params.stop and counted and self._match_stop_string():
            pass
        elif len(self.tokens) >= self.params.max_tokens:
            self._finish("length", None)
        return self._release()

    def _match_stop_string(self) -> bool:
        window = self.text[max(0, self.emitted - self.holdback) :]
        offset = len(self.text) - len(window)
        best = None
        for stop in self.params.stop:
            at = window.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        self.text = self.text[: offset + best[0]]
        self._finish("stop", best[1])
        return True

    def _finish(self, reason: str, stop: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop
        if self.detok is not None and not isinstance(stop, str):
            self.text += self.detok.finish()

    def _release(self) -> str:
        end = (
            len(self.text)
            if self.finish_reason
            else max(self.emitted, len(self.text) - self.holdback)
        )
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def result(self, timings: dict[str, float]) -> GenerationResult:
        return GenerationResult(
            output_tokens=self.tokens,
            finish_reason=self.finish_reason or "length",
            text=self.text if self.detok is not None else None,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            timings=timings,
        )


def _token_logprobs(out: dict[str, np.ndarray], row: int, n: int) -> TokenLogprobs:
    top = {
        int(i): float(v)
        for i, v in zip(out["top_ids"][row, :n], out["top_logprobs"][row, :n], strict=True)
    }
    return TokenLogprobs(int(out["tokens"][row]), float(out["logprobs"][row]), top)


# ---------------------------------------------------------------------------------------------
# The loop.


def _as_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each.")
    return list(params)


def _check_prompts(model: Any, prompts: Sequence[Sequence[int]], params: list[SamplingParams]):
    vocab = model.config.vocab_size
    limit = model.config.max_position_embeddings
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty; give at least one token.")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids {bad[:5]} outside [0, {vocab}).")
        if not model.config.is_encoder_decoder and len(prompt) + p.max_tokens > limit:
            raise ValueError(
                f"prompt {i} has {len(prompt)} tokens and asks for {p.max_tokens} more, past the "
                f"model's {limit} positions; shorten the prompt or lower max_tokens."
            )


def stream_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    results: list[GenerationResult] | None = None,
) -> Iterator[StreamOutput]:
    """Generates for every prompt as one batch, yielding each token as it is produced.

    When ``results`` is given, it is filled with one GenerationResult per prompt at the end.
    """
    prompts = [[int(t) for t in p] for p in prompts]
    plist = _as_list(params, len(prompts))
    _check_prompts(model, prompts, plist)
    runner = model.runner
    adapters = [model.adapter_slot(p.adapter) for p in plist]  # unknown names fail here
    slots = model.slot_pool.acquire(len(prompts))
    try:
        yield from _run_loop(model, runner, prompts, plist, adapters, results)
    finally:
        model.slot_pool.release(slots)


def _run_loop(model, runner, prompts, plist, adapters, results):
    t0 = time.perf_counter()
    n = len(prompts)
    rows = [_Request(i, p, sp, model) for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
    max_len = cache_len(max(len(p) + sp.max_tokens for p, sp in zip(prompts, plist, strict=True)))
    state = runner.init_state(n, max_len, max(len(p) for p in prompts))
    # Adapters go to the runner only when a pool exists, so plain models keep one compile.
    lora = {} if model.lora_pool is None else {"adapters": adapters}
    logits, state = runner.prefill(state, list(range(n)), prompts, plist, **lora)
    vocab = logits.shape[-1]

    fast = all(_plain_greedy(p) for p in plist)
    want_logprobs = any(p.logprobs is not None for p in plist)
    if fast:
        pick = _pick_greedy
        out: Any = pick(logits)
    else:
        batch = SamplerBatch.from_params(plist, vocab, model.eos_token_ids)
        counts = jnp.zeros((n, vocab), jnp.int32)
        prompt_mask = np.zeros((n, vocab), bool)
        for i, p in enumerate(prompts):
            prompt_mask[i, p] = True
        prompt_mask = jnp.asarray(prompt_mask)
        num_generated = jnp.zeros((n,), jnp.int32)
        active_dev = jnp.ones((n,), bool)
        out, counts, num_generated = _pick(
            logits, batch, counts, prompt_mask, num_generated, active_dev
        )

    active = np.ones(n, bool)
    timings: dict[str, float] = {}
    steps = 0
    while True:
        tokens_dev = out if fast else out.tokens
        # Dispatch the next step before reading this one: the device runs while we check stops.
        if active.any():
            active_dev = jnp.asarray(active)
            logits, state = runner.decode(state, tokens_dev, active_dev, **lora)
            if fast:
                next_out = _pick_greedy(logits)
            else:
                next_out, counts, num_generated = _pick(
                    logits, batch, counts, prompt_mask, num_generated, active_dev
                )
        host = _to_host(out, fast, want_logprobs)
        if steps == 0:
            timings["ttft_s"] = time.perf_counter() - t0
        steps += 1
        for row in rows:
            if not active[row.index]:
                continue
            lp = None
            if row.params.logprobs is not None:
                lp = _token_logprobs(host, row.index, row.params.logprobs)
            token = int(host["tokens"][row.index])
            delta = row.add(token, lp)
            yield StreamOutput(row.index, token, delta, lp)
            if row.finish_reason is not None:
                active[row.index] = False
        if not active.any():
            break
        out = next_out
    timings["total_s"] = time.perf_counter() - t0
    timings["decode_steps"] = steps
    if results is not None:
        results.extend(r.result(timings) for r in rows)


def _to_host(out: Any, fast: bool, want_logprobs: bool) -> dict[str, np.ndarray]:
    if fast:
        return {"tokens": np.asarray(out)}
    if not want_logprobs:
        return {"tokens": np.asarray(out.tokens)}
    host = jax.device_get(out)
    assert isinstance(out, SampleOutput)
    return {name: np.asarray(getattr(host, name)) for name in SampleOutput._fields}


def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    on_token: Callable[[StreamOutput], None] | None = None,
) -> list[GenerationResult]:
    """Generates for every prompt as one batch (one decode step for all rows)."""
    results: list[GenerationResult] = []
    params = SamplingParams(temperature=0.0) if params is None else params
    for event in stream_batch(model, prompts, params, results):
        if on_token is not None:
            on_token(event)
    return results


def generate(
    model: Any, prompt_ids: Sequence[int], params: SamplingParams | None = None
) -> GenerationResult:
    """Generates one completion (greedy when ``params`` is None)."""
    return generate_batch(model, [prompt_ids], params)[0]


def generate_streaming(
    model: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams | None,
    on_token: Callable[[int], None],
) -> GenerationResult:
    """Like ``generate``, calling ``on_token(token_id)`` as each token is produced."""
    return generate_batch(model, [prompt_ids], params, lambda e: on_token(e.token_id))[0]


def stream(
    model: Any, prompt_ids: Sequence[int], params: SamplingParams | None = None
) -> Iterator[StreamOutput | GenerationResult]:
    """Yields a StreamOutput per token (id, text delta, logprobs), then the GenerationResult."""
    results: list[GenerationResult] = []
    params = SamplingParams(temperature=0.0) if params is None else params
    yield from stream_batch(model, [prompt_ids], params, results)
    yield results[0]
