"""Continuous batching: many requests share one cache and one decode step.

``Engine`` is vLLM's ``LLMEngine`` in miniature. Requests arrive at any time
(``add_request``); each ``step`` is one scheduling round: the policy
(``spark_jax.serving.scheduler``) plans the step's decode and prefill rows, the executor
(``spark_jax.serving.executor``) runs them on the device and samples every row that finished
its prefill or decoded, and the host then checks stops and streams the deltas.

``Engine(model, ...)`` composes the parts for the model's kind:

- a decoder-only model: a paged KV cache (``PagedExecutor``), a page pool with automatic
  prefix caching, and chunked prefill. Pages are allocated on the host: a prompt's pages at
  admission (those the prefix cache already holds are shared, not computed), one more page
  when a decoding row crosses a page boundary. When none is free, the newest running
  sequence is preempted: it goes back to the head of the queue, to be re-prefilled from
  prompt + generated tokens (recompute, as vLLM does). Its generated count is kept, so its
  sampler keys (seed, step index) continue where they stopped: a request's tokens are those
  it gets alone from ``sj.generate`` (greedy or seeded), whatever it is batched with.
- an encoder-decoder model (NLLB / M2M100): the runner's dense per-slot cache
  (``DenseExecutor``) with whole-source prefill and no preemption (a request waits for a
  free slot and, once admitted, always finishes). Beam search requests
  (``add_beam_request(sj.BeamRequest(...))``) go through the same loop in a lane of their
  own (``BeamLane``, rows of its own: beams reorder their rows every step); each step admits
  waiting beam requests (up to the prefill rows' top), runs one chunk of search steps for
  all of them and reports those that finished: one ``RequestOutput`` each, at the end, with
  the ``BeamResult`` (HF's beam search returns only finished hypotheses: nothing streams).
  No prefix caching: a source is encoded whole, and its cross-attention keys are its own.

Speculative decoding (a decoder-only engine built with ``speculative_config``, vLLM's:
``{"method": "ngram", "num_speculative_tokens": K}``; ``spark_jax.serving.speculation``):
before each step the engine drafts up to K tokens for every speculative decoding row, by
prompt lookup over the request's own tokens or with a draft model, the target less some
layers or a draft head over the target's hidden states, each keeping a cache row per slot
(``spark_jax.serving.drafting``); the scheduler reserves their keys' pages; the step
verifies every decode row at once (K + 1 positions each; a row with no drafts decodes in it
as usual) and each row keeps its own number of drafts by the speculative rule (greedy: those
equal to the argmax, so the output is the engine's without speculation; sampled: the
rejection rule, so it follows the same distribution). Rejected drafts are rolled back by
lowering the row's length and giving back the pages past it. Every request speculates but
those that opt out (``add_request(..., speculative=False)``) and guided ones (a draft's token
mask needs the draft before it); a step with a guided decoding row drafts for nobody. The
kept tokens go through the request's one stop rule, token by token, so a row never emits
past a stop id, stop string or max_tokens. ``metrics()`` counts the drafts verified and kept.

Host and device overlap: a step dispatches its device work and then reads the tokens of the
step before, which ran meanwhile (each slot's last token stays on the device as the next
decode input). Stops are therefore seen one step late: a row that stopped was decoded once
more, and that token is dropped; a request's output is exactly what it is without overlap.
A speculative row's drafts need its last tokens, so while one has a step in flight that step
is read before the next is planned: speculation trades the overlap for several tokens per
step. A guided row's token mask is needed only by the pick: while one has a step in flight,
the next step's forward is dispatched first, then that step is read (the matchers advance),
then the pick runs with the masks, so the matcher work overlaps the forward as in
``generate``.

Multi-step decode (``num_scheduler_steps`` N > 1): a step that admits and prefills nothing
decodes its rows N steps in one device call (``Scheduler.extend``, ``_decode_chunk``), each
row N tokens or up to its max_tokens; they are read as one step's, through the same stop
rule: the tokens after a stop (id or string) are dropped, as a token decoded past a stop
before the host read it is. While a sequence waits, a call that would run some row to
its max_tokens before its end is one step instead, so the finish frees the slot at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from spark_jax.generation.beam import BeamRequest, BeamResult, check_beam_requests
from spark_jax.generation.guided import GuidedRow, guided_row
from spark_jax.generation.request import (
    GenerationResult,
    RequestState,
    TokenLogprobs,
    check_prompt,
    params_list,
    token_logprobs,
)
from spark_jax.models.common import bucket
from spark_jax.ops.kv_cache import stored_dtype
from spark_jax.ops.lora import adapter_slot
from spark_jax.ops.sampling import SamplingParams
from spark_jax.serving.executor import (
    DenseExecutor,
    HostTokens,
    PagedExecutor,
    Picks,
    check_sampler_width,
)
from spark_jax.serving.pages import PageAllocator
from spark_jax.serving.scheduler import (
    ChunkBudget,
    Scheduler,
    SequenceState,
    pow2_ladder,
    ragged_ladder,
)
from spark_jax.serving.speculation import SpeculativeConfig
from spark_jax.serving.warmup import run_steps_again, warmup

MIN_CHUNK = 16  # the decoder's smallest prefill bucket: chunk ladders start here
MIN_DECODE_PAGES = 8  # the narrowest block table a decode step gathers

# Constructor keywords by model kind (max_num_seqs, max_model_len, max_prefill_seqs: both).
DECODER_ONLY_OPTIONS = ("max_batch_tokens", "kv_pages", "page_size", "min_chunk")
DECODER_ONLY_OPTIONS += ("min_decode_pages", "decode_widths", "gpu_memory_utilization")
DECODER_ONLY_OPTIONS += ("max_num_batched_tokens", "num_scheduler_steps", "ragged_prefill")
DECODER_ONLY_OPTIONS += ("mixed_batches", "prefill_sizes")

log = logging.getLogger("spark_jax.serving")
ENCODER_DECODER_OPTIONS = ("max_source_len", "max_num_beams")


@dataclass
class RequestOutput:
    """What one step produced for one request: its new tokens, their text, and its end."""

    request_id: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    result: GenerationResult | BeamResult | None = None  # set when finished
    logprobs: list[TokenLogprobs] | None = None  # the new tokens' (when the request asks)


@dataclass(frozen=True)
class EngineMetrics:
    """A snapshot of what the engine holds and has done (for a server's metrics)."""

    num_running: int  # sequences holding a cache row (beam searches included)
    num_waiting: int  # requests queued for a row (beam requests included)
    pages_in_use: int  # KV pages held by running sequences (0 for a dense cache)
    pages_free: int  # pages free or evictable
    num_pages: int  # the page pool's size (0 for a dense cache)
    pages_cached: int  # pages registered in the prefix cache
    prefix_cache_hit_rate: float | None  # of the full prompt pages looked up; None when off
    prompt_tokens: int  # tokens computed by prefills (a preempted row's output included)
    cached_prompt_tokens: int  # tokens the prefix cache had instead
    generation_tokens: int  # tokens generated (read back)
    num_preemptions: int
    num_draft_tokens: int = 0  # speculative drafts verified
    num_accepted_tokens: int = 0  # of those, kept


class _Request:
    """A request the engine holds: its place in the schedule, its output, its timings."""

    def __init__(self, seq: SequenceState, out: RequestState):
        self.seq = seq
        self.out = out
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None

    def result(self) -> GenerationResult:
        now = time.perf_counter()
        timings = {"total_s": now - self.arrival, "preemptions": float(self.seq.num_preemptions)}
        timings["cached_tokens"] = float(self.seq.num_cached_tokens)  # from the prefix cache
        if self.first_token_at is not None:
            timings["ttft_s"] = self.first_token_at - self.arrival
        return self.out.result(timings)


class _BeamRequests:
    """The engine's beam requests: lane index -> request id, and those aborted mid-search."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}  # lane index -> request id
        self.aborted: set[int] = set()  # lane indices whose result is dropped

    def index_of(self, request_id: int) -> int | None:
        return next((i for i, r in self.ids.items() if r == request_id), None)


class Engine:
    """Continuous batching over one model (see the module docstring).

    Both kinds: max_num_seqs: cache rows, i.e. sequences decoded at once. max_model_len: the
    longest prompt + output of a decoder-only model, the decoder positions per row (the 2
    seed tokens plus the longest output) of an encoder-decoder (default: the model's
    positions). max_prefill_seqs: sequences prefilled in one step (the row ladder's top).

    Decoder-only models:
    max_batch_tokens: padded prefill tokens per step (a power of two >= 16, default 256);
        also the longest prefill chunk.
    kv_pages, page_size: the page pool (pages of 16 by default); by default every row can
        reach max_model_len. On the GPU the decode step reads pages in place: with cuDNN's
        paged attention where ``kv_pages`` is a multiple of the step's rows with at least
        ``max_model_len`` worth of pages per row (the default pool is), else with our paged
        kernel on Hopper (bf16 / f16); elsewhere it gathers the rows.
    min_chunk, min_decode_pages: the lowest rungs of the prefill-length and block-table
        ladders; raising them trades padding for fewer compiles (each costs ~25 s for an
        unrolled 8B model on the H200).
    prefill_sizes: the token counts a prefill batch is padded to, one program each (a ragged
        batch's total, a [B, T] batch's chunk), ending at ``max_batch_tokens``; default: the
        ladder from ``min_chunk`` (powers of two, and every eighth of ``max_batch_tokens``
        when ragged). A finer ladder computes less padding at the price of more compiles,
        as ``decode_widths`` does for decode steps.
    num_scheduler_steps: decode steps per device call (vLLM's multi-step scheduling; default
        1). With more, a step that only decodes runs that many steps in one call when no
        row is guided, speculative, adapted or asks for top-k / top-p / top logprobs, and
        the pages of their keys are free: the host's work per token (planning, dispatch,
        reading) is shared by the steps. Outputs are unchanged; a row that finishes inside
        a call frees its slot at the call's end. Warm-up compiles one more program per
        decode width. On an H100 (Llama-3-8B shapes, the serving suite's requests) 4 steps a
        call gave 1.13x the throughput of 1 at 64 clients and 1.07x at 256, and a TTFT p50
        of 46 ms against 32 at 64 (an arrival waits for the call in flight).
    ragged_prefill: a prefill batch's rows lie one after another instead of each row padded
        to the longest's rung (default True): ``max_batch_tokens`` then bounds their real
        tokens, and only their total is padded, to the next eighth of ``max_batch_tokens``
        (``scheduler.ragged_ladder``), so the matmuls compute fewer padding positions (the
        serving suite's prompts pad 1.87x as [B, T] batches, 1.09x ragged, in a CPU replay).
        Attention still sees the row ladder's top of rows, each as long as the batch. On an
        H100 (Llama-3-8B shapes, the serving suite's requests, 4 steps a call) it gave 1.05x
        the [B, T] batches' throughput at 64 clients and 1.10x at 256.
    mixed_batches: a step that prefills also decodes its decoding rows in the same forward
        (vLLM's chunked prefill): their tokens ride in the ragged batch, so the weights are
        read once for both, not once for the decode step and again for the prefill. The
        decode rows count in ``max_batch_tokens``, and every prefill program takes
        ``max_num_seqs`` decode rows. Default: on wherever it applies, that is with ragged
        batches, no draft head (``"method": "head"``: it reads every step's hidden states),
        and ``max_batch_tokens`` >= ``max_num_seqs`` + ``min_chunk`` (room for a chunk
        beside every row). Outputs are unchanged. On the H100 above: 1.04x ragged batches'
        throughput at 64 clients, 1.07x at 256.

    Encoder-decoder models:
    max_source_len: the longest source (default: the model's, positions - 2); the prefill
        compiles one program per power-of-two source length up to it.
    max_num_beams: the beam lane's widest request (default: 8, at most max_num_seqs); the
        lane has ``max_num_seqs`` cache rows of its own (waiting requests wait for rows).

    speculative_config (decoder-only): vLLM's dict, e.g. ``{"method": "ngram",
        "num_speculative_tokens": 4}`` (see ``spark_jax.serving.speculation`` for the keys);
        None: no speculation.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        max_prefill_seqs: int = 8,
        max_batch_tokens: int | None = None,
        kv_pages: int | None = None,
        page_size: int | None = None,
        min_chunk: int | None = None,
        min_decode_pages: int | None = None,
        decode_widths: Sequence[int] | None = None,
        prefill_sizes: Sequence[int] | None = None,
        enable_prefix_caching: bool | None = None,
        gpu_memory_utilization: float | None = None,
        max_num_batched_tokens: int | None = None,
        max_source_len: int | None = None,
        max_num_beams: int | None = None,
        speculative_config: Mapping[str, Any] | SpeculativeConfig | None = None,
        num_scheduler_steps: int | None = None,
        ragged_prefill: bool | None = None,
        mixed_batches: bool | None = None,
    ):
        options = dict(
            max_batch_tokens=max_batch_tokens, kv_pages=kv_pages, page_size=page_size,
            min_chunk=min_chunk, min_decode_pages=min_decode_pages, decode_widths=decode_widths,
            prefill_sizes=prefill_sizes, gpu_memory_utilization=gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens,
            max_source_len=max_source_len, max_num_beams=max_num_beams,
            num_scheduler_steps=num_scheduler_steps, ragged_prefill=ragged_prefill,
            mixed_batches=mixed_batches,
        )  # fmt: skip
        encoder_decoder = bool(model.config.is_encoder_decoder)
        wrong = DECODER_ONLY_OPTIONS if encoder_decoder else ENCODER_DECODER_OPTIONS
        given = [name for name in wrong if options[name] is not None]
        if given:
            kind = "an encoder-decoder" if encoder_decoder else "a decoder-only"
            raise ValueError(
                f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply to "
                f"{kind} model's engine; leave {'it' if len(given) == 1 else 'them'} out."
            )
        if encoder_decoder and enable_prefix_caching:
            raise ValueError(
                "prefix caching does not apply to an encoder-decoder model (its sources are "
                "encoded whole and their keys are their own); leave enable_prefix_caching out."
            )
        if encoder_decoder and speculative_config is not None:
            raise ValueError(
                "speculative decoding applies to decoder-only models; leave "
                "speculative_config out for an encoder-decoder model."
            )
        self.speculative = (
            None if speculative_config is None else SpeculativeConfig.parse(speculative_config)
        )
        self.enable_prefix_caching = (
            not encoder_decoder if enable_prefix_caching is None else enable_prefix_caching
        )
        self.model = model
        self.num_slots = max_num_seqs
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.executor: PagedExecutor | DenseExecutor
        self._beam_requests: _BeamRequests | None = None
        if encoder_decoder:
            self._compose_dense(max_prefill_seqs, max_source_len, max_num_beams)
        else:
            self._compose_paged(
                max_prefill_seqs,
                max_batch_tokens or 256,
                kv_pages,
                page_size or 16,
                min_chunk or MIN_CHUNK,
                min_decode_pages or MIN_DECODE_PAGES,
                decode_widths,
                prefill_sizes,
                gpu_memory_utilization,
                max_num_batched_tokens,
                num_scheduler_steps or 1,
                ragged_prefill,
                mixed_batches,
            )
        self._drafter = None
        if self.speculative is not None:
            self._drafter = self.speculative.row_drafter(
                model, self.executor, self.max_model_len, min_chunk or MIN_CHUNK
            )
        self._requests: dict[int, _Request] = {}
        self._in_flight: list[Picks] = []  # the last dispatched step's picks, not yet read
        self._generated = 0  # tokens read back
        self._drafted = 0  # speculative drafts verified
        self._accepted = 0  # of those, kept
        self._pending: list[RequestOutput] = []  # outputs made outside a step (aborts, errors)
        self._next_id = 0
        self._lock = threading.RLock()
        self._queues: dict[int, asyncio.Queue[RequestOutput]] = {}
        self._driver: asyncio.Task[None] | None = None

    def _compose_paged(
        self,
        max_prefill_seqs: int,
        max_batch_tokens: int,
        kv_pages: int | None,
        page_size: int,
        min_chunk: int,
        min_decode_pages: int,
        decode_widths: Sequence[int] | None,
        prefill_sizes: Sequence[int] | None,
        gpu_memory_utilization: float | None,
        max_num_batched_tokens: int | None,
        num_scheduler_steps: int,
        ragged_prefill: bool | None,
        mixed_batches: bool | None,
    ) -> None:
        if num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be >= 1, got {num_scheduler_steps}.")
        self.num_scheduler_steps = num_scheduler_steps
        for name, value in (("max_batch_tokens", max_batch_tokens), ("min_chunk", min_chunk)):
            if value < MIN_CHUNK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_CHUNK}, got {value}")
        if min_chunk > max_batch_tokens:
            raise ValueError(f"min_chunk {min_chunk} exceeds max_batch_tokens {max_batch_tokens}")
        self._check_limits = self._check_prompt_limits
        self.page_size = page_size
        least = self.num_slots + min_chunk
        ragged_prefill = True if ragged_prefill is None else ragged_prefill
        head = self.speculative is not None and self.speculative.method == "head"
        if mixed_batches:
            _check_mixed_batches(ragged_prefill, head, max_batch_tokens, least, self.num_slots)
        mixed = mixed_batches
        if mixed is None:  # where it applies
            mixed = ragged_prefill and not head and max_batch_tokens >= least
        if max_num_batched_tokens is not None and max_num_batched_tokens < least:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens} leaves no room for a prefill "
                f"chunk of {min_chunk} beside {self.num_slots} decoding rows; raise it to at "
                f"least {least}."
            )
        widths = sorted(set(decode_widths or pow2_ladder(1, self.num_slots)))
        if widths[0] < 1 or widths[-1] != self.num_slots:
            raise ValueError(
                f"decode_widths must be positive and end at max_num_seqs={self.num_slots}, "
                f"got {list(decode_widths or [])}."
            )
        max_pages_per_seq = math.ceil(self.max_model_len / page_size)
        if kv_pages is None:
            kv_pages = self.num_slots * max_pages_per_seq
            if gpu_memory_utilization is not None:
                kv_pages = self._pages_that_fit(
                    gpu_memory_utilization, page_size, max_batch_tokens, max_pages_per_seq
                )
        elif gpu_memory_utilization is not None:
            raise ValueError("give kv_pages or gpu_memory_utilization, not both.")
        top_rows = max(1, min(max_prefill_seqs, max_batch_tokens // min_chunk))
        self.scheduler = Scheduler(
            self.num_slots,
            pow2_ladder(1, top_rows),
            PageAllocator(kv_pages, self.enable_prefix_caching),
            page_size,
            ChunkBudget(
                max_batch_tokens,
                _prefill_ladder(prefill_sizes, ragged_prefill, min_chunk, max_batch_tokens),
                ragged_prefill,
                mixed,
            ),
            max_num_batched_tokens,
        )
        low = min(min_decode_pages, max_pages_per_seq)
        self.executor = PagedExecutor(
            self.model,
            self.num_slots,
            kv_pages,
            page_size,
            max_pages_per_seq,
            pow2_ladder(low, max_pages_per_seq),
            widths,
            top_rows,
            0 if self.speculative is None else self.speculative.num_speculative_tokens,
            num_scheduler_steps,
            keep_hidden=self.speculative is not None and self.speculative.method == "head",
            ragged_prefill=ragged_prefill,
            mixed=mixed,
        )
        log.info(
            "KV cache: %d pages of %d tokens (%.2f GiB, %d tokens); prefix caching %s; "
            "prefill batches %s",
            kv_pages, page_size, self.executor.state.nbytes / 2**30, kv_pages * page_size,
            "on" if self.enable_prefix_caching else "off",
            "mixed" if mixed else "ragged" if ragged_prefill else "padded",
        )  # fmt: skip

    def _pages_that_fit(
        self, utilization: float, page_size: int, max_batch_tokens: int, max_pages_per_seq: int
    ) -> int:
        """The pages that fill ``utilization`` of the device's memory (``pages_that_fit``);
        at least one sequence of max_model_len's."""
        # An fp8 cache holds a key or value in a byte: twice the pages of a bf16 one.
        itemsize = stored_dtype(self.model.kv_cache_dtype, self.model.dtype).itemsize
        pages = pages_that_fit(
            self.model.config, itemsize, utilization, page_size, max_batch_tokens, self.num_slots
        )
        if pages < max_pages_per_seq:
            raise ValueError(
                f"gpu_memory_utilization={utilization} leaves room for {max(pages, 0)} KV pages, "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs "
                f"({max_pages_per_seq}); raise it or lower max_model_len."
            )
        return pages

    def _compose_dense(
        self, max_prefill_seqs: int, max_source_len: int | None, max_num_beams: int | None
    ) -> None:
        max_num_beams = max_num_beams or min(8, self.num_slots)
        if max_num_beams > self.num_slots:
            raise ValueError(
                f"max_num_beams={max_num_beams} exceeds max_num_seqs={self.num_slots}: a beam "
                "request needs one cache row per beam; raise max_num_seqs."
            )
        self._check_limits = self._check_source_limits
        longest = self.model.runner.max_source_len
        self.max_source_len = min(max_source_len or longest, longest)
        self.max_num_beams = max_num_beams
        self.source_ladder = pow2_ladder(bucket(1), bucket(self.max_source_len))
        self.scheduler = Scheduler(self.num_slots, pow2_ladder(1, max(1, max_prefill_seqs)))
        self.executor = DenseExecutor(
            self.model, self.num_slots, self.max_model_len, self.max_source_len, max_num_beams,
            self.scheduler.row_ladder[-1],
        )  # fmt: skip
        self._beam_requests = _BeamRequests()

    # -- the parts ----------------------------------------------------------------------------

    @property
    def runner(self) -> Any:
        """The model's runner, which the executor drives."""
        return self.executor.runner

    @runner.setter
    def runner(self, runner: Any) -> None:
        self.executor.runner = runner

    @property
    def width_ladder(self) -> list[int]:
        """The decode step's block-table widths (none for a dense cache)."""
        return list(self.executor.width_ladder) if isinstance(self.executor, PagedExecutor) else []

    @property
    def row_ladder(self) -> list[int]:
        return self.scheduler.row_ladder

    @property
    def beams(self) -> Any:
        """The beam lane (``BeamLane``) of an encoder-decoder engine; None otherwise."""
        return self.executor.beams if isinstance(self.executor, DenseExecutor) else None

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk) prefill batch the scheduler can form; (rows, source length)
        for an encoder-decoder."""
        if isinstance(self.executor, DenseExecutor):
            return [(b, t) for b in self.scheduler.row_ladder for t in self.source_ladder]
        return self.scheduler.prefill_shapes()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def slots_in_use(self) -> int:
        return self.scheduler.slots_in_use

    @property
    def pages_in_use(self) -> int:
        return self.scheduler.pages_in_use

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        speculative: bool = True,
    ) -> int:
        """Queues a request; returns its id. Bad requests are refused here, before any work.

        ``speculative=False``: the request decodes one token per step even when the engine
        speculates (it still shares the verify steps, as a row without drafts)."""
        params = SamplingParams(temperature=0.0) if params is None else params
        prompt, guide = self._check(prompt_ids, params)
        adapter = adapter_slot(self.runner.lora_pool, params.adapter)  # unknown names fail here
        if params.seed is None:  # drawn once, so the draws never change under preemption
            params = dataclasses.replace(params, seed=secrets.randbits(63))
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            out = RequestState(
                request_id, prompt, params, self.model.eos_token_ids, self.model.tokenizer, guide
            )
            drafts = speculative and self.speculative is not None and guide is None
            seq = SequenceState(
                request_id, prompt, out.tokens, params, adapter, params.max_tokens,
                params.adapter, guide, drafts,
            )  # fmt: skip
            self._requests[request_id] = _Request(seq, out)
            self.scheduler.add(seq)
        return request_id

    def _check(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> tuple[list[int], GuidedRow | None]:
        """The prompt as ints and its grammar's matcher; ValueError for a request this engine
        can never run."""
        prompt = self._check_limits(prompt_ids, params)
        check_sampler_width(params, self.model.eos_token_ids, self.model.config.vocab_size)
        return prompt, guided_row(self.model, params)

    def _check_prompt_limits(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """A decoder-only prompt: its output must fit max_model_len and the page pool."""
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size)
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens and asks for {params.max_tokens} more, "
                f"past max_model_len={self.max_model_len}; shorten it or lower max_tokens."
            )
        pages = self.scheduler.pages
        assert pages is not None
        if self.scheduler.pages_for(total) > pages.num_pages:
            raise ValueError(
                f"{total} tokens need more than the {pages.num_pages} KV pages of "
                f"{self.page_size}; raise kv_pages."
            )
        return prompt

    def _check_source_limits(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """An encoder-decoder source: the runner's checks, then this engine's cache sizes."""
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size, what="the source")
        prompt = self.runner.source_tokens(prompt, params)
        self.runner.target_language_id(params)
        if len(prompt) > self.max_source_len:
            raise ValueError(
                f"the source has {len(prompt)} tokens, past this engine's max_source_len="
                f"{self.max_source_len}; split the text or raise max_source_len."
            )
        if params.max_tokens + 2 > self.max_model_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the 2 seed tokens is past this engine's "
                f"max_model_len={self.max_model_len}; lower max_tokens."
            )
        return prompt

    def add_beam_request(self, request: BeamRequest) -> int:
        """Queues a beam search (encoder-decoder models); returns its request id (shared
        with ``add_request``'s)."""
        if self._beam_requests is None:
            raise ValueError(
                "beam search needs an encoder-decoder model (NLLB / M2M100); this engine "
                "serves a decoder-only model."
            )
        ((request, adapter),) = check_beam_requests(self.runner, [request])
        if len(request.prompt_tokens) > self.max_source_len:
            raise ValueError(
                f"the source has {len(request.prompt_tokens)} tokens, past this engine's "
                f"max_source_len={self.max_source_len}; split the text or raise it."
            )
        with self._lock:
            index = self.executor.beams.add(request, adapter)
            request_id = self._next_id
            self._next_id += 1
            self._beam_requests.ids[index] = request_id
        return request_id

    def abort(self, request_id: int) -> bool:
        """Stops a request and frees its slot and pages; False if it already ended.

        A beam search still waiting leaves the queue; a running one finishes its search on
        the device but reports "abort" now and nothing after.
        """
        with self._lock:
            if self._abort_beam(request_id):
                return True
            request = self._requests.pop(request_id, None)
            if request is None:
                return False
            self.scheduler.remove(request.seq)
            request.out.finish("abort")
            self._pending.append(RequestOutput(request_id, [], "", True, request.result()))
            return True

    def _abort_beam(self, request_id: int) -> bool:
        beams = self._beam_requests
        index = None if beams is None else beams.index_of(request_id)
        if index is None or index in beams.aborted:
            return False
        lane = self.executor.beams
        waiting = [item for item in lane.pending if item[0] == index]
        if waiting:
            lane.pending.remove(waiting[0])
            del beams.ids[index]
        else:
            beams.aborted.add(index)
        self._pending.append(RequestOutput(request_id, [], "", True, BeamResult([], [])))
        return True

    def has_unfinished(self) -> bool:
        beams = self._beam_requests is not None and bool(self._beam_requests.ids)
        # A step still in flight holds only rows of requests held here, or of ended ones.
        return bool(self._requests or self._pending) or beams

    def reset_prefix_cache(self) -> bool:
        """Empties the prefix cache (vLLM's name): later requests find none of the pages
        earlier ones computed, as on a fresh engine (a benchmark's levels, or after changing
        what a cached page would hold). Running requests keep their pages. False when this
        engine caches no prefixes (encoder-decoder, ``enable_prefix_caching=False``)."""
        with self._lock:
            pages = self.scheduler.pages
            if pages is None or not pages.enable_prefix_caching:
                return False
            pages.reset_prefix_cache()
            return True

    def metrics(self) -> EngineMetrics:
        """What the engine holds now and has done so far (read-only)."""
        with self._lock:
            pages = self.scheduler.pages
            lane = self.beams
            searching = 0 if lane is None else len(lane.searching) + len(lane.finished)
            pending = 0 if lane is None else len(lane.pending)
            caching = pages is not None and pages.enable_prefix_caching
            return EngineMetrics(
                num_running=self.scheduler.slots_in_use + searching,
                num_waiting=len(self.scheduler.waiting) + pending,
                pages_in_use=0 if pages is None else pages.in_use,
                pages_free=0 if pages is None else pages.num_free,
                num_pages=0 if pages is None else pages.num_pages,
                pages_cached=pages.num_cached if caching else 0,
                prefix_cache_hit_rate=pages.hit_rate if caching else None,
                prompt_tokens=self.scheduler.num_prefilled_tokens,
                cached_prompt_tokens=self.scheduler.num_cached_tokens,
                generation_tokens=self._generated,
                num_preemptions=self.scheduler.num_preemptions,
                num_draft_tokens=self._drafted,
                num_accepted_tokens=self._accepted,
            )

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
        """Dispatches this step, then reads the one before (which ran meanwhile). A speculative
        row's drafts need its last token: with one in flight, that step is read first, so such
        rows take one step per read (the other rows in the batch too). A guided row's token
        mask needs its last token only for the pick: with one in flight, the step is read
        after the decode rows' forward is dispatched and before their pick, so the host's
        matcher work overlaps the forward."""
        outputs: list[RequestOutput] = []
        running = self.scheduler.running()
        if any(s.speculative and s.in_flight for s in running):
            outputs = self._read_in_flight()
        masks_wait = any(s.guide is not None and s.in_flight for s in running)
        self._draft()
        plan = self.scheduler.plan()
        if isinstance(self.executor, PagedExecutor) and self.executor.chunkable(plan.decode):
            self.scheduler.extend(plan, self.num_scheduler_steps)
        dispatched: list[Picks] = []
        if not plan.empty:
            read = (lambda: outputs.extend(self._read_in_flight())) if masks_wait else None
            dispatched = self.executor.run(plan, self.scheduler.slots, before_pick=read)
            self.scheduler.advance(plan)
        outputs += self._read_in_flight()
        self._in_flight = dispatched
        if self._beam_requests is not None:
            outputs += self._beam_step()
        return outputs

    def _read_in_flight(self) -> list[RequestOutput]:
        """The outputs of the step in flight (none once read)."""
        previous, self._in_flight = self._in_flight, []
        return [out for picks in previous for out in self._read(picks)]

    def _read(self, picks: Picks) -> list[RequestOutput]:
        """The outputs of one pick's rows; rows of requests that ended since are dropped."""
        host = picks.read()
        outputs = []
        for row, seq in enumerate(picks.seqs):
            if seq is None:
                continue
            seq.in_flight -= picks.steps_of(row)
            request = self._requests.get(seq.id)
            if request is not None and request.seq is seq:
                outputs.append(self._emit(seq, host, row))
        return outputs

    def _draft(self) -> None:
        """Each speculative decoding row's drafts for this step (``spark_jax.serving.drafting``:
        prompt lookup, a draft model or a head, from the row's tokens, all read: see
        ``_step``), as many as its output has room for after the target's token; none in a
        step with a guided decoding row (the verify step applies no token masks)."""
        if self._drafter is None:
            return
        rows = [s for s in self.scheduler.running() if not s.prefilling]
        if any(s.guide is not None for s in rows):
            return
        k = self.speculative.num_speculative_tokens
        drafting = []
        for seq in rows:
            room = min(k, seq.max_new - seq.num_scheduled - 1)
            if seq.speculative and room > 0 and not seq.in_flight:
                drafting.append((seq, room))
        self._drafter.propose(drafting)

    def _emit(self, seq: SequenceState, host: HostTokens, row: int) -> RequestOutput:
        """The row's tokens (one, or a verify step's kept drafts and the target's token)
        through the request's stop rule, one by one: none past a stop is emitted."""
        request = self._requests[seq.id]
        n = seq.params.logprobs
        tokens, logprobs, delta = [], [], ""
        for token, at in host.row_tokens(row):
            lp = None if n is None else token_logprobs(host, row, at, n)
            delta += request.out.add(token, lp)
            tokens.append(token)
            logprobs += [] if lp is None else [lp]
            if request.out.finished:
                break
        self._generated += len(tokens)
        if host.num_accepted is not None:
            self._drafted += int(host.num_drafts[row])
            self._accepted += int(host.num_accepted[row])
        if request.first_token_at is None:
            request.first_token_at = time.perf_counter()
        lps = logprobs if n is not None else None
        if not request.out.finished:
            if host.num_accepted is not None and seq.speculative:
                self.scheduler.accept(seq, int(host.num_accepted[row]))
            return RequestOutput(seq.id, tokens, delta, logprobs=lps)
        self.scheduler.remove(seq)  # waiting if preempted while its last token was in flight
        del self._requests[seq.id]
        return RequestOutput(seq.id, tokens, delta, True, request.result(), lps)

    def _beam_step(self) -> list[RequestOutput]:
        """One chunk of search steps of every running beam request; their finished results."""
        beams = self._beam_requests
        outputs = []
        for index, result in self.executor.run_beams(self.scheduler.row_ladder[-1]).items():
            request_id = beams.ids.pop(index)
            if index in beams.aborted:
                beams.aborted.discard(index)
            else:
                outputs.append(RequestOutput(request_id, [], "", True, result))
        return outputs

    def _fail_all(self) -> None:
        """After a failed step: every request ends with "error" and gives back what it held;
        beam searches end with an empty result."""
        self.scheduler.clear()
        self._in_flight = []
        for request in self._requests.values():
            request.out.finish("error")
            self._pending.append(RequestOutput(request.seq.id, [], "", True, request.result()))
        self._requests.clear()
        beams = self._beam_requests
        if beams is not None:
            for index, request_id in beams.ids.items():
                if index not in beams.aborted:
                    empty = BeamResult([], [])
                    self._pending.append(RequestOutput(request_id, [], "", True, empty))
            self._beam_requests = _BeamRequests()
            self.executor.new_beam_lane()

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
        plist = params_list(params, len(prompts))
        for prompt, p in zip(prompts, plist, strict=True):
            self._check(prompt, p)  # all refused before any is queued
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

    def warmup(self, compile_threads: int = 8) -> None:
        """Compiles every step shape (decode, prefill batches, sampler; an encoder-decoder's
        beam lane too) on ``compile_threads`` threads and runs each once on rows out of range,
        so a warmed engine never compiles (``spark_jax.serving.warmup``); on the GPU each
        once more at the end, so their CUDA graphs are recorded before the first request."""
        with self._lock:
            shapes, admitted = self.prefill_shapes(), self.scheduler.row_ladder[-1]
            warmup(self.executor, shapes, admitted, compile_threads)
            if self._drafter is not None:
                self._drafter.warm()
            if jax.default_backend() == "gpu":  # where XLA records CUDA graphs (warmup.py)
                run_steps_again(self.executor, shapes, admitted)
                if self._drafter is not None:
                    self._drafter.warm()


def _prefill_ladder(
    sizes: Sequence[int] | None, ragged: bool, min_chunk: int, max_batch_tokens: int
) -> list[int]:
    """The token counts a prefill batch pads to: ``sizes`` (checked), else the default ladder
    from ``min_chunk`` to ``max_batch_tokens`` (``ragged_ladder`` for ragged batches)."""
    if sizes is None:
        return (ragged_ladder if ragged else pow2_ladder)(min_chunk, max_batch_tokens)
    ladder = sorted({int(n) for n in sizes})
    if not ladder or ladder[0] < 1 or ladder[-1] != max_batch_tokens:
        raise ValueError(
            f"prefill_sizes must be positive and end at max_batch_tokens={max_batch_tokens}, "
            f"got {list(sizes)}."
        )
    return ladder


def _check_mixed_batches(
    ragged: bool, head: bool, max_batch_tokens: int, least: int, num_slots: int
) -> None:
    """``mixed_batches=True`` asks for what it needs: ragged batches, no draft head, and room
    for a prefill chunk beside every decode row."""
    if not ragged:
        raise ValueError(
            "mixed_batches rides the decode rows in ragged prefill batches; leave "
            "ragged_prefill on (its default) or mixed_batches off."
        )
    if head:
        raise ValueError(
            "mixed_batches does not combine with a draft head (it reads every step's hidden "
            "states); leave one of them out."
        )
    if max_batch_tokens < least:
        raise ValueError(
            f"max_batch_tokens={max_batch_tokens} leaves no room for a prefill chunk beside "
            f"{num_slots} decode rows riding in the batch (mixed_batches); raise it to at "
            f"least {least}."
        )


def device_memory_stats() -> dict[str, int] | None:
    """The first device's memory statistics (None where it reports none, as the CPU)."""
    return jax.devices()[0].memory_stats()


def pages_that_fit(
    config: Any,
    kv_itemsize: int,
    utilization: float,
    page_size: int,
    max_batch_tokens: int,
    num_slots: int,
) -> int:
    """The KV pages (``kv_itemsize`` bytes a key or value) that fill ``utilization`` of the
    device's memory beside what it already holds (the weights) and a step's working memory; a
    multiple of ``num_slots``, so cuDNN's paged attention can read them in place (vLLM's
    ``gpu_memory_utilization``)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}.")
    stats = device_memory_stats()
    if not stats or "bytes_limit" not in stats:
        raise ValueError(
            f"the {jax.default_backend()} device reports no memory limit, so "
            "gpu_memory_utilization cannot size the KV cache; pass kv_pages instead."
        )
    page_bytes = 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim
    page_bytes *= kv_itemsize
    # A step's working set: a prefill batch's activations and every slot's logits and
    # sampler state (fp32 / int32 rows of the vocabulary, a few copies each).
    work = max_batch_tokens * (4 * config.intermediate_size + 2 * config.vocab_size) * 4
    work += 6 * num_slots * config.vocab_size * 4
    room = utilization * stats["bytes_limit"] - stats.get("bytes_in_use", 0) - work
    return int(room // page_bytes) // num_slots * num_slots
