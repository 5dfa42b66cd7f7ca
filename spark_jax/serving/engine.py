"""Continuous batching: many requests share one paged KV cache and one decode step.

``Engine`` is vLLM's ``LLMEngine`` in miniature. Requests arrive at any time
(``add_request``); each ``step`` is one scheduling round:

1. decode: every running sequence that holds its next input token advances one token. The
   decode step always runs all ``max_num_seqs`` cache rows (idle rows masked), so its shape
   never changes. On the GPU its attention reads each row's pages in place (cuDNN's paged
   attention); elsewhere it gathers the rows, and the block table's width (the longest row,
   in pages) moves on a ladder so the gather stays short.
2. prefill: sequences still reading their prompt advance by one chunk, packed into one
   ``[B, T]`` batch from a fixed ladder with ``B * T <= max_batch_tokens``. Waiting requests
   are admitted first come, first served, when a slot and the pages of their prompt are free.
3. sample: one jitted sampler over all slots picks the next token of every row that finished
   its prefill or decoded; the host then checks stops and streams the deltas.

Pages are allocated on the host (a free list): a prompt's pages at admission, one more page
when a decoding row crosses a page boundary. When none is free, the newest running sequence
is preempted: its pages and slot are freed and it goes back to the head of the queue, to be
re-prefilled from prompt + generated tokens (recompute, as vLLM does). Its generated count is
kept, so its sampler keys (seed, step index) continue where they stopped: a request's tokens
are those it gets alone from ``sj.generate`` (greedy or seeded), whatever it is batched with.

Scope: this class batches decoder-only models (the paged cache is written through the
decoder's ``write_kv``/``read_rows``). ``Engine(model)`` of an encoder-decoder (NLLB) model
builds ``seq2seq_scheduler.EncoderDecoderEngine``: the same loop over a dense per-slot cache
with whole-source prefill (greedy and sampled requests; beam search stays on
``sj.generate_beam``, whose beams re-order their rows every step).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np

from spark_jax.generation.beam import BeamResult
from spark_jax.generation.request import GenerationResult, RequestState, TokenLogprobs
from spark_jax.ops.cudnn import cudnn_paged_applies
from spark_jax.ops.kv_cache import PagedKVCache
from spark_jax.ops.sampling import SamplerBatch, SamplingParams, count_tokens, sample

MIN_CHUNK = 16  # the decoder's smallest prefill bucket: chunk ladders start here
MIN_DECODE_PAGES = 8  # the narrowest block table a decode step gathers
SAMPLER_WIDTH = 32  # logit-bias entries and stop ids per request: a fixed sampler shape


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens, their text, and its end."""

    request_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    result: GenerationResult | BeamResult | None = None  # set when finished


class PageAllocator:
    """The host-side free list of KV pages (indices into the page pool's first axis)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))[::-1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} pages asked for but {len(self._free)} are free.")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)


def _pow2_ladder(low: int, high: int) -> list[int]:
    """low, 2*low, ... up to high (high itself is the last rung even if not a power of two)."""
    rungs = [low]
    while rungs[-1] < high:
        rungs.append(min(rungs[-1] * 2, high))
    return rungs


def _commit(tree: Any) -> Any:
    """The arrays of ``tree`` committed to the default device (see ``_init_host_state``)."""
    return jax.device_put(tree, jax.devices()[0])


def _check_sampler_width(params: SamplingParams, eos_token_ids: Sequence[int]) -> None:
    """The engine's sampler has a fixed width of stop ids and logit-bias entries per row."""
    stops = {*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}
    if max(len(stops), len(params.logit_bias)) > SAMPLER_WIDTH:
        raise ValueError(
            f"at most {SAMPLER_WIDTH} stop token ids (EOS included) and logit_bias entries "
            "per request: the engine's sampler has a fixed shape."
        )


def _rung(ladder: Sequence[int], n: int) -> int:
    return next(r for r in ladder if r >= n)


def _upload(x: np.ndarray | np.generic) -> jax.Array:
    """A host array on the device. device_put, not jnp.asarray: the latter compiles a small
    staging program per new shape, which would break "no compiles after warm-up". A copy:
    on the CPU the device array may alias the numpy buffer, which the host keeps editing
    while the step it feeds is still queued."""
    return jax.device_put(np.array(x, copy=True))


# ---------------------------------------------------------------------------------------------
# Device-side helpers: one jitted function each, all shapes fixed by the engine's ladders.


@jax.jit
def _merge_rows(logits: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """logits[slots[i]] = rows[i]; slots out of range (padding, unfinished chunks) dropped."""
    return logits.at[slots].set(rows, mode="drop")


@partial(jax.jit, donate_argnames=("token_counts",))
def _sample_rows(logits, batch: SamplerBatch, token_counts, prompt_mask, num_generated, active):
    out = sample(logits, batch, token_counts, prompt_mask, num_generated)
    return out, count_tokens(token_counts, out.tokens, active)


@partial(jax.jit, donate_argnames=("token_counts", "prompt_mask"))
def _set_row(token_counts, prompt_mask, slot, counts_row, mask_row):
    """A slot's sampler state for a newly admitted sequence (its output so far, its prompt)."""
    token_counts = token_counts.at[slot].set(counts_row, mode="drop")
    return token_counts, prompt_mask.at[slot].set(mask_row, mode="drop")


# ---------------------------------------------------------------------------------------------
# One request's life: waiting → running (prefilling, then decoding) → finished.


class _Sequence:
    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams, model: Any):
        self.id = request_id
        self.prompt = prompt
        self.params = params
        self.adapter = model.adapter_slot(params.adapter)  # unknown names fail here
        self.out = RequestState(request_id, prompt, params, model.eos_token_ids, model.tokenizer)
        self.slot: int | None = None
        self.pages: list[int] = []
        self.num_computed = 0  # tokens whose keys are in the cache
        self.prefill_target = 0  # tokens to compute before the next sample (set on admission)
        self.admitted = -1  # admission order: the newest is preempted first
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.num_preemptions = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out.tokens

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    def result(self) -> GenerationResult:
        now = time.perf_counter()
        timings = {"total_s": now - self.arrival, "preemptions": float(self.num_preemptions)}
        if self.first_token_at is not None:
            timings["ttft_s"] = self.first_token_at - self.arrival
        return self.out.result(timings)


# ---------------------------------------------------------------------------------------------
# The engine.


class Engine:
    """Continuous batching over a paged KV cache (see the module docstring).

    max_num_seqs: cache rows, i.e. sequences decoded at once.
    max_batch_tokens: padded prefill tokens per step (a power of two >= 16); also the
        longest prefill chunk.
    kv_pages, page_size: the page pool; by default every row can reach max_model_len. On the
        GPU the decode step reads pages in place only when ``kv_pages`` is a multiple of
        ``max_num_seqs`` with at least ``max_model_len`` worth of pages per row (the default
        is); any other pool falls back to gathering the rows.
    max_model_len: the longest prompt + output (default: the model's positions).
    max_prefill_seqs: sequences prefilled in one step (the row ladder's top).
    min_chunk, min_decode_pages: the lowest rungs of the prefill-length and block-table
        ladders; raising them trades padding for fewer compiles (each costs ~25 s for an
        unrolled 8B model on the H200).
    """

    def __init__(
        self,
        model: Any,
        max_num_seqs: int = 32,
        max_batch_tokens: int = 256,
        kv_pages: int | None = None,
        page_size: int = 16,
        max_model_len: int | None = None,
        max_prefill_seqs: int = 8,
        min_chunk: int = MIN_CHUNK,
        min_decode_pages: int = MIN_DECODE_PAGES,
    ):
        for name, value in (("max_batch_tokens", max_batch_tokens), ("min_chunk", min_chunk)):
            if value < MIN_CHUNK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_CHUNK}, got {value}")
        if min_chunk > max_batch_tokens:
            raise ValueError(f"min_chunk {min_chunk} exceeds max_batch_tokens {max_batch_tokens}")
        self.model = model
        self.runner = model.runner
        self.num_slots = max_num_seqs
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.max_pages_per_seq = math.ceil(self.max_model_len / page_size)
        kv_pages = kv_pages or max_num_seqs * self.max_pages_per_seq
        self.chunk_ladder = _pow2_ladder(min_chunk, max_batch_tokens)
        top_rows = max(1, min(max_prefill_seqs, max_batch_tokens // min_chunk))
        self.row_ladder = _pow2_ladder(1, top_rows)
        low = min(min_decode_pages, self.max_pages_per_seq)
        self.width_ladder = _pow2_ladder(low, self.max_pages_per_seq)
        self.allocator = PageAllocator(kv_pages)
        self.state = self._create_cache(kv_pages)
        if self._decode_reads_pages_in_place():
            # Each row's attention then reads its own pages whatever the table's width: one
            # decode shape instead of a ladder, so fewer compiles at startup.
            self.width_ladder = [self.max_pages_per_seq]
        self._init_host_state(kv_pages)
        self._init_sync()

    def __new__(cls, model: Any, *args: Any, **kwargs: Any) -> Engine:
        """``Engine(model)`` of an encoder-decoder model is an ``EncoderDecoderEngine``."""
        if cls is Engine and model.config.is_encoder_decoder:
            from spark_jax.serving.seq2seq import EncoderDecoderEngine

            cls = EncoderDecoderEngine
        return super().__new__(cls)

    def _init_sync(self) -> None:
        self._lock = threading.RLock()
        self._queues: dict[int, asyncio.Queue[RequestOutput]] = {}
        self._driver: asyncio.Task[None] | None = None

    def _create_cache(self, kv_pages: int) -> PagedKVCache:
        c = self.model.config
        return _commit(
            PagedKVCache.create(
                c.num_layers,
                self.num_slots,
                kv_pages,
                self.page_size,
                self.max_pages_per_seq,
                c.num_kv_heads,
                c.head_dim,
                self.model.dtype,
            )
        )

    def _decode_reads_pages_in_place(self) -> bool:
        """True where the decode step's attention reads the pages in place (cuDNN's paged
        attention on the GPU) rather than gathering each row's table width."""
        c = self.model.config
        q = jax.ShapeDtypeStruct((self.num_slots, 1, c.num_heads, c.head_dim), self.model.dtype)
        window = next((w for w in c.sliding_windows if w), None)
        return cudnn_paged_applies(q, self.state.k[0], self.num_slots, window)

    def _init_host_state(self, kv_pages: int) -> None:
        n, vocab = self.num_slots, self.model.config.vocab_size
        self._table = np.full((n, self.max_pages_per_seq), kv_pages, np.int32)  # kv_pages: none
        self._lengths = np.zeros((n,), np.int32)
        self._slots: list[_Sequence | None] = [None] * n
        self._free_slots = list(range(n))[::-1]
        self._waiting: deque[_Sequence] = deque()
        self._requests: dict[int, _Sequence] = {}
        self._pending: list[RequestOutput] = []  # outputs made outside a step (aborts, errors)
        self._next_id = 0
        self._admissions = 0
        self.num_preemptions = 0
        # Every array the engine holds is committed to the device from the start, like the
        # step outputs that replace it: a jitted step's cache key includes whether its inputs
        # are committed, so state that changed status after warm-up would compile again.
        self._counts = _commit(np.zeros((n, vocab), np.int32))
        self._prompt_mask = _commit(np.zeros((n, vocab), bool))
        self._zero_logits = _commit(np.zeros((n, vocab), np.float32))
        self._batch: SamplerBatch | None = None  # rebuilt when the slots' owners change

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> int:
        """Queues a request; returns its id. Bad requests are refused here, before any work."""
        params = SamplingParams(temperature=0.0) if params is None else params
        prompt = [int(t) for t in prompt_ids]
        self._check(prompt, params)
        if params.seed is None:  # drawn once, so the draws never change under preemption
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            seq = _Sequence(request_id, prompt, params, self.model)
            self._requests[request_id] = seq
            self._waiting.append(seq)
        return request_id

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token.")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the prompt has token ids {bad[:5]} outside [0, {vocab}).")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens and asks for {params.max_tokens} more, "
                f"past max_model_len={self.max_model_len}; shorten it or lower max_tokens."
            )
        _check_sampler_width(params, self.model.eos_token_ids)
        if math.ceil(total / self.page_size) > self.allocator.num_pages:
            raise ValueError(
                f"{total} tokens need more than the {self.allocator.num_pages} KV pages of "
                f"{self.page_size}; raise kv_pages."
            )

    def abort(self, request_id: int) -> bool:
        """Stops a request and frees its slot and pages; False if it already ended."""
        with self._lock:
            seq = self._requests.pop(request_id, None)
            if seq is None:
                return False
            if seq.slot is not None:
                self._release(seq)
            else:
                self._waiting.remove(seq)
            seq.out.finish_reason = "abort"
            self._pending.append(RequestOutput(request_id, [], "", True, seq.result()))
            return True

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending)

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self._free_slots)

    @property
    def pages_in_use(self) -> int:
        return self.allocator.in_use

    # -- slots and pages --------------------------------------------------------------------

    def _admit(self, seq: _Sequence) -> None:
        seq.slot = self._free_slots.pop()
        self._reserve(seq)
        seq.num_computed = 0
        seq.admitted = self._admissions
        self._admissions += 1
        self._slots[seq.slot] = seq
        self._lengths[seq.slot] = 0
        self._batch = None
        vocab = self.model.config.vocab_size
        counts = np.bincount(np.asarray(seq.out.tokens, np.int64), minlength=vocab)
        mask = np.bincount(np.asarray(seq.prompt, np.int64), minlength=vocab) > 0
        self._counts, self._prompt_mask = _set_row(
            self._counts,
            self._prompt_mask,
            _upload(np.int32(seq.slot)),
            _upload(counts[:vocab].astype(np.int32)),
            _upload(mask[:vocab]),
        )

    def _reserve(self, seq: _Sequence) -> None:
        """What an admitted sequence must compute before it samples, and its pages for it."""
        seq.prefill_target = len(seq.prompt) + len(seq.out.tokens)
        seq.pages = self.allocator.allocate(self._pages_for(seq.prefill_target))
        self._table[seq.slot, : len(seq.pages)] = seq.pages

    def _free(self, seq: _Sequence) -> None:
        """Gives back the pages of a sequence leaving its slot."""
        self.allocator.free(seq.pages)
        self._table[seq.slot] = self.allocator.num_pages

    def _release(self, seq: _Sequence) -> None:
        """Gives back the slot and pages of a sequence (finish, abort, preemption, error)."""
        assert seq.slot is not None
        self._free(seq)
        self._lengths[seq.slot] = 0
        self._slots[seq.slot] = None
        self._free_slots.append(seq.slot)
        seq.slot, seq.pages = None, []
        self._batch = None

    def _preempt(self, seq: _Sequence) -> None:
        self._release(seq)
        seq.num_computed = seq.prefill_target = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(seq)

    def _pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def _running(self) -> list[_Sequence]:
        return sorted((s for s in self._slots if s is not None), key=lambda s: s.admitted)

    # -- scheduling -------------------------------------------------------------------------

    def _schedule_decode(self) -> tuple[list[_Sequence], bool]:
        """The decoding rows of this step, oldest first, each with a page for its next key.

        Preempts the newest running sequences when no page is free; says whether it did.
        """
        rows, preempted = [], False
        for seq in [s for s in self._running() if not s.prefilling]:
            if seq.slot is None:  # preempted for an older sequence in this loop
                continue
            if seq.num_computed // self.page_size >= len(seq.pages):
                while self.allocator.num_free == 0 and seq.slot is not None:
                    self._preempt(self._running()[-1])
                    preempted = True
                if seq.slot is None:
                    continue
                page = self.allocator.allocate(1)[0]
                self._table[seq.slot, len(seq.pages)] = page
                seq.pages.append(page)
            rows.append(seq)
        return rows, preempted

    def _schedule_prefill(self, admit: bool) -> list[tuple[_Sequence, int]]:
        """(sequence, chunk length) rows of this step's prefill batch; admits new requests."""
        rows: list[tuple[_Sequence, int]] = []
        for seq in self._running():
            if seq.prefilling and not self._add_chunk(rows, seq):
                return rows
        while admit and self._waiting and self._free_slots:
            seq = self._waiting[0]
            need = self._pages_for(len(seq.prompt) + len(seq.out.tokens))
            if need > self.allocator.num_free or not self._room_for(rows):
                break
            self._waiting.popleft()
            self._admit(seq)
            self._add_chunk(rows, seq)
        return rows

    def _room_for(self, rows: list[tuple[_Sequence, int]]) -> int:
        """The longest chunk one more row could take (0: no room), keeping B*T in budget."""
        n = len(rows) + 1
        if n > self.row_ladder[-1]:
            return 0
        cap = self.max_batch_tokens // _rung(self.row_ladder, n)
        if cap < self.chunk_ladder[0] or any(chunk > cap for _, chunk in rows):
            return 0
        return cap

    def _add_chunk(self, rows: list[tuple[_Sequence, int]], seq: _Sequence) -> bool:
        cap = self._room_for(rows)
        if cap:
            rows.append((seq, min(seq.prefill_target - seq.num_computed, cap)))
        return bool(cap)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling round; returns the deltas it produced (and any aborts since)."""
        with self._lock:
            try:
                outputs = self._step()
            except BaseException:
                self._fail_all()
                raise
            outputs, self._pending = self._pending + outputs, []
            return outputs

    def _step(self) -> list[RequestOutput]:
        decode_rows, preempted = self._schedule_decode()
        prefill_rows = self._schedule_prefill(admit=not preempted)
        if not decode_rows and not prefill_rows:
            return []
        logits = self._run_decode(decode_rows)
        logits, done = self._run_prefill(prefill_rows, logits)
        return self._sample(logits, decode_rows + done)

    def _lora(self, adapters: Sequence[int]) -> dict[str, Any]:
        # Adapters go to the runner only when a pool exists, so plain models keep one compile.
        return {} if self.model.lora_pool is None else {"adapters": list(adapters)}

    def _device_state(self, width: int) -> PagedKVCache:
        table = _upload(self._table[:, :width])
        return self.state.with_block_table(table).with_lengths(_upload(self._lengths))

    def _decode_state(self) -> PagedKVCache:
        """The cache a decode step reads: the block table as wide as the longest row needs."""
        width = _rung(self.width_ladder, max(len(s.pages) for s in self._running()))
        return self._device_state(width)

    def _run_decode(self, rows: list[_Sequence]) -> jax.Array:
        if not rows:
            return self._zero_logits
        tokens = np.zeros((self.num_slots,), np.int32)
        active = np.zeros((self.num_slots,), bool)
        for seq in rows:
            tokens[seq.slot] = seq.out.tokens[-1]
            active[seq.slot] = True
        adapters = [-1 if s is None else s.adapter for s in self._slots]
        logits, self.state = self.runner.decode(
            self._decode_state(),
            _upload(tokens),
            _upload(active),
            **self._lora(adapters),
        )
        for seq in rows:
            seq.num_computed += 1
            self._lengths[seq.slot] += 1
        return logits

    def _run_prefill(
        self, rows: list[tuple[_Sequence, int]], logits: jax.Array
    ) -> tuple[jax.Array, list[_Sequence]]:
        """Runs the chunks; their rows that finished prefill get their logits merged in."""
        if not rows:
            return logits, []
        pad = _rung(self.row_ladder, len(rows)) - len(rows)
        nowhere = self.num_slots  # a slot out of range: its writes are dropped
        slots = [s.slot for s, _ in rows] + [nowhere] * pad
        chunks = [s.tokens[s.num_computed : s.num_computed + n] for s, n in rows] + [[0]] * pad
        adapters = [s.adapter for s, _ in rows] + [-1] * pad
        chunk_logits, self.state = self.runner.prefill(
            self._device_state(self.max_pages_per_seq),
            slots,
            chunks,
            continuing=True,
            min_len=_rung(self.chunk_ladder, max(n for _, n in rows)),
            **self._lora(adapters),
        )
        targets = np.full((len(slots),), nowhere, np.int32)
        done = []
        for i, (seq, n) in enumerate(rows):
            seq.num_computed += n
            self._lengths[seq.slot] = seq.num_computed
            if not seq.prefilling:
                targets[i] = seq.slot
                done.append(seq)
        if done:
            logits = _merge_rows(logits, chunk_logits, _upload(targets))
        return logits, done

    def _sample(self, logits: jax.Array, rows: list[_Sequence]) -> list[RequestOutput]:
        if not rows:
            return []
        if self._batch is None:
            self._batch = self._sampler_batch(
                [None if s is None else s.params for s in self._slots]
            )
        active = np.zeros((self.num_slots,), bool)
        generated = np.zeros((self.num_slots,), np.int32)
        for seq in rows:
            active[seq.slot] = True
            generated[seq.slot] = len(seq.out.tokens)
        out, self._counts = _sample_rows(
            logits,
            self._batch,
            self._counts,
            self._prompt_mask,
            _upload(generated),
            _upload(active),
        )
        if any(s.params.logprobs is not None for s in rows):
            host = {k: np.asarray(v) for k, v in jax.device_get(out)._asdict().items()}
        else:
            host = {"tokens": np.asarray(out.tokens)}
        return [self._emit(seq, host) for seq in rows]

    def _emit(self, seq: _Sequence, host: dict[str, np.ndarray]) -> RequestOutput:
        token = int(host["tokens"][seq.slot])
        lp = None
        if seq.params.logprobs is not None:
            lp = _logprobs(host, seq.slot, seq.params.logprobs)
        delta = seq.out.add(token, lp)
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        if seq.out.finish_reason is None:
            return RequestOutput(seq.id, [token], delta)
        self._release(seq)
        del self._requests[seq.id]
        return RequestOutput(seq.id, [token], delta, True, seq.result())

    def _fail_all(self) -> None:
        """After a failed step: every request ends with "error" and gives back what it held."""
        for seq in list(self._requests.values()):
            if seq.slot is not None:
                self._release(seq)
            seq.out.finish_reason = "error"
            self._pending.append(RequestOutput(seq.id, [], "", True, seq.result()))
        self._waiting.clear()
        self._requests.clear()

    # -- drivers ----------------------------------------------------------------------------

    def run(self) -> Iterator[RequestOutput]:
        """Steps until every request has finished, yielding each step's deltas."""
        while self.has_unfinished():
            yield from self.step()

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generates for every prompt (like vLLM's ``LLM.generate``); results in prompt order."""
        plist = _as_list(params, len(prompts))
        for prompt, p in zip(prompts, plist, strict=True):
            self._check([int(t) for t in prompt], p)  # all refused before any is queued
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        wanted, results = set(ids), {}
        while len(results) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out.result
        return [results[i] for i in ids]

    async def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields one request's deltas as they come; closing the stream aborts the request.

        One driver task steps the engine (in a worker thread, so the event loop stays free)
        while any stream is open.
        """
        request_id = self.add_request(prompt_ids, params)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def _drive(self) -> None:
        while self._queues:
            outputs = await asyncio.to_thread(self.step)
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)

    # -- warm-up ----------------------------------------------------------------------------

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk) prefill batch the scheduler can form."""
        return [
            (b, t)
            for b in self.row_ladder
            for t in self.chunk_ladder
            if b * t <= self.max_batch_tokens
        ]

    def warmup(self, compile_threads: int = 8) -> None:
        """Compiles every step shape (decode widths, prefill batches, sampler) up front.

        Every model step is first traced here and compiled on ``compile_threads`` threads (XLA
        compiles outside the GIL; an 8B step takes seconds each), then run once on rows out of
        range with an empty block table, so nothing is written. Inputs are made the way a run
        makes them (``_upload``), so a run finds every program cached.
        """
        with self._lock:
            steps = [("decode", self._warm_decode_args(w)) for w in self._decode_shapes()]
            steps += [("prefill", self._warm_prefill_args(*s)) for s in self.prefill_shapes()]
            steps += [(name, (a, kw)) for name, (a, kw) in steps for kw in self._adapted(kw)]
            lowered = [getattr(self.runner, f"lower_{name}")(*a, **kw) for name, (a, kw) in steps]
            with ThreadPoolExecutor(max(1, compile_threads)) as pool:
                list(pool.map(lambda program: program.compile(), lowered))
            logits = self._zero_logits
            for width in self._decode_shapes():
                args, kwargs = self._warm_decode_args(width)
                logits, self.state = self.runner.decode(*args, **kwargs)
            for shape in self.prefill_shapes():
                args, kwargs = self._warm_prefill_args(*shape)
                chunk_logits, self.state = self.runner.prefill(*args, **kwargs)
                targets = _upload(np.full((shape[0],), self.num_slots, np.int32))
                logits = _merge_rows(logits, chunk_logits, targets)
                logits = _merge_rows(self._zero_logits, chunk_logits, targets)
            self._warm_sampler(logits)

    def _adapted(self, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """A warm-up step's inputs with an adapter row, where that is another program (a
        decoder with LoRA enabled: its runner passes no adapters for a base-only batch)."""
        if "adapters" not in kwargs or not getattr(
            self.runner, "adapter_rows_change_the_program", False
        ):
            return []
        return [kwargs | {"adapters": [0] + kwargs["adapters"][1:]}]

    def _decode_shapes(self) -> list[int]:
        """The decode step's shapes to compile: one per block-table width."""
        return list(self.width_ladder)

    def _warm_decode_args(self, width: int) -> tuple[tuple, dict[str, Any]]:
        """A decode step of no active row over a block table ``width`` pages wide."""
        n = self.num_slots
        empty = _upload(np.full((n, width), self.allocator.num_pages, np.int32))
        state = self.state.with_block_table(empty).with_lengths(_upload(self._lengths))
        tokens, active = _upload(np.zeros((n,), np.int32)), _upload(np.zeros((n,), bool))
        return (state, tokens, active), self._lora([-1] * n)

    def _warm_prefill_args(self, rows: int, chunk: int) -> tuple[tuple, dict[str, Any]]:
        """A prefill batch of ``rows`` x ``chunk`` tokens into slots out of range."""
        state = self._device_state(self.max_pages_per_seq)
        nowhere = [self.num_slots] * rows
        kwargs = {"continuing": True, "min_len": chunk} | self._lora([-1] * rows)
        return (state, nowhere, [[0] * chunk] * rows), kwargs

    def _warm_sampler(self, logits: jax.Array) -> None:
        n, vocab = self.num_slots, self.model.config.vocab_size
        none = _upload(np.zeros((n,), bool))
        batch = self._sampler_batch([None] * n)
        out, self._counts = _sample_rows(
            logits, batch, self._counts, self._prompt_mask, _upload(np.zeros((n,), np.int32)), none
        )
        self._counts, self._prompt_mask = _set_row(
            self._counts,
            self._prompt_mask,
            _upload(np.int32(n)),
            _upload(np.zeros((vocab,), np.int32)),
            _upload(np.zeros((vocab,), bool)),
        )
        jax.block_until_ready((out, self._counts))

    def _sampler_batch(self, params: list[SamplingParams | None]) -> SamplerBatch:
        vocab, eos = self.model.config.vocab_size, self.model.eos_token_ids
        return SamplerBatch.from_params(params, vocab, eos, min_width=SAMPLER_WIDTH)


def _logprobs(host: dict[str, np.ndarray], row: int, n: int) -> TokenLogprobs:
    ids, values = host["top_ids"][row, :n], host["top_logprobs"][row, :n]
    top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return TokenLogprobs(int(host["tokens"][row]), float(host["logprobs"][row]), top)


def _as_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams(temperature=0.0)] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each.")
    return list(params)
