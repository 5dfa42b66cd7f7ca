"""Continuous batching for encoder-decoder models (NLLB / M2M100): ``sj.Engine`` on one of them.

The scheduling loop, the sampler, streaming, aborts and the asyncio API are ``Engine``'s; what
differs is the cache and the prefill, so this subclass overrides only those hooks:

- the cache is the runner's dense ``EncoderDecoderCache``: each slot holds its own decoder
  keys (``max_model_len`` positions: the two seed tokens and the generated ones) and its
  source's cross-attention keys (``max_source_len``). No pages, so no preemption: a request
  waits for a free slot and, once admitted, always finishes.
- the prefill is whole: the encoder attends in both directions, so a source is encoded at once
  (with its cross K/V and the decoder seed ``[eos, tgt_lang]``), never in chunks. Sources
  admitted in one step are prefilled as one batch, padded to a ladder of row counts with
  copies of the first that write nowhere.

Per-request ``src_lang`` / ``tgt_lang`` / ``adapter`` come from ``SamplingParams``; a
request's tokens are those ``sj.generate`` gives it alone.

Beam search requests (``add_beam_request(sj.BeamRequest(...))``) go through the same loop in
a lane of their own: a ``beam.BeamLane`` with its own cache rows (beams reorder their rows
every step, which the greedy slots never do). Each engine step admits waiting beam requests
(up to the prefill ladder's top), runs one chunk of search steps for all of them as one batch
and reports the requests that finished: one ``RequestOutput`` each, at the end, with the
``BeamResult`` as its result (HF's beam search returns only finished hypotheses, so there is
nothing to stream). A request's hypotheses are those ``sj.generate_beam`` gives it alone.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from spark_jax.generation.beam import BeamLane, BeamRequest, BeamResult, _check
from spark_jax.models.common import bucket
from spark_jax.ops.sampling import SamplingParams
from spark_jax.serving.engine import (
    Engine,
    RequestOutput,
    _check_sampler_width,
    _commit,
    _merge_rows,
    _pow2_ladder,
    _rung,
    _Sequence,
    _upload,
)


class EncoderDecoderEngine(Engine):
    """``Engine`` over an encoder-decoder model (see the module docstring).

    max_num_seqs: cache rows, i.e. translations decoded at once.
    max_model_len: decoder positions per row: the 2 seed tokens plus the longest output
        (default: the model's positions).
    max_source_len: the longest source (default: the model's, positions - 2); the prefill
        compiles one program per power-of-two source length up to it.
    max_prefill_seqs: sources encoded in one step (the row ladder's top).
    max_num_beams: the beam lane's widest request (default: 8, at most max_num_seqs); the
        lane has ``max_num_seqs`` cache rows of its own (waiting requests wait for rows).
    """

    def __init__(
        self,
        model: Any,
        max_num_seqs: int = 32,
        max_model_len: int | None = None,
        max_source_len: int | None = None,
        max_prefill_seqs: int = 8,
        max_num_beams: int | None = None,
    ):
        max_num_beams = max_num_beams or min(8, max_num_seqs)
        if max_num_beams > max_num_seqs:
            raise ValueError(
                f"max_num_beams={max_num_beams} exceeds max_num_seqs={max_num_seqs}: a beam "
                "request needs one cache row per beam; raise max_num_seqs."
            )
        self.model = model
        self.runner = model.runner
        self.num_slots = max_num_seqs
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.max_source_len = min(
            max_source_len or self.runner.max_source_len, self.runner.max_source_len
        )
        self.row_ladder = _pow2_ladder(1, max(1, max_prefill_seqs))
        self.source_ladder = _pow2_ladder(bucket(1), bucket(self.max_source_len))
        self.width_ladder = []  # no block table: max_pages_per_seq 0 sizes the host's to nothing
        self.max_pages_per_seq = 0
        self.state = _commit(
            self.runner.init_state(self.num_slots, self.max_model_len, self.max_source_len)
        )
        self._init_host_state(0)
        self._init_sync()
        self.max_num_beams = max_num_beams
        self._new_beam_lane()

    def _new_beam_lane(self) -> None:
        # The same rows, length and sources as the greedy cache, committed like it; its row
        # table makes its prefills programs of their own (``_warm_beam_prefills``).
        self.beams = BeamLane(
            self.runner, self.max_num_beams, self.num_slots, self.max_model_len,
            self.max_source_len,
        )  # fmt: skip
        self.beams.carry = _commit(self.beams.carry)
        self._beam_ids: dict[int, int] = {}  # lane index -> request id
        self._beam_aborted: set[int] = set()  # lane indices whose result is dropped

    # -- beam requests ----------------------------------------------------------------------

    def add_beam_request(self, request: BeamRequest) -> int:
        """Queues a beam search; returns its request id (shared with ``add_request``'s)."""
        (adapter,) = _check(self.runner, [request])
        if len(request.prompt_tokens) > self.max_source_len:
            raise ValueError(
                f"the source has {len(request.prompt_tokens)} tokens, past this engine's "
                f"max_source_len={self.max_source_len}; split the text or raise it."
            )
        with self._lock:
            index = self.beams.add(request, adapter)
            request_id = self._next_id
            self._next_id += 1
            self._beam_ids[index] = request_id
        return request_id

    def abort(self, request_id: int) -> bool:
        """Stops a request; a beam search still waiting leaves the queue, a running one
        finishes its search on the device but reports "abort" now and nothing after."""
        with self._lock:
            index = next((i for i, r in self._beam_ids.items() if r == request_id), None)
            if index is None or index in self._beam_aborted:
                return super().abort(request_id)
            waiting = [item for item in self.beams.pending if item[0] == index]
            if waiting:
                self.beams.pending.remove(waiting[0])
                del self._beam_ids[index]
            else:
                self._beam_aborted.add(index)
            self._pending.append(RequestOutput(request_id, [], "", True, BeamResult([], [])))
            return True

    def _fail_all(self) -> None:
        """After a failed step: every request ends, beam searches with an empty result."""
        super()._fail_all()
        for index, request_id in self._beam_ids.items():
            if index not in self._beam_aborted:
                self._pending.append(RequestOutput(request_id, [], "", True, BeamResult([], [])))
        self._new_beam_lane()

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._beam_ids)

    def _step(self) -> list[RequestOutput]:
        return super()._step() + self._beam_step()

    def _beam_step(self) -> list[RequestOutput]:
        """One chunk of search steps of every running beam request; their finished results."""
        lane = self.beams
        if not lane.busy:
            return []
        lane.admit(limit=self.row_ladder[-1])
        lane.retire(np.asarray(lane.dispatch()))
        lane.collect()
        outputs = []
        for index in [i for i in self._beam_ids if i in lane.results]:
            result = lane.results.pop(index)
            request_id = self._beam_ids.pop(index)
            if index in self._beam_aborted:
                self._beam_aborted.discard(index)
            else:
                outputs.append(RequestOutput(request_id, [], "", True, result))
        return outputs

    # -- requests ---------------------------------------------------------------------------

    def _check(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"the source has token ids {bad[:5]} outside [0, {vocab}).")
        self.runner.check_source(prompt, params)
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
        _check_sampler_width(params, self.model.eos_token_ids)

    @property
    def pages_in_use(self) -> int:
        return 0  # a dense cache: slots only

    # -- slots ------------------------------------------------------------------------------

    def _reserve(self, seq: _Sequence) -> None:
        seq.prefill_target = len(seq.prompt)

    def _free(self, seq: _Sequence) -> None:
        pass  # the row's lengths are reset by its next prefill

    # -- scheduling -------------------------------------------------------------------------

    def _schedule_decode(self) -> tuple[list[_Sequence], bool]:
        return [s for s in self._running() if not s.prefilling], False

    def _schedule_prefill(self, admit: bool) -> list[tuple[_Sequence, int]]:
        """Admits waiting requests, first come first served, into free slots."""
        rows: list[tuple[_Sequence, int]] = []
        while admit and self._waiting and self._free_slots and len(rows) < self.row_ladder[-1]:
            seq = self._waiting.popleft()
            self._admit(seq)
            rows.append((seq, len(seq.prompt)))
        return rows

    # -- one step ---------------------------------------------------------------------------

    def _decode_state(self) -> Any:
        return self.state

    def _run_prefill(self, rows: list[tuple[_Sequence, int]], logits: Any) -> tuple[Any, list]:
        """Encodes the admitted sources and seeds their decoders; merges their first logits."""
        if not rows:
            return logits, []
        seqs = [s for s, _ in rows]
        pad = _rung(self.row_ladder, len(seqs)) - len(seqs)
        nowhere = self.num_slots  # a slot out of range: its writes are dropped
        first = seqs[0]
        slots = [s.slot for s in seqs] + [nowhere] * pad
        prompts = [s.prompt for s in seqs] + [first.prompt] * pad
        requests = [s.params for s in seqs] + [first.params] * pad
        adapters = [s.adapter for s in seqs] + [-1] * pad
        chunk_logits, self.state = self.runner.prefill(
            self.state, slots, prompts, requests, **self._lora(adapters)
        )
        targets = np.full((len(slots),), nowhere, np.int32)
        for i, seq in enumerate(seqs):
            seq.num_computed = seq.prefill_target
            targets[i] = seq.slot
        return _merge_rows(logits, chunk_logits, _upload(targets)), seqs

    # -- warm-up ----------------------------------------------------------------------------

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, source length) prefill batch the scheduler can form."""
        return [(b, t) for b in self.row_ladder for t in self.source_ladder]

    def warmup(self, compile_threads: int = 8) -> None:
        """``Engine.warmup`` (the decode step and every prefill shape, compiled on threads, run
        on rows out of range), then the beam lane's programs."""
        super().warmup(compile_threads)
        with self._lock:
            self._warm_beam_prefills(compile_threads)
            self._warm_beam_lane(self._warmup_request().tgt_lang)

    def _warm_beam_prefills(self, compile_threads: int) -> None:
        """Every prefill shape again on the beam lane's cache, whose row table (beams read
        their history through it) makes its prefills programs of their own; run on rows out
        of range, so nothing is written."""
        steps = [self._warm_prefill_args(*shape) for shape in self.prefill_shapes()]
        steps += [(a, kw) for a, kw in steps for kw in self._adapted(kw)]
        lane = lambda args: (self.beams.carry.cache, *args[1:])
        lowered = [self.runner.lower_prefill(*lane(a), **kw) for a, kw in steps]
        with ThreadPoolExecutor(max(1, compile_threads)) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
        for args, kwargs in steps:
            _, cache = self.runner.prefill(*lane(args), **kwargs)
            self.beams.carry = dataclasses.replace(self.beams.carry, cache=cache)

    def _decode_shapes(self) -> list[int]:
        return [0]  # one decode step: the cache has no block table

    def _warm_decode_args(self, width: int) -> tuple[tuple, dict[str, Any]]:
        del width  # no block table
        n = self.num_slots
        tokens, active = _upload(np.zeros((n,), np.int32)), _upload(np.zeros((n,), bool))
        return (self.state, tokens, active), self._lora([-1] * n)

    def _warm_prefill_args(self, rows: int, length: int) -> tuple[tuple, dict[str, Any]]:
        """``rows`` sources of ``length`` EOS tokens into slots out of range (write nothing)."""
        source = [self.model.config.eos_token_id] * min(length, self.max_source_len)
        request = self._warmup_request()
        args = (self.state, [self.num_slots] * rows, [source] * rows, [request] * rows)
        return args, self._lora([-1] * rows)

    def _warm_beam_lane(self, tgt_lang: str | None) -> None:
        """Runs 1 .. (prefill ladder top) one-step searches at once: the programs that depend
        on how many requests one step admits, then the search chunk itself."""
        eos = self.model.config.eos_token_id
        dummy = BeamRequest([eos] * 4, tgt_lang=tgt_lang, num_beams=1, max_new=1)
        for n in range(1, min(self.row_ladder[-1], self.num_slots) + 1):
            for _ in range(n):
                self.beams.add(dummy, -1)
            while self.beams.busy:
                self.beams.admit(limit=n)
                self.beams.retire(np.asarray(self.beams.dispatch()))
                self.beams.collect()
            self.beams.results.clear()

    def _warmup_request(self) -> SamplingParams:
        """A request whose target language the runner can map (the default, else English)."""
        if self.runner.default_tgt_lang is not None:
            return SamplingParams()
        try:
            self.runner.language_id("eng_Latn")
        except ValueError as error:
            raise ValueError(
                "the engine cannot warm up without a target language it can map; give the "
                "runner a default_tgt_lang."
            ) from error
        return SamplingParams(tgt_lang="eng_Latn")
