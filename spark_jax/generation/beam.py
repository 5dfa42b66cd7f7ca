"""Beam search with HF transformers' semantics, the beams of many requests in one batch, on device.

Each request is a ``BeamRequest`` for an encoder-decoder runner (NLLB): its ``num_beams``
beams occupy ``num_beams`` rows of one shared cache, and every step decodes all rows of all
requests as ONE batched forward, whatever their beam counts, source lengths, target languages
and LoRA adapters. The whole step runs on the device, several steps per host sync (a jitted
``lax.while_loop``, like the engine's ``_decode_chunk``): decode → log-softmax → per-request
top-k over (beams x vocab) → HF's running / finished bookkeeping, vectorised over request
slots → the gather of each beam's self-attention K/V rows, with the cache donated. The host
reads one live flag per request slot per chunk, and each finished request's hypotheses once.

Shapes are static per call layout: R request slots (= cache rows, as every request holds at
least one row), B = the call's widest ``num_beams`` rounded up to a power of two (narrower
requests mask their extra beams to -inf; beams are not rows, so padding costs no decode
work), L = the cache length. Per-request knobs (beam count, length penalty, stopping
rule, max_new, cache rows) are arrays, so different requests never recompile.

The bookkeeping replays ``GenerationMixin._beam_search`` of transformers 5
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``) per request, in float32 like
torch, including its -1e9 penalties; ties go to the lower index like the stable sorts the
host version used. Lengths follow HF with the decoder prompt ``[decoder_start]``: the forced
language token counts, so a hypothesis of n generated tokens (EOS included) is scored
``sum_logprobs / (n + 1) ** length_penalty``, and ``max_new`` is HF's ``max_new_tokens`` minus
one. The forced step itself is not searched: HF's forced-BOS processor leaves beam 0 alone at
score 0 (the other beams at -1e9 never reach the top 2 * num_beams), which is exactly the
prefill's single row.

Scheduling stays on the host: a request waits, in order, until enough rows are free; then it
is prefilled into one row, and its first search step fans that row out (cross K/V included)
to all its beams. A request's LoRA adapter is recorded for each of its rows.

Errors: every request is checked before any device work; one invalid request fails the whole
call with a ValueError naming its index, and no request of that call is run.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation.step import Carry, LoopOptions, decode_forward, run_chunk
from spark_jax.model import Model
from spark_jax.models.common import bucket
from spark_jax.ops.lora import adapter_slot

_PENALTY = np.float32(-1.0e9)  # HF's "never pick this" offset, in the same float32 arithmetic
_DEFAULT_MAX_ROWS = 256


@dataclass(frozen=True)
class BeamRequest:
    """One source to translate with beam search (HF ``generate(num_beams=...)`` knobs)."""

    prompt_tokens: Sequence[int]  # [src_lang] tokens </s>, or raw tokens with src_lang
    src_lang: str | None = None
    tgt_lang: str | None = None  # None: the runner's default target language
    adapter: str | None = None
    num_beams: int = 4
    max_new: int = 64  # tokens after the forced language token (HF max_new_tokens - 1)
    length_penalty: float = 1.0
    early_stopping: bool | str = True  # True | False | "never"
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))
        for name in ("num_beams", "max_new", "num_return_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                f"({self.num_beams}): beam search keeps only num_beams hypotheses"
            )
        if self.early_stopping not in (True, False) and self.early_stopping != "never":
            raise ValueError(
                f'early_stopping must be True, False or "never", got {self.early_stopping!r}'
            )
        if not np.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")


@dataclass
class BeamResult:
    """The best ``num_return_sequences`` hypotheses, best first, with HF's sequence scores."""

    sequences: list[list[int]]  # generated tokens, without the forced language token
    scores: list[float]  # HF sequences_scores: sum of logprobs / length ** length_penalty


# ---------------------------------------------------------------------------------------------
# Device state. R request slots, B beams per slot (the call's widest, bucketed), L positions,
# K = keep * B candidates per slot (HF keeps max(2, 1 + #eos) * num_beams).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Slots:
    """Each request slot's fixed settings and each cache row's owner, written by the host when
    a request is admitted."""

    rows: jax.Array  # int32[R, B]: the cache row of each beam (0 past num_beams: never written)
    row_slot: jax.Array  # int32[rows]: the slot that last took each cache row (0: never)
    row_beam: jax.Array  # int32[rows]: the row's beam in that slot
    num_beams: jax.Array  # int32[R]
    max_length: jax.Array  # int32[R]: HF's max_length, max_new + 2
    early_true: jax.Array  # bool[R]: early_stopping is True
    best_len: jax.Array  # int32[R]: HF's fixed best hypothetical length ("never", lp > 0), or 0
    denom: jax.Array  # float32[R, L + 1]: length ** length_penalty, computed like Python's


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Search:
    """HF's beam-search tensors for every request slot (beams past num_beams: -inf, unused)."""

    slots: _Slots
    cur_len: jax.Array  # int32[R]: HF's decoder length, 2 after the forced language token
    running_scores: jax.Array  # float32[R, B]: summed log-probs of the running beams
    finished_tokens: jax.Array  # int32[R, B, L]: finished hypotheses, best first
    finished_lengths: jax.Array  # int32[R, B]
    finished_scores: jax.Array  # float32[R, B]: length-penalised
    is_finished: jax.Array  # bool[R, B]
    improvable: jax.Array  # bool[R]: HF's is_early_stop_heuristic_unsatisfied
    live: jax.Array  # bool[R]: the slot holds a request still searching


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Beams:
    """The picker state of the generation core's ``Carry`` in beam search."""

    sequences: jax.Array  # int32[rows, L]: each row's running beam, generated tokens
    search: _Search


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Top:
    """HF's top-K continuations of each request, best first: [R, K]."""

    scores: jax.Array  # float32: running score + next-token log-prob
    beams: jax.Array  # int32: the beam each continues
    tokens: jax.Array  # int32: the next token
    valid: jax.Array  # bool: within the request's keep * num_beams


def _beam_mask(slots: _Slots) -> jax.Array:
    """bool[R, B]: the beams a request has."""
    return jnp.arange(slots.rows.shape[1]) < slots.num_beams[:, None]


def _take(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[r, index[r, ...]] along axis 1."""
    return jnp.take_along_axis(x, index, axis=1)


def _penalty(flag: jax.Array) -> jax.Array:
    """HF's ``flag.to(float32) * -1e9``: adding it leaves a score unchanged where flag is False."""
    return flag.astype(jnp.float32) * _PENALTY


def _select(mask: jax.Array, new: Any, old: Any) -> Any:
    """Per request slot, ``new`` where mask[R] is True, else ``old`` (every leaf is [R, ...])."""
    pick = lambda n, o: jnp.where(mask.reshape(mask.shape + (1,) * (n.ndim - 1)), n, o)
    return jax.tree.map(pick, new, old)


def _initial_search(slots: _Slots, length: int) -> _Search:
    """HF's state before the first step: beam 0 alone at score 0, finished scores at -1e9."""
    r, b = slots.rows.shape
    beams = _beam_mask(slots)
    return _Search(
        slots=slots,
        cur_len=jnp.full((r,), 2, jnp.int32),
        running_scores=jnp.where(jnp.arange(b) == 0, 0.0, -jnp.inf) + jnp.zeros((r, 1)),
        finished_tokens=jnp.zeros((r, b, length), jnp.int32),
        finished_lengths=jnp.zeros((r, b), jnp.int32),
        finished_scores=jnp.where(beams, _PENALTY, -jnp.inf).astype(jnp.float32),
        is_finished=jnp.zeros((r, b), bool),
        improvable=jnp.ones((r,), bool),
        live=jnp.ones((r,), bool),
    )


# ---------------------------------------------------------------------------------------------
# One HF iteration, vectorised over request slots.


@partial(jax.jit, static_argnames=("k",))
def _top_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row, the k largest log-softmax values (descending) and their token ids.

    log_softmax shifts a row by one constant, so its top k are the logits' top k: only the k
    picks are shifted, in ``jax.nn.log_softmax``'s arithmetic ``(x - max) - log(sum(exp(x -
    max)))``, with the max read off the top k. Two passes over the [rows, V] logits (top-k,
    then the sum) where log-softmax then top-k made four and wrote float32 [rows, V]
    log-probs (131 MB at NLLB's 128 rows x 256206). Distinct logits whose log-probs round
    equal rank by logit here (their exact order), not by index.

    The max is ``max(values)``, not ``values[:, :1]``: XLA lowers top-k to a sort and slice
    and matches them back to its top-k kernel, and a second slice of that sort (merged with
    the first by the simplifier) defeats the match and leaves a full sort of [rows, V].
    """
    logits = logits.astype(jnp.float32)
    values, ids = jax.lax.top_k(logits, k)
    peak = jnp.max(values, axis=-1, keepdims=True)  # = values[:, 0]
    log_total = jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1, keepdims=True))
    return (values - peak) - log_total, ids


def _continuations(s: _Search, values: jax.Array, ids: jax.Array, keep: int) -> _Top:
    """HF's ``_get_top_k_continuations``: per request, the best keep * n of (beams x vocab).

    ``values``/``ids`` [rows, W >= keep * B] hold each row's top log-probs. Any of a request's
    top k is within its own row's top k, so sorting these few candidates gives the full top k.
    Columns past k are dropped so a row contributes what the vocabulary-wide top-k would see.
    Ties go to the lower (beam, token): torch's order over beam * V + token.
    """
    r, b = s.slots.rows.shape
    k = keep * s.slots.num_beams
    scores = values[s.slots.rows] + s.running_scores[:, :, None]  # [R, B, W]
    scores = jnp.where(jnp.arange(values.shape[1]) < k[:, None, None], scores, -jnp.inf)
    beams = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[None, :, None], scores.shape)
    flat = lambda x: x.reshape(r, -1)
    keys = (-flat(scores), flat(beams), flat(ids[s.slots.rows]))
    neg_scores, beams, tokens = jax.lax.sort(keys, dimension=1, num_keys=3)
    width = keep * b
    valid = jnp.arange(width) < k[:, None]
    return _Top(-neg_scores[:, :width], beams[:, :width], tokens[:, :width], valid)


def _next_running(s: _Search, top: _Top, hits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """HF's ``_get_running_beams_for_next_iteration``: the best n candidates that did not stop.

    Returns the new running scores [R, B] and each new beam's parent beam and token.
    """
    b = s.slots.rows.shape[1]
    scores = jnp.where(top.valid, top.scores + _penalty(hits), -jnp.inf)
    order = jnp.argsort(-scores, axis=1, stable=True)[:, :b]
    running = jnp.where(_beam_mask(s.slots), _take(scores, order), -jnp.inf)
    return running, _take(top.beams, order), _take(top.tokens, order)


def _merge_finished(
    s: _Search, top: _Top, hits: jax.Array, sequences: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """HF's ``_update_finished_beams``: stopped candidates among the top n join the finished.

    ``sequences`` [rows, L] are the running beams before this step's token. Returns the
    finished tokens, lengths, scores and flags, best first.
    """
    b = s.slots.rows.shape[1]
    beams = _beam_mask(s.slots)
    just = hits & (jnp.arange(hits.shape[1]) < s.slots.num_beams[:, None])
    scores = top.scores / _take(s.slots.denom, s.cur_len[:, None])  # cur_len + 1 - prompt 1
    full = jnp.all(s.is_finished | ~beams, axis=1) & s.slots.early_true
    scores = scores + _penalty(full)[:, None]
    scores = scores + _penalty(~s.improvable)[:, None]
    scores = jnp.where(top.valid, scores + _penalty(~just), -jnp.inf)
    # The candidates' sequences: the parent's running tokens plus this step's token.
    position = (s.cur_len - 2)[:, None, None]
    parents = sequences[_take(s.slots.rows, top.beams)]  # [R, K, L]
    length = sequences.shape[1]
    candidates = jnp.where(jnp.arange(length) == position, top.tokens[:, :, None], parents)
    merged_scores = jnp.concatenate([jnp.where(beams, s.finished_scores, -jnp.inf), scores], 1)
    best = jnp.argsort(-merged_scores, axis=1, stable=True)[:, :b]
    merged_tokens = jnp.concatenate([s.finished_tokens, candidates], axis=1)
    new_lengths = jnp.broadcast_to(s.cur_len[:, None] - 1, just.shape)
    return (
        _take(merged_tokens, best[:, :, None]),
        _take(jnp.concatenate([s.finished_lengths, new_lengths], 1), best),
        _take(merged_scores, best),
        _take(jnp.concatenate([s.is_finished, just], 1), best) & beams,
    )


def _still_improvable(
    s: _Search, running: jax.Array, finished_scores: jax.Array, is_finished: jax.Array
) -> jax.Array:
    """HF's ``_check_early_stop_heuristic`` after the step (cur_len already advanced)."""
    beams = _beam_mask(s.slots)
    cur_len = s.cur_len + 1
    best_len = jnp.where(s.slots.best_len > 0, s.slots.best_len, cur_len - 1)
    best_possible = running[:, :1] / _take(s.slots.denom, best_len[:, None])
    worst = jnp.min(jnp.where(beams, finished_scores, jnp.inf), axis=1, keepdims=True)
    worst = jnp.where(is_finished, worst, _PENALTY)
    return s.improvable & jnp.any(beams & (best_possible > worst), axis=1)


def _advance(
    s: _Search, sequences: jax.Array, values: jax.Array, ids: jax.Array, eos: jax.Array
) -> tuple[_Search, jax.Array, jax.Array]:
    """One HF iteration for every slot; returns the search and each new beam's (parent, token)."""
    keep = max(2, 1 + eos.shape[0])
    top = _continuations(s, values, ids, keep)
    is_eos = jnp.any(top.tokens[:, :, None] == eos, axis=-1)
    hits = is_eos | (s.cur_len + 1 >= s.slots.max_length)[:, None]
    running, parents, tokens = _next_running(s, top, hits)
    finished_tokens, finished_lengths, finished_scores, is_finished = _merge_finished(
        s, top, hits, sequences
    )
    improvable = _still_improvable(s, running, finished_scores, is_finished)
    all_full = jnp.all(is_finished | ~_beam_mask(s.slots), axis=1) & s.slots.early_true
    done = ~improvable | all_full | jnp.all(hits | ~top.valid, axis=1)
    search = dataclasses.replace(
        s,
        cur_len=s.cur_len + 1,
        running_scores=running,
        finished_tokens=finished_tokens,
        finished_lengths=finished_lengths,
        finished_scores=finished_scores,
        is_finished=is_finished,
        improvable=improvable,
        live=s.live & ~done,
    )
    return search, parents, tokens


def _step(
    c: Carry, values: jax.Array, ids: jax.Array, eos: jax.Array, mask: jax.Array, cross: bool
) -> Carry:
    """Advances the slots of ``mask`` from their rows' top log-probs and reorders their rows.

    Row ``rows[r, b]`` becomes a copy of its new parent's row (``cross``: cross K/V too, for
    a request's first step, which fans its one prefilled row out to all its beams).
    """
    s, sequences = c.picker.search, c.picker.sequences
    search, parents, tokens = _advance(s, sequences, values, ids, eos)
    search = _select(mask, search, s)
    # Per cache row, gathers from its (slot, beam) rather than scatters from the slots: the
    # row updates then fuse with each other (a scatter is a kernel of its own on the GPU).
    slot, beam = s.slots.row_slot, s.slots.row_beam
    row = jnp.arange(slot.shape[0])
    owned = (beam < s.slots.num_beams[slot]) & (s.slots.rows[slot, beam] == row)
    moving = mask[slot] & owned  # rows a freed slot left behind are not its rows any more
    source = jnp.where(moving, s.slots.rows[slot, parents[slot, beam]], row)
    token = tokens[slot, beam]
    position = jnp.arange(sequences.shape[1]) == (s.cur_len[slot] - 2)[:, None]
    sequences = jnp.where(moving[:, None] & position, token[:, None], sequences[source])
    return Carry(
        state=c.state.gather_rows(source, cross),
        tokens=jnp.where(moving, token, c.tokens),
        active=jnp.where(moving, search.live[slot], c.active),
        num_generated=jnp.where(moving, search.cur_len[slot] - 1, c.num_generated),
        picker=_Beams(sequences, search),
    )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _BeamRows:
    """A search chunk's inputs beside the carry."""

    eos: jax.Array  # int32[E]: the end-of-sequence ids
    stop_on_finish: jax.Array  # bool[]: end the chunk once a request finishes (others wait)


@dataclass(frozen=True)
class BeamSearch:
    """HF's beam search (``step.Rule``) of every live request slot: decode, the rows' top
    ``width`` log-probs, the bookkeeping, the reorder. The record is the slots' live flags."""

    width: int  # candidates per row: max(2, 1 + #eos) * beams

    def forward(self, fn: Any, params: Any, carry: Carry, rows: Any, lora: Any) -> Any:
        return decode_forward(fn, params, carry, lora)

    def empty_record(self, carry: Carry, rows: Any, num_steps: int) -> jax.Array:
        return carry.picker.search.live.astype(jnp.int8)  # its own buffer: carry is donated

    def advance(
        self, logits: jax.Array, carry: Carry, rows: _BeamRows, record: Any, i: Any
    ) -> tuple[Carry, jax.Array]:
        values, ids = _top_log_probs(logits, self.width)
        live = carry.picker.search.live
        carry = _step(carry, values, ids, rows.eos, live, cross=False)
        return carry, carry.picker.search.live.astype(jnp.int8)

    def go_on(self, carry: Carry, entry: Carry, rows: _BeamRows) -> jax.Array:
        live, was_live = carry.picker.search.live, entry.picker.search.live
        finished = rows.stop_on_finish & jnp.any(was_live & ~live)
        return jnp.any(live) & ~finished


# ---------------------------------------------------------------------------------------------
# The device entry points: a request's first step (from its prefill's top log-probs), and a
# chunk of steps for all.


@partial(jax.jit, static_argnames=("num_rows",))
def _in_first_rows(
    values: jax.Array, ids: jax.Array, first_rows: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
    """Admitted request i's prefill top log-probs ``values[i]`` / ``ids[i]`` put in cache row
    ``first_rows[i]`` of [num_rows, W] (-inf elsewhere): one fixed shape, so ``_start``
    compiles once whatever the number of admitted requests. Done on the device, so the host
    queues the first step and the first chunk while the prefill still runs, instead of
    waiting to read the [n, W] back."""
    shape = (num_rows, values.shape[1])
    return (
        jnp.full(shape, -jnp.inf, jnp.float32).at[first_rows].set(values),
        jnp.zeros(shape, jnp.int32).at[first_rows].set(ids),
    )


@partial(jax.jit, donate_argnames=("carry",))
def _start(
    carry: Carry,
    values: jax.Array,
    ids: jax.Array,
    eos: jax.Array,
    slots: _Slots,
    fresh: jax.Array,
) -> Carry:
    """The first step of the slots ``fresh`` [R] from their prefill top log-probs [rows, W]."""
    beams = carry.picker
    initial = _initial_search(slots, beams.sequences.shape[1])
    search = _select(fresh, initial, dataclasses.replace(beams.search, slots=slots))
    carry = dataclasses.replace(carry, picker=_Beams(beams.sequences, search))
    return _step(carry, values, ids, eos, fresh, cross=True)


# ---------------------------------------------------------------------------------------------
# Host side: validation, the call's layout, admission of waiting requests, results.


def _as_runner(model_or_runner: Any) -> Any:
    """The runner of a model (or the runner itself); beam search needs an encoder-decoder."""
    runner = model_or_runner.runner if isinstance(model_or_runner, Model) else model_or_runner
    if not runner.is_encoder_decoder:
        raise ValueError(
            "beam search needs an encoder-decoder model (NLLB / M2M100); "
            f"{type(runner).__name__} cannot reorder its cache rows."
        )
    return runner


def check_beam_requests(
    runner: Any, requests: Sequence[BeamRequest]
) -> list[tuple[BeamRequest, int]]:
    """Validates every request before any device work; returns each one with its source as
    the encoder reads it (``source_tokens``) and its adapter slot."""
    checked = []
    for i, request in enumerate(requests):
        try:
            if not isinstance(request, BeamRequest):
                raise ValueError(f"expected a BeamRequest, got {type(request).__name__}")
            adapter = adapter_slot(runner.lora_pool, request.adapter)
            source = runner.source_tokens(request.prompt_tokens, request)
            runner.target_language_id(request)
        except ValueError as error:
            raise ValueError(f"request {i}: {error}") from error
        checked.append((dataclasses.replace(request, prompt_tokens=source), adapter))
    return checked


@lru_cache(maxsize=64)
def _denominators(length_penalty: float, size: int) -> np.ndarray:
    """float32[size]: ``n ** length_penalty`` for n = 0 .. size - 1 (n = 0 as 1), computed
    like HF's divisor: a Python float (int ** float, in double) cast to float32. Cached: a
    lane admits many requests with the same few penalties, each would loop over ``size``."""
    denom = np.array([float(max(n, 1)) ** length_penalty for n in range(size)], np.float32)
    denom.flags.writeable = False
    return denom


class _SlotTable:
    """The host's copy of every slot's ``_Slots`` settings (numpy, uploaded at admission)."""

    def __init__(self, num_slots: int, beams: int, length: int):
        self.rows = np.zeros((num_slots, beams), np.int32)
        self.row_slot = np.zeros(num_slots, np.int32)  # as many cache rows as slots
        self.row_beam = np.full(num_slots, beams, np.int32)  # past every num_beams: no beam
        self.num_beams = np.ones(num_slots, np.int32)
        self.max_length = np.full(num_slots, 3, np.int32)
        self.early_true = np.zeros(num_slots, bool)
        self.best_len = np.zeros(num_slots, np.int32)
        self.denom = np.ones((num_slots, length + 1), np.float32)

    def set(self, slot: int, rows: Sequence[int], request: BeamRequest) -> None:
        self.rows[slot] = 0
        self.rows[slot, : len(rows)] = rows
        self.row_slot[rows] = slot
        self.row_beam[rows] = np.arange(len(rows))
        self.num_beams[slot] = request.num_beams
        self.max_length[slot] = request.max_new + 2
        self.early_true[slot] = request.early_stopping is True
        never = request.early_stopping == "never" and request.length_penalty > 0.0
        self.best_len[slot] = request.max_new + 1 if never else 0
        self.denom[slot] = _denominators(request.length_penalty, self.denom.shape[1])

    def device(self) -> _Slots:
        fields = (self.rows, self.row_slot, self.row_beam, self.num_beams, self.max_length)
        fields += (self.early_true, self.best_len, self.denom)
        return _Slots(*(jnp.asarray(f) for f in fields))


def _idle_search(table: _SlotTable, length: int) -> _Search:
    """Every slot free (not live); the other fields are placeholders until a slot's start.

    Built in numpy: device-side constructors would each compile a small program per shape.
    """
    r, b = table.rows.shape
    zeros = lambda shape, dtype: jnp.asarray(np.zeros(shape, dtype))
    return _Search(
        slots=table.device(),
        cur_len=zeros(r, np.int32),
        running_scores=zeros((r, b), np.float32),
        finished_tokens=zeros((r, b, length), np.int32),
        finished_lengths=zeros((r, b), np.int32),
        finished_scores=zeros((r, b), np.float32),
        is_finished=zeros((r, b), bool),
        improvable=zeros(r, bool),
        live=zeros(r, bool),
    )


class BeamLane:
    """Beam searches sharing one cache: rows, request slots, waiting requests, results.

    The layout is fixed at creation (``beams`` per request at most, ``rows`` cache rows,
    ``length`` positions, sources up to ``max_source``); requests are added at any time and
    wait, in order, for rows. ``generate_beam`` sizes one per call; ``sj.Engine`` on an NLLB
    model keeps one for its beam requests.
    """

    def __init__(
        self,
        runner: Any,
        beams: int,
        rows: int,
        length: int,
        max_source: int,
        loop: LoopOptions | None = None,
    ):
        self.runner = runner
        self.requests: list[BeamRequest] = []
        self.adapters: list[int] = []
        self.use_lora = runner.lora_pool is not None
        self.eos = jnp.asarray(sorted(set(runner.eos_token_ids)), jnp.int32)
        beams = bucket(beams, minimum=1)  # padded beams are masked: fewer distinct compiles
        self.max_beams = min(beams, rows)
        self.max_new = length - 2
        self.width = max(2, 1 + self.eos.shape[0]) * beams
        # Beams read their shared history through a row table: a reorder moves the table,
        # not every layer's rows (EncoderDecoderCache.gather_rows).
        state = runner.init_state(rows, length, max_source, row_table=True)
        # Every request holds at least one row, so rows request slots always suffice.
        self.table = _SlotTable(rows, beams, length)
        self.carry = Carry(
            state=state,
            tokens=jnp.asarray(np.zeros(rows, np.int32)),
            active=jnp.asarray(np.zeros(rows, bool)),
            num_generated=jnp.asarray(np.zeros(rows, np.int32)),
            picker=_Beams(
                sequences=jnp.asarray(np.zeros((rows, length), np.int32)),
                search=_idle_search(self.table, length),
            ),
        )
        self.rule = BeamSearch(self.width)
        self.loop = loop or LoopOptions()
        self.pending: deque[tuple[int, BeamRequest]] = deque()
        self.free_rows = list(range(rows))[::-1]
        self.free_slots = list(range(rows))[::-1]
        self.searching: dict[int, tuple[int, list[int]]] = {}  # slot -> (request, rows)
        self.finished: dict[int, tuple[int, list[int]]] = {}  # done, not yet read back
        self.results: dict[int, BeamResult] = {}  # request index -> result, until taken
        self.row_adapters = np.full(rows, -1, np.int32)
        self.lora = runner.lora_input(self.row_adapters) if self.use_lora else None

    @classmethod
    def for_requests(
        cls,
        runner: Any,
        requests: list[BeamRequest],
        max_rows: int | None,
        loop: LoopOptions | None = None,
    ) -> BeamLane:
        """A lane just large enough for ``requests`` (rows capped by ``max_rows``)."""
        widest = max(r.num_beams for r in requests)
        rows = bucket(sum(r.num_beams for r in requests), minimum=8)
        rows = max(min(rows, max_rows or _DEFAULT_MAX_ROWS), widest)
        length = bucket(max(r.max_new for r in requests) + 2)
        source = max(len(r.prompt_tokens) for r in requests)
        return cls(runner, widest, rows, length, source, loop)

    def add(self, request: BeamRequest, adapter: int) -> int:
        """Queues a request checked by ``check_beam_requests``; returns its index here."""
        if request.num_beams > self.max_beams or request.max_new > self.max_new:
            raise ValueError(
                f"num_beams={request.num_beams} and max_new={request.max_new} must be at most "
                f"{self.max_beams} and {self.max_new} here; lower them or raise the limits."
            )
        index = len(self.requests)
        self.requests.append(request)
        self.adapters.append(adapter)
        self.pending.append((index, request))
        return index

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.searching or self.finished)

    def dispatch(self) -> jax.Array:
        """Starts a chunk of search steps; returns its live flags (int8[R]), still on device."""
        rows = _BeamRows(self.eos, np.bool_(bool(self.pending)))
        self.carry, live = run_chunk(
            self.runner.decode_fn,
            self.rule,
            self.runner.params,
            self.lora,
            self.carry,
            rows,
            num_steps=self.loop.steps_per_sync,
        )
        return live

    def retire(self, live: np.ndarray) -> None:
        """Moves the slots that stopped searching to ``finished`` (read back lazily)."""
        for slot in [s for s in self.searching if not live[s]]:
            self.finished[slot] = self.searching.pop(slot)

    def collect(self) -> None:
        """Reads the hypotheses of finished slots and frees their rows and slots."""
        if not self.finished:
            return
        s = self.carry.picker.search
        tokens, lengths, scores = jax.device_get(
            (s.finished_tokens, s.finished_lengths, s.finished_scores)
        )
        for slot, (index, rows) in self.finished.items():
            m = self.requests[index].num_return_sequences
            self.results[index] = BeamResult(
                sequences=[tokens[slot, j, : lengths[slot, j]].tolist() for j in range(m)],
                scores=[float(x) for x in scores[slot, :m]],
            )
            self.free_rows.extend(rows)
            self.free_slots.append(slot)
        self.finished.clear()

    def admit(self, limit: int | None = None) -> None:
        """Prefills the waiting requests that fit (at most ``limit``), in order, and runs their
        first step."""
        self.collect()
        admitted = []
        while (
            self.pending
            and self.pending[0][1].num_beams <= len(self.free_rows)
            and (limit is None or len(admitted) < limit)
        ):
            index, request = self.pending.popleft()
            slot = self.free_slots.pop()
            rows = [self.free_rows.pop() for _ in range(request.num_beams)]
            self.row_adapters[rows] = self.adapters[index]
            self.table.set(slot, rows, request)
            self.searching[slot] = (index, rows)
            admitted.append((slot, index, rows))
        if admitted:
            self._prefill_and_start(admitted)

    def _prefill_and_start(self, admitted: list[tuple[int, int, list[int]]]) -> None:
        first_rows = [rows[0] for _, _, rows in admitted]
        requests = [self.requests[index] for _, index, _ in admitted]
        lora = {"adapters": [self.adapters[i] for _, i, _ in admitted]} if self.use_lora else {}
        prompts = [r.prompt_tokens for r in requests]
        logits, state = self.runner.prefill(self.carry.state, first_rows, prompts, requests, **lora)
        num_rows = len(self.row_adapters)
        values, ids = _top_log_probs(logits, self.width)
        values, ids = _in_first_rows(values, ids, np.asarray(first_rows, np.int32), num_rows)
        fresh = np.zeros(num_rows, bool)  # one slot per row
        fresh[[slot for slot, _, _ in admitted]] = True
        carry = dataclasses.replace(self.carry, state=state)
        self.carry = _start(carry, values, ids, self.eos, self.table.device(), fresh)
        self.lora = self.runner.lora_input(self.row_adapters) if self.use_lora else None


def generate_beam(
    model_or_runner: Any,
    requests: Sequence[BeamRequest],
    max_rows: int | None = None,
    loop: LoopOptions | None = None,
) -> list[BeamResult]:
    """Beam search for every request, all beams decoded as one batch per step.

    ``max_rows`` bounds the cache rows (beams in flight); requests wait, in order, for rows
    to free up. ``loop`` sets search steps per host sync. Results are in request order and
    equal those of each request run alone.
    """
    runner = _as_runner(model_or_runner)
    requests = list(requests)
    if not requests:
        return []
    checked = check_beam_requests(runner, requests)
    call = BeamLane.for_requests(runner, [request for request, _ in checked], max_rows, loop)
    for request, adapter in checked:
        call.add(request, adapter)
    call.admit()
    flags = call.dispatch()
    while True:
        # With nobody waiting, the next chunk is queued before this one's flags are read, so
        # the device never waits for the host; a chunk with no live request returns at once.
        ahead = None if call.pending else call.dispatch()
        call.retire(np.asarray(flags))
        if not call.searching and not call.pending:
            break
        if ahead is None:
            call.admit()
            ahead = call.dispatch()
        flags = ahead
    call.collect()
    return [call.results[i] for i in range(len(requests))]
