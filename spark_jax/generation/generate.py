"""Host loops over the jitted steps: generate, stream, generate_streaming, generate_batch.

The seed engine's shape: prefill → decode → pick → stop check, with every sequence's slot
given back on every path, errors included. The loop is plain Python and imports no model
file: it drives the ``Runner`` protocol of ``spark_jax.model``. Decode steps run on the device
in chunks (a jitted while loop with the stop-token and max-token checks inside; one step per
chunk when a consumer streams token by token, several otherwise). The host dispatches the next
chunk before reading the last one, so its detokenizing and stop-string checks overlap the
device's work, and it copies only token ids (and logprobs when asked) to the host.

Host work per chunk is kept off the per-token path, because at NLLB-600M shapes a decode step
is under a millisecond of device time: no chunk is dispatched that the host knows would be
empty (every row ends at its max_tokens within the chunk in flight), the device's ``active``
mask is sent only when a stop string ended a row (the device retires every other stop
itself), one transfer brings a chunk's ids, and without a streaming consumer each row takes a
chunk's tokens at once (no per-token event objects; numpy stop checks when the row has no
text to decode).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation.compile_options import DEVICE_LOOP_OPTIONS
from spark_jax.models.common import bucket
from spark_jax.ops.sampling import (
    MAX_LOGPROBS,
    SampleOutput,
    SamplerBatch,
    SamplingParams,
    count_tokens,
    sample,
)
from spark_jax.tokenizer import IncrementalDetokenizer

MIN_CACHE_LEN = 256
STEPS_PER_SYNC = 8  # decode steps per device call when nobody streams token by token
# A chunk of decode steps ends as soon as every row is done (True) or always runs its
# STEPS_PER_SYNC steps (False). Ending early makes the loop's exit data-dependent: on the GPU
# the host then reads the loop predicate after every step (measured for NLLB greedy on the
# H200, run o: 1.11 ms per step in the loop against 0.755 ms in a fixed-count loop), while a
# fixed count wastes at most STEPS_PER_SYNC - 1 steps after the last row ends. Outputs are the
# same either way (tested); which is faster end to end is for benchmarks/nllb.py to show.
CHUNKS_EXIT_EARLY = True


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
    return bucket(n, MIN_CACHE_LEN)


# ---------------------------------------------------------------------------------------------
# Device-side picking: one jitted function per step, so changing parameters never recompiles.


def _device_done(tokens, num_generated, batch: SamplerBatch, max_tokens) -> jax.Array:
    """The stops the device sees: a stop id past min_tokens, or max_tokens reached. The host
    checks the same (plus stop strings), so the device's retirements are a subset of its own."""
    is_stop = jnp.any(tokens[:, None] == batch.stop_ids, axis=-1)
    return (is_stop & (num_generated >= batch.min_tokens)) | (num_generated >= max_tokens)


def _argmax_output(logits: jax.Array) -> SampleOutput:
    """Plain greedy picks; the logprob fields are zeros (no plain-greedy row reads them)."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    zeros = jnp.zeros(tokens.shape + (1,), jnp.float32)
    return SampleOutput(tokens, zeros[:, 0], zeros, zeros.astype(jnp.int32))


@partial(jax.jit, static_argnames=("greedy",), donate_argnames=("token_counts",))
def _pick(logits, batch: SamplerBatch, token_counts, prompt_mask, max_tokens, greedy: bool):
    """The first token of every row (after prefill) as a one-step chunk, and the loop's carry
    fields: the tokens, their counts, tokens generated, the rows that go on."""
    n = logits.shape[0]
    num_generated = jnp.ones((n,), jnp.int32)
    if greedy:
        out = _argmax_output(logits)
    else:
        out = sample(logits, batch, token_counts, prompt_mask, jnp.zeros((n,), jnp.int32))
        token_counts = count_tokens(token_counts, out.tokens)
    active = ~_device_done(out.tokens, num_generated, batch, max_tokens)
    chunk = _Chunk(*(x[:, None] for x in out), jnp.ones((n, 1), bool))
    return chunk, (out.tokens, active, token_counts, num_generated)


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

    @property
    def plain(self) -> bool:
        """No text, stop strings or logprobs: its chunks can be checked as arrays."""
        return self.detok is None and not self.params.stop and self.logprobs is None

    @property
    def stopped_by_string(self) -> bool:
        """Ended by a stop string: the one stop the device loop cannot see."""
        return isinstance(self.stop_reason, str)

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


def _token_logprobs(out: Any, row: int, step: int, n: int) -> TokenLogprobs:
    ids, values = out.top_ids[row, step, :n], out.top_logprobs[row, step, :n]
    top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return TokenLogprobs(int(out.tokens[row, step]), float(out.logprobs[row, step]), top)


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
    steps_per_sync: int = 1,
) -> Iterator[StreamOutput]:
    """Generates for every prompt as one batch, yielding each token as it is produced.

    When ``results`` is given, it is filled with one GenerationResult per prompt at the end.
    ``steps_per_sync`` decode steps run per device call (tokens reach the host in chunks of
    that many); outputs do not depend on it.
    """
    return _generate_rows(model, prompts, params, results, steps_per_sync, stream=True)


def _generate_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    results: list[GenerationResult] | None,
    steps_per_sync: int,
    stream: bool,
) -> Iterator[StreamOutput]:
    """``stream_batch``'s loop; yields nothing when ``stream`` is False (results only)."""
    prompts = [[int(t) for t in p] for p in prompts]
    plist = _as_list(params, len(prompts))
    _check_prompts(model, prompts, plist)
    runner = model.runner
    adapters = [model.adapter_slot(p.adapter) for p in plist]  # unknown names fail here
    slots = model.slot_pool.acquire(len(prompts))
    try:
        yield from _run_loop(
            model, runner, prompts, plist, adapters, results, steps_per_sync, stream
        )
    finally:
        model.slot_pool.release(slots)


class _Batch(NamedTuple):
    """One call's requests after prefill: what every decode chunk needs."""

    rows: list[_Request]
    lora: Any  # the runner's adapter input, or None
    sampler: SamplerBatch
    prompt_mask: jax.Array  # bool[B, V]
    max_tokens: jax.Array  # int32[B]
    greedy: bool  # every row is plain argmax: the loop skips the sampler
    want_logprobs: bool


def _start(model, runner, prompts, plist, adapters) -> tuple[_Batch, _Carry, _Chunk]:
    """Prefill every prompt and pick each first token: the batch, its carry, its first chunk."""
    n = len(prompts)
    rows = [_Request(i, p, sp, model) for i, (p, sp) in enumerate(zip(prompts, plist, strict=True))]
    max_len = cache_len(max(len(p) + sp.max_tokens for p, sp in zip(prompts, plist, strict=True)))
    state = runner.init_state(n, max_len, max(len(p) for p in prompts))
    # Adapters go to the runner only when a pool exists, so plain models keep one compile.
    lora_kw = {} if model.lora_pool is None else {"adapters": adapters}
    logits, state = runner.prefill(state, list(range(n)), prompts, plist, **lora_kw)
    vocab = logits.shape[-1]
    greedy = all(_plain_greedy(p) for p in plist)
    # Plain greedy reads neither the prompt mask nor the output counts: [B, 1] stand-ins spare
    # a [B, V] host array and its transfer (8 MB at NLLB's vocab and B=32) on every call.
    width = 1 if greedy else vocab
    prompt_mask = np.zeros((n, width), bool)
    if not greedy:
        for i, p in enumerate(prompts):
            prompt_mask[i, p] = True
    max_tokens = np.array([p.max_tokens for p in plist], np.int32)
    # One batched transfer (each jnp.asarray / jnp.zeros is a dispatch of its own).
    prompt_mask, max_tokens, counts = jax.device_put(
        (prompt_mask, max_tokens, np.zeros((n, width), np.int32))
    )
    batch = _Batch(
        rows=rows,
        lora=runner.lora_input(adapters) if lora_kw else None,
        sampler=SamplerBatch.from_params(plist, vocab, model.eos_token_ids),
        prompt_mask=prompt_mask,
        max_tokens=max_tokens,
        greedy=greedy,
        want_logprobs=any(p.logprobs is not None for p in plist),
    )
    chunk, fields = _pick(
        logits, batch.sampler, counts, batch.prompt_mask, batch.max_tokens, greedy=greedy
    )
    return batch, _Carry(state, *fields), chunk


def _run_loop(model, runner, prompts, plist, adapters, results, steps_per_sync, stream):
    t0 = time.perf_counter()
    batch, carry, chunk = _start(model, runner, prompts, plist, adapters)
    rows = batch.rows
    limits = _RowLimits.of(rows)
    host_done = np.zeros(len(prompts), bool)
    sent_done = np.zeros(len(prompts), bool)  # rows whose end the device was told of
    timings: dict[str, float] = {}
    syncs = 0
    chunk_steps = 1  # decode steps in ``chunk`` (the first holds the prefill's pick)
    while True:
        # Dispatch the next chunk of steps before reading this one: the device decodes while
        # the host detokenizes and checks stops. Not when every running row reaches its
        # max_tokens within this chunk: the next one would run no row.
        ahead = any(
            not host_done[r.index] and len(r.tokens) + chunk_steps < r.params.max_tokens
            for r in rows
        )
        if ahead:
            stopped = host_done & ~sent_done
            if stopped.any():  # a stop string ended rows the device still runs
                carry = dataclasses.replace(carry, active=carry.active & jnp.asarray(~host_done))
                sent_done |= host_done
            carry, next_chunk = _decode_chunk(
                runner.decode_fn,
                runner.params,
                batch.lora,
                carry,
                batch.sampler,
                batch.prompt_mask,
                batch.max_tokens,
                num_steps=steps_per_sync,
                greedy=batch.greedy,
                want_logprobs=batch.want_logprobs,
                exit_early=CHUNKS_EXIT_EARLY,
            )
        host = _to_host(chunk, batch.want_logprobs)
        if syncs == 0:
            timings["ttft_s"] = time.perf_counter() - t0
        syncs += 1
        if not host.valid.any():
            # The device retired rows the host still runs: its stop rule must be a subset of
            # the host's. Fail loudly rather than loop on empty chunks.
            raise RuntimeError("the device stopped rows the host had not; this is a bug.")
        if stream:
            yield from _emit(host, rows, host_done)
        else:
            _absorb(host, rows, host_done, limits)
        # Rows the device retired itself (stop ids, max_tokens) need no message.
        sent_done |= host_done & ~np.array([r.stopped_by_string for r in rows])
        if host_done.all():
            break
        if not ahead:
            raise RuntimeError("rows outlived their max_tokens on the host; this is a bug.")
        chunk, chunk_steps = next_chunk, steps_per_sync
    timings["total_s"] = time.perf_counter() - t0
    timings["host_syncs"] = syncs
    if results is not None:
        results.extend(r.result(timings) for r in rows)


def _to_host(chunk: _Chunk, want_logprobs: bool) -> _Chunk:
    """The chunk as numpy, in one transfer; the logprob fields only when a row wants them."""
    if want_logprobs:
        return jax.device_get(chunk)
    tokens, valid = jax.device_get((chunk.tokens, chunk.valid))
    return _Chunk(tokens, None, None, None, valid)


def _emit(host: Any, rows: list[_Request], host_done: np.ndarray) -> Iterator[StreamOutput]:
    """Feeds one chunk's tokens to their requests in step order; marks finished rows done."""
    for step in range(host.valid.shape[1]):
        for row in rows:
            if host_done[row.index] or not host.valid[row.index, step]:
                continue
            lp = None
            if row.params.logprobs is not None:
                lp = _token_logprobs(host, row.index, step, row.params.logprobs)
            token = int(host.tokens[row.index, step])
            delta = row.add(token, lp)
            yield StreamOutput(row.index, token, delta, lp)
            if row.finish_reason is not None:
                host_done[row.index] = True


class _RowLimits(NamedTuple):
    """The host's stop rule of every row as arrays, for checking a chunk at once."""

    stop_ids: np.ndarray  # int[B, W]: each row's stop ids, padded with -1
    min_tokens: np.ndarray  # int[B]
    max_tokens: np.ndarray  # int[B]
    plain: np.ndarray  # bool[B]: the row is checked here (else token by token)

    @classmethod
    def of(cls, rows: list[_Request]) -> _RowLimits:
        width = max(1, *(len(r.stop_ids) for r in rows))
        stop_ids = np.full((len(rows), width), -1, np.int64)
        for r in rows:
            stop_ids[r.index, : len(r.stop_ids)] = sorted(r.stop_ids)
        return cls(
            stop_ids,
            np.array([r.params.min_tokens for r in rows]),
            np.array([r.params.max_tokens for r in rows]),
            np.array([r.plain for r in rows]),
        )


def _absorb(host: Any, rows: list[_Request], host_done: np.ndarray, limits: _RowLimits) -> None:
    """``_emit`` without a consumer: the same tokens and ends, no per-token events.

    Plain rows are checked for the whole chunk in numpy (the stop and length rules of
    ``_Request.add``, the stop id first); the others go token by token.
    """
    valid = host.valid & ~host_done[:, None]  # a prefix of each row: rows only ever retire
    held = np.array([len(r.tokens) for r in rows])[:, None] + np.cumsum(valid, axis=1)
    is_stop = (host.tokens[:, :, None] == limits.stop_ids[:, None, :]).any(-1)
    stops = is_stop & (held >= limits.min_tokens[:, None])
    ends = valid & (stops | (held >= limits.max_tokens[:, None]))
    first_end = np.where(ends.any(1), ends.argmax(1), -1)
    taken = np.where(first_end >= 0, first_end + 1, valid.sum(1))
    for row in rows:
        i = row.index
        if not valid[i, 0]:
            continue
        if limits.plain[i]:
            row.tokens.extend(host.tokens[i, : taken[i]].tolist())
            end = first_end[i]
            # A stop id wins over the length limit at the same token, as in add.
            if end >= 0 and stops[i, end]:
                row._finish("stop", int(host.tokens[i, end]))
            elif end >= 0:
                row._finish("length", None)
        else:
            for step in range(taken[i]):
                lp = None
                if row.params.logprobs is not None:
                    lp = _token_logprobs(host, i, step, row.params.logprobs)
                row.add(int(host.tokens[i, step]), lp)
                if row.finish_reason is not None:
                    break
        host_done[i] = row.finish_reason is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Carry:
    """What one decode step hands the next, on the device."""

    state: Any  # the runner's cache
    tokens: jax.Array  # int32[B]: the last token of each row
    active: jax.Array  # bool[B]: rows still generating
    counts: jax.Array  # int32[B, V]: output token counts (penalties)
    num_generated: jax.Array  # int32[B]: tokens generated so far (the sampler's step index)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Chunk:
    """The tokens of a chunk of steps, for the host: [B, steps] (top-n: [B, steps, 20])."""

    tokens: jax.Array
    logprobs: jax.Array
    top_logprobs: jax.Array
    top_ids: jax.Array
    valid: jax.Array  # bool: the row was generating at that step


@partial(
    jax.jit,
    static_argnames=("decode_fn", "num_steps", "greedy", "want_logprobs", "exit_early"),
    donate_argnames=("carry",),
    compiler_options=DEVICE_LOOP_OPTIONS,
)
def _decode_chunk(
    decode_fn,
    params,
    lora,
    carry: _Carry,
    batch: SamplerBatch,
    prompt_mask,
    max_tokens,
    num_steps: int,
    greedy: bool,
    want_logprobs: bool,
    exit_early: bool = True,
):
    """Up to ``num_steps`` decode steps in one device call (a while loop that stops early when
    every row is done, if ``exit_early``; else always ``num_steps``, done rows idle): decode,
    pick, and the stop-token / max-token checks, all on device.

    The host stays the judge of stops (stop strings are host-only); the device check only
    retires rows early, and is a subset of the host's, so outputs are the same for any
    ``num_steps``.
    """
    b = carry.tokens.shape[0]
    steps = lambda *shape, dtype: jnp.zeros((b, num_steps, *shape), dtype)
    # The logprob fields only when a row reads them: in the loop each is one more small
    # kernel a step, and a step of a small model is a few hundred kernels at launch latency.
    logprob_fields = (None, None, None)
    if want_logprobs:
        logprob_fields = (
            steps(dtype=jnp.float32),
            steps(MAX_LOGPROBS, dtype=jnp.float32),
            steps(MAX_LOGPROBS, dtype=jnp.int32),
        )
    empty = _Chunk(steps(dtype=jnp.int32), *logprob_fields, steps(dtype=bool))

    def cond(loop):
        i, c, _ = loop
        if not exit_early:  # a trip count XLA can see: no predicate read back per step
            return i < num_steps
        return (i < num_steps) & jnp.any(c.active)

    def body(loop):
        i, c, out = loop
        logits, state = decode_fn(params, c.tokens, c.active, c.state, lora)
        if greedy:
            picked = _argmax_output(logits)
            counts = c.counts
        else:
            picked = sample(logits, batch, c.counts, prompt_mask, c.num_generated)
            counts = count_tokens(c.counts, picked.tokens, c.active)
        tokens = jnp.where(c.active, picked.tokens, c.tokens)
        num_generated = c.num_generated + c.active.astype(jnp.int32)
        done = _device_done(tokens, num_generated, batch, max_tokens)
        fields = (out.logprobs, out.top_logprobs, out.top_ids)  # None without logprobs
        if want_logprobs:
            fields = (
                out.logprobs.at[:, i].set(picked.logprobs),
                out.top_logprobs.at[:, i].set(picked.top_logprobs),
                out.top_ids.at[:, i].set(picked.top_ids),
            )
        out = _Chunk(out.tokens.at[:, i].set(tokens), *fields, out.valid.at[:, i].set(c.active))
        c = _Carry(state, tokens, c.active & ~done, counts, num_generated)
        return i + 1, c, out

    _, carry, out = jax.lax.while_loop(cond, body, (0, carry, empty))
    return carry, out


def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    on_token: Callable[[StreamOutput], None] | None = None,
) -> list[GenerationResult]:
    """Generates for every prompt as one batch (one decode step for all rows)."""
    results: list[GenerationResult] = []
    params = SamplingParams(temperature=0.0) if params is None else params
    if on_token is None:
        # Without a per-token consumer, several steps per device call save host round trips,
        # and no per-token events are built.
        for _ in _generate_rows(model, prompts, params, results, STEPS_PER_SYNC, stream=False):
            pass
        return results
    for event in stream_batch(model, prompts, params, results, 1):
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
