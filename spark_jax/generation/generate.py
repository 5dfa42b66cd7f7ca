"""Host loops over the one decode step: generate, stream, generate_streaming, generate_batch.

The seed engine's shape: prefill → pick → decode chunks → stop check, with every sequence's
slot given back on every path, errors included. The loop is plain Python over the runner
protocol (``spark_jax.protocol``) and imports no model file. Decode steps run on the device in
chunks (``step.run_chunk`` with the ``Sampling`` rule: the stop-token and max-token checks
inside; one step per chunk when a consumer streams token by token, several otherwise). The
host dispatches the next chunk before reading the last one, so its detokenizing and
stop-string checks overlap the device's work, and it copies only token ids (and logprobs when
asked) to the host.

Host work per chunk is kept off the per-token path, because at NLLB-600M shapes a decode step
is under a millisecond of device time: no chunk is dispatched that the host knows would be
empty (every row ends at its max_tokens within the chunk in flight), the device's ``active``
mask is sent only when a stop string ended a row (the device retires every other stop
itself), one transfer brings a chunk's ids, and without a streaming consumer each row takes a
chunk's tokens at once (no per-token event objects; array stop checks when the row has no
text to decode).

A batch with a guided row (``SamplingParams.guided``) runs one step per host sync, in the
step's two halves: the forward of step n+1 is dispatched, then the host reads step n's
tokens, advances the rows' grammars and fills their masks (``generation.guided``) while the
forward runs, then dispatches the pick with the masks. Free rows of that batch get all-ones
masks, which leave their tokens as they are. Two programs a step are the least that lets the
matcher overlap the model: a step's tokens reach the host only when its program ends, so a
pick fused with the next forward would leave the device idle while the host fills the masks.
The two keep their cost to a dispatch each: the pick's program leaves the cache out (it
never reads it), and each forward takes over the spent logits' buffer, so every buffer of
the forward keeps its address and its CUDA graph runs as recorded (``step.forward``).

``timings`` of the results say where the host's time went: ``wait_s`` blocked on the device's
tokens (after the first), ``dispatch_s`` in dispatching steps, ``mask_s`` filling and
uploading guided masks. A loop whose host waits on nothing is bound by the host.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation.guided import GuidedRow, fill_bitmask, guided_row
from spark_jax.generation.request import (
    GenerationResult,
    RequestState,
    RowLimits,
    StreamOutput,
    check_prompt,
    params_list,
    token_logprobs,
)
from spark_jax.generation.step import (
    Carry,
    Chunk,
    LoopOptions,
    SampleRows,
    Sampling,
    forward,
    pick,
    run_chunk,
)
from spark_jax.models.common import bucket
from spark_jax.ops.lora import adapter_slot
from spark_jax.ops.sampling import SamplerBatch, SamplerPasses, SamplingParams

MIN_CACHE_LEN = 256


def cache_len(n: int) -> int:
    """The cache-length ladder: powers of two from MIN_CACHE_LEN, so decode compiles rarely."""
    return bucket(n, MIN_CACHE_LEN)


def check_prompts(
    model: Any, prompts: Sequence[Sequence[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """Every prompt checked (``request.check_prompt``) before any device work; an
    encoder-decoder's sources as its encoder reads them (``source_tokens``)."""
    c = model.config
    limit = None if c.is_encoder_decoder else c.max_position_embeddings
    checked = [
        check_prompt(prompt, c.vocab_size, limit, p.max_tokens, what=f"prompt {i}")
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    if c.is_encoder_decoder:
        return [model.runner.source_tokens(s, p) for s, p in zip(checked, params, strict=True)]
    return checked


def stream_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    results: list[GenerationResult] | None = None,
    steps_per_sync: int = 1,
    loop: LoopOptions | None = None,
) -> Iterator[StreamOutput]:
    """Generates for every prompt as one batch, yielding each token as it is produced.

    When ``results`` is given, it is filled with one GenerationResult per prompt at the end.
    ``steps_per_sync`` decode steps run per device call (tokens reach the host in chunks of
    that many); outputs do not depend on it.
    """
    loop = dataclasses.replace(loop or LoopOptions(), steps_per_sync=steps_per_sync)
    return _generate_rows(model, prompts, params, results, loop, stream=True)


def _generate_rows(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams],
    results: list[GenerationResult] | None,
    loop: LoopOptions,
    stream: bool,
) -> Iterator[StreamOutput]:
    """``stream_batch``'s loop; yields nothing when ``stream`` is False (results only)."""
    plist = params_list(params, len(prompts))
    prompts = check_prompts(model, prompts, plist)
    adapters = [adapter_slot(model.lora_pool, p.adapter) for p in plist]  # unknown names fail
    guides = [guided_row(model, p) for p in plist]  # so do grammars the tokenizer cannot serve
    slots = model.slot_pool.acquire(len(prompts))
    try:
        yield from _run_loop(model, prompts, plist, adapters, guides, results, loop, stream)
    finally:
        model.slot_pool.release(slots)


class _Batch(NamedTuple):
    """One call's requests after prefill: what every decode chunk needs."""

    requests: list[RequestState]
    lora: Any  # the runner's adapter input, or None
    rows: SampleRows
    rule: Sampling
    guides: list[GuidedRow | None]  # each row's grammar, None on free rows
    vocab_size: int

    def masked(self) -> SampleRows:
        """The rows with each guided row's mask for its next token (after its last token)."""
        bitmask = fill_bitmask(self.guides, self.vocab_size)
        return dataclasses.replace(self.rows, allowed=jax.device_put(bitmask))


class _Stopwatch:
    """Host seconds per activity of the loop, summed: ``with watch("wait_s"): ...``."""

    def __init__(self, *names: str):
        self.seconds = dict.fromkeys(names, 0.0)
        self._name = ""
        self._start = 0.0

    def __call__(self, name: str) -> _Stopwatch:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] += time.perf_counter() - self._start


def _pick(rule: Sampling, logits: jax.Array, carry: Carry, rows: SampleRows) -> tuple[Carry, Chunk]:
    """``step.pick`` on the carry without its cache: the pick never reads the cache, so the
    program need not take (and donate, and alias) its buffers, one pair a layer."""
    picked, chunk = pick(rule, logits, dataclasses.replace(carry, state=None), rows)
    return dataclasses.replace(picked, state=carry.state), chunk


def _prefill_in_groups(
    runner, state, prompts, plist, adapters, max_tokens: int
) -> tuple[jax.Array, Any]:
    """The runner's prefill of every prompt into slots 0 .. n-1, in groups of consecutive rows
    of at most ``max_tokens`` padded positions each (at least one row a call): logits
    [n, V] in row order. ``adapters``: each row's slot, or None for a model without a pool."""
    n = len(prompts)
    per_call = max(1, max_tokens // bucket(max(len(p) for p in prompts)))
    pieces = []
    for first in range(0, n, per_call):
        rows = list(range(first, min(n, first + per_call)))
        lora_kw = {} if adapters is None else {"adapters": [adapters[i] for i in rows]}
        logits, state = runner.prefill(
            state, rows, [prompts[i] for i in rows], [plist[i] for i in rows], **lora_kw
        )
        pieces.append(logits)
    return (pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces)), state


def _start(
    model, prompts, plist, adapters, guides, loop: LoopOptions
) -> tuple[_Batch, Carry, Chunk, jax.Array]:
    """Prefill every prompt (``LoopOptions.prefill_tokens_per_call`` positions a call at most)
    and pick each first token: the batch, its carry, its first chunk and the prefill's logits
    (whose buffer a split step's forward takes over). With ``loop.split_step`` every step runs
    as a guided batch runs it."""
    split = loop.split_step
    runner = model.runner
    n = len(prompts)
    requests = [
        RequestState(i, p, sp, model.eos_token_ids, model.tokenizer, g)
        for i, (p, sp, g) in enumerate(zip(prompts, plist, guides, strict=True))
    ]
    max_len = cache_len(max(len(p) + sp.max_tokens for p, sp in zip(prompts, plist, strict=True)))
    state = runner.init_state(n, max_len, max(len(p) for p in prompts))
    # Adapters go to the runner only when a pool exists, so plain models keep one compile.
    pooled = None if model.lora_pool is None else adapters
    logits, state = _prefill_in_groups(
        runner, state, prompts, plist, pooled, loop.prefill_tokens_per_call
    )
    vocab = logits.shape[-1]
    rule = Sampling(
        greedy=all(p.plain_greedy for p in plist),
        want_logprobs=any(p.logprobs is not None for p in plist),
        guided=split or any(g is not None for g in guides),
        passes=SamplerPasses.for_params(plist, vocab),
    )
    # Plain greedy reads neither the prompt mask nor the output counts: [B, 1] stand-ins spare
    # a [B, V] host array and its transfer (8 MB at NLLB's vocab and B=32) on every call.
    width = 1 if rule.greedy else vocab
    prompt_mask = np.zeros((n, width), bool)
    if not rule.greedy:
        for i, p in enumerate(prompts):
            prompt_mask[i, p] = True
    max_tokens = np.array([p.max_tokens for p in plist], np.int32)
    # One batched transfer (each jnp.asarray / jnp.zeros is a dispatch of its own).
    prompt_mask, max_tokens, counts, tokens, active, generated = jax.device_put(
        (
            prompt_mask,
            max_tokens,
            np.zeros((n, width), np.int32),
            np.zeros((n,), np.int32),
            np.ones((n,), bool),
            np.zeros((n,), np.int32),
        )
    )
    rows = SampleRows(
        SamplerBatch.from_params(plist, vocab, model.eos_token_ids), prompt_mask, max_tokens
    )
    lora = None if model.lora_pool is None else runner.lora_input(adapters)
    batch = _Batch(requests, lora, rows, rule, guides, vocab)
    if rule.guided:
        rows = batch.masked()
    carry, chunk = _pick(rule, logits, Carry(state, tokens, active, generated, counts), rows)
    return batch, carry, chunk, logits


def _run_loop(model, prompts, plist, adapters, guides, results, loop: LoopOptions, stream: bool):
    t0 = time.perf_counter()
    runner = model.runner
    batch, carry, chunk, logits = _start(model, prompts, plist, adapters, guides, loop)
    requests = batch.requests
    limits = RowLimits.of(requests)
    host_done = np.zeros(len(prompts), bool)
    sent_done = np.zeros(len(prompts), bool)  # rows whose end the device was told of
    timings: dict[str, float] = {}
    watch = _Stopwatch("wait_s", "dispatch_s", "mask_s")
    syncs = 0
    split = batch.rule.guided  # each step as forward, then pick with the masks
    logits = logits if split else None  # its buffer is the split forward's to take over
    steps_per_sync = 1 if split else loop.steps_per_sync  # a mask needs the last token
    chunk_steps = 1  # decode steps in ``chunk`` (the first holds the prefill's pick)
    while True:
        # Dispatch the next chunk of steps (a guided batch: the next step's forward) before
        # reading this one: the device decodes while the host detokenizes and checks stops.
        # Not when every running row reaches its max_tokens within this chunk: the next one
        # would run no row.
        ahead = any(
            not host_done[r.index] and len(r.tokens) + chunk_steps < r.params.max_tokens
            for r in requests
        )
        if ahead and split:
            with watch("dispatch_s"):  # its pick is dispatched: ``logits`` are spent
                logits, carry = forward(
                    runner.decode_fn, batch.rule, runner.params, batch.lora, carry, None, logits
                )
        elif ahead:
            carry, sent_done = _retire_on_device(carry, host_done, sent_done)
            with watch("dispatch_s"):
                carry, next_chunk = run_chunk(
                    runner.decode_fn,
                    batch.rule,
                    runner.params,
                    batch.lora,
                    carry,
                    batch.rows,
                    num_steps=steps_per_sync,
                    exit_early=loop.exit_early,
                )
        if syncs == 0:
            host = _to_host(chunk, batch.rule.want_logprobs)
            timings["ttft_s"] = time.perf_counter() - t0
        else:
            with watch("wait_s"):
                host = _to_host(chunk, batch.rule.want_logprobs)
        syncs += 1
        if not host.valid.any():
            # The device retired rows the host still runs: its stop rule must be a subset of
            # the host's. Fail loudly rather than loop on empty chunks.
            raise RuntimeError("the device stopped rows the host had not; this is a bug.")
        if stream:
            yield from _emit(host, requests, host_done)
        else:
            _absorb(host, requests, host_done, limits)
        # Rows the device retired itself (stop ids, max_tokens) need no message.
        sent_done |= host_done & ~np.array([r.stopped_on_host for r in requests])
        if host_done.all():
            break
        if not ahead:
            raise RuntimeError("rows outlived their max_tokens on the host; this is a bug.")
        if split:  # the pick of the step whose forward runs, with the masks its tokens need
            carry, sent_done = _retire_on_device(carry, host_done, sent_done)
            with watch("mask_s"):
                rows = batch.masked()
            with watch("dispatch_s"):
                carry, next_chunk = _pick(batch.rule, logits, carry, rows)
        chunk, chunk_steps = next_chunk, steps_per_sync
    timings["total_s"] = time.perf_counter() - t0
    timings["host_syncs"] = syncs
    timings.update(watch.seconds)
    if results is not None:
        results.extend(r.result(timings) for r in requests)


def _retire_on_device(
    carry: Carry, host_done: np.ndarray, sent_done: np.ndarray
) -> tuple[Carry, np.ndarray]:
    """The carry with the rows the host ended on its own (a stop string, a complete grammar)
    inactive, and those rows marked as told."""
    if not (host_done & ~sent_done).any():
        return carry, sent_done
    active = carry.active & jax.device_put(~host_done)
    return dataclasses.replace(carry, active=active), sent_done | host_done


def _to_host(chunk: Chunk, want_logprobs: bool) -> Chunk:
    """The chunk as numpy, in one transfer; the logprob fields only when a row wants them."""
    if want_logprobs:
        return jax.device_get(chunk)
    tokens, valid = jax.device_get((chunk.tokens, chunk.valid))
    return Chunk(tokens, None, None, None, valid)


def _emit(
    host: Chunk, requests: list[RequestState], host_done: np.ndarray
) -> Iterator[StreamOutput]:
    """Feeds one chunk's tokens to their requests in step order; marks finished rows done."""
    for step in range(host.valid.shape[1]):
        for r in requests:
            if host_done[r.index] or not host.valid[r.index, step]:
                continue
            lp = None
            if r.params.logprobs is not None:
                lp = token_logprobs(host, r.index, step, r.params.logprobs)
            token = int(host.tokens[r.index, step])
            delta = r.add(token, lp)
            yield StreamOutput(r.index, token, delta, lp)
            if r.finished:
                host_done[r.index] = True


def _absorb(
    host: Chunk, requests: list[RequestState], host_done: np.ndarray, limits: RowLimits
) -> None:
    """``_emit`` without a consumer: the same tokens and ends, no per-token events.

    Plain rows are checked for the whole chunk as arrays (``RowLimits.check``, the rule of
    ``RequestState.add``); the others go token by token.
    """
    valid = host.valid & ~host_done[:, None]  # a prefix of each row: rows only ever retire
    held = np.array([len(r.tokens) for r in requests])
    stops, ends = limits.check(host.tokens, valid, held)
    for r in requests:
        i = r.index
        if not valid[i, 0]:
            continue
        if r.plain:
            taken = valid[i].sum()
            r.add_plain(host.tokens[i, :taken], stops[i, :taken], ends[i, :taken])
        else:
            for step in range(int(valid[i].sum())):
                lp = None
                if r.params.logprobs is not None:
                    lp = token_logprobs(host, i, step, r.params.logprobs)
                r.add(int(host.tokens[i, step]), lp)
                if r.finished:
                    break
        host_done[i] = r.finished


def generate_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    on_token: Callable[[StreamOutput], None] | None = None,
    loop: LoopOptions | None = None,
) -> list[GenerationResult]:
    """Generates for every prompt as one batch (one decode step for all rows).

    ``loop`` sets the device loop (steps per host sync, early exit); outputs never depend on
    it. With ``on_token`` every step reaches the host (one step per chunk).
    """
    results: list[GenerationResult] = []
    params = SamplingParams(temperature=0.0) if params is None else params
    loop = loop or LoopOptions()
    if on_token is None:
        # Without a per-token consumer, several steps per device call save host round trips,
        # and no per-token events are built.
        for _ in _generate_rows(model, prompts, params, results, loop, stream=False):
            pass
        return results
    for event in stream_batch(model, prompts, params, results, 1, loop):
        on_token(event)
    return results


def generate(
    model: Any,
    prompt_ids: Sequence[int],
    params: SamplingParams | None = None,
    loop: LoopOptions | None = None,
) -> GenerationResult:
    """Generates one completion (greedy when ``params`` is None)."""
    return generate_batch(model, [prompt_ids], params, loop=loop)[0]


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
