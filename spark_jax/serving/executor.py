"""The device side of a serving step: one executor per cache kind, one ``run(plan)`` each.

Given a ``StepPlan`` and the slots' sequences, ``run`` dispatches the step and returns its
``Picks`` without waiting for the device: the runner's decode over the decoding rows, the
prefill batch, and the generation core's sampling rule (``step.pick``) over the rows that
sample. Each slot's last token stays on the device (``SlotPicker.last_tokens``), where the
next step's decode reads it, so the engine reads a step's tokens while the next one runs.

- ``PagedExecutor``: a decoder-only model over a paged KV cache. The decode step runs only
  the decoding rows, packed into the smallest width of a ladder (1, 2, 4, ... slots) that
  holds them. With speculation (``num_speculative_tokens`` K > 0), a step where some row
  has drafts is a verify step instead: the same rows, K + 1 positions each (the last token,
  then the row's drafts, padding after; a row without drafts is a plain decode row in it),
  judged by the speculative rule (``speculative.Speculation``: greedy rows keep the drafts
  equal to the argmax, sampled rows the rejection rule), each row keeping its own number.
  The host block table moves with the sequences' pages; on the GPU the decode
  step's attention reads each row's pages in place (cuDNN's paged attention), elsewhere it
  gathers the rows and the table's width (the longest row, in pages) moves on a ladder so
  the gather stays short.
  A mixed step (``mixed``, the engine's ``mixed_batches``): a step that prefills runs its
  decoding rows in the prefill's forward, a token each after the ragged batch's (the
  decoder's ``prefill`` with ``decode_slots``), and picks every sampling row at once. A
  prefill with no row decoding beside it (a wave of admissions onto an idle engine) runs the
  plain ragged program: the mixed one's riding rows (the top decode width's, none real) would
  cost it their attention and LM head rows.
  A draft head's engine keeps every step's final hidden states per slot and position
  (``hidden_rows``), which the head reads (``spark_jax.serving.drafting``).
- ``DenseExecutor``: an encoder-decoder model over the runner's dense per-slot cache (whole
  sources prefilled with their cross K/V; the decode step runs every slot), plus the beam
  lane (``BeamLane``), whose beams reorder their own cache rows every step.

The ``warm_*`` methods are the inputs and runs of ``spark_jax.serving.warmup``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from spark_jax.generation.beam import BeamLane, BeamRequest, BeamResult
from spark_jax.generation.compile_options import DEVICE_LOOP_OPTIONS
from spark_jax.generation.guided import bitmask_width, fill_bitmask
from spark_jax.generation.speculative import Proposal, SpecRecord, SpecRows, SpecState, Speculation
from spark_jax.generation.step import Carry, Chunk, SampleRows, Sampling
from spark_jax.generation.step import step as core_step
from spark_jax.models.decoder import token_adapters
from spark_jax.models.wide_gemm import argument, jit_by_rows
from spark_jax.ops.attention import paged_kernel
from spark_jax.ops.kv_cache import PagedKVCache
from spark_jax.ops.sampling import SamplerBatch, SamplerPasses, SamplingParams
from spark_jax.ops.sharding import TP_AXIS, replicated
from spark_jax.serving.packing import Packing, pack, unpack
from spark_jax.serving.pages import BlockTable
from spark_jax.serving.scheduler import PrefillRow, SequenceState, StepPlan, pow2_ladder, rung

SAMPLER_WIDTH = 32  # logit-bias entries and stop ids per request: a fixed sampler shape
ADMISSION_MIN_TOKENS = 64  # the narrowest token row of the admission program


def commit(tree: Any, mesh: Mesh | None = None) -> Any:
    """The arrays of ``tree`` committed to the default device, or whole on every device of
    ``mesh`` (a tensor-parallel model's).

    Every array an executor holds is committed from the start, like the step outputs that
    replace it: a jitted step's cache key includes whether its inputs are committed, so state
    that changed status after warm-up would compile again.
    """
    return jax.device_put(tree, jax.devices()[0] if mesh is None else replicated(mesh))


def vocab_sharding(mesh: Mesh) -> NamedSharding:
    """Rows [slots, V] split by vocab over a tensor-parallel mesh (as the logits are)."""
    return NamedSharding(mesh, PartitionSpec(None, TP_AXIS))


def commit_cache(cache: Any, mesh: Mesh | None = None) -> Any:
    """``commit`` of a K/V cache; under tensor parallelism it is sharded by KV heads."""
    return commit(cache) if mesh is None else jax.device_put(cache, cache.shardings(mesh))


def upload(x: np.ndarray | np.generic) -> jax.Array:
    """A host array on the device. device_put, not jnp.asarray: the latter compiles a small
    staging program per new shape, which would break "no compiles after warm-up". A copy:
    on the CPU the device array may alias the numpy buffer, which the host keeps editing
    while the step it feeds is still queued."""
    return jax.device_put(np.array(x, copy=True))


@partial(jax.jit, donate_argnames=("hidden_rows",))
def _store_hidden(
    hidden_rows: jax.Array, hidden: jax.Array, row_slots: jax.Array, starts: jax.Array
) -> jax.Array:
    """``hidden_rows`` [S, L, D] with hidden[b, t] written at (row_slots[b], starts[b] + t);
    rows out of range and positions past L are dropped."""
    positions = starts[:, None] + jnp.arange(hidden.shape[1])[None, :]
    return hidden_rows.at[row_slots[:, None], positions].set(
        hidden.astype(hidden_rows.dtype), mode="drop", unique_indices=True
    )


@jax.jit
def _gather_tokens(last_tokens: jax.Array, row_slots: jax.Array) -> jax.Array:
    """Each decode row's input: its slot's last token (padding rows read some slot's)."""
    return jnp.take(last_tokens, row_slots, mode="clip")


class DecodeInputs(NamedTuple):
    """The decode program's per-step inputs, kept at fixed addresses per width
    (``_decode_inputs``)."""

    tokens: jax.Array  # int32[B]: each row's input token
    active: jax.Array  # bool[B]: real rows
    block_table: jax.Array  # int32[B, W]
    lengths: jax.Array  # int32[B]: keys before this step's

    @staticmethod
    def zeros(rows: int, width: int, mesh: Mesh | None) -> DecodeInputs:
        """Buffers for a width's first step (committed, as a step's outputs are)."""
        row = lambda dtype: np.zeros((rows,), dtype)
        held = DecodeInputs(
            row(np.int32), row(bool), np.zeros((rows, width), np.int32), row(np.int32)
        )
        return commit(held, mesh)

    def deleted(self) -> bool:
        """Whether a program took any of them (warm-up's decode inputs are donated and not
        kept; a decode run outside ``_decode`` donates the table and lengths with its
        cache)."""
        return any(x.is_deleted() for x in self)


class ChunkRows(NamedTuple):
    """A multi-step decode's rows (``_decode_chunk``)."""

    tokens: jax.Array  # int32[B]: each row's first input token
    row_slots: jax.Array  # int32[B]: each row's slot (padding rows: S, out of range)
    row_steps: jax.Array  # int32[B]: the steps each row runs (0: padding)
    generated: jax.Array  # int32[B]: tokens each row generated before


class ChunkInputs(NamedTuple):
    """A multi-step decode's per-call inputs, kept at fixed addresses per shape as the
    decode's are (``_chunk_inputs``): the chunk is one CUDA graph, its loop included,
    re-recorded whenever an argument moves."""

    rows: ChunkRows
    block_table: jax.Array  # int32[B, W]
    lengths: jax.Array  # int32[B]: keys before the call's

    @staticmethod
    def zeros(rows: int, width: int, mesh: Mesh | None) -> ChunkInputs:
        """Buffers for a shape's first call (committed, as a call's outputs are)."""
        row = lambda: np.zeros((rows,), np.int32)
        held = ChunkInputs(
            ChunkRows(row(), row(), row(), row()), np.zeros((rows, width), np.int32), row()
        )
        return commit(held, mesh)

    def deleted(self) -> bool:
        """Whether a program took any of them (``DecodeInputs.deleted``)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self))


class PrefillInputs(NamedTuple):
    """A ragged prefill program's per-step inputs, kept at fixed addresses per shape
    (``_prefill_inputs``); a mixed step's decode rows and last tokens (None without)."""

    tokens: jax.Array  # int32[N]: the rows' tokens one after another
    lengths: jax.Array  # int32[R]: each row's
    slots: jax.Array  # int32[R]: each row's cache row
    decode_slots: jax.Array | None  # int32[S]: the riding decode rows' cache rows
    last_tokens: jax.Array | None  # int32[slots]: every slot's last token (their inputs)
    block_table: jax.Array  # int32[slots, W]
    kv_lengths: jax.Array  # int32[slots]: keys before this step's

    @staticmethod
    def zeros(
        tokens: int, rows: int, riding: int, slots: int, width: int, mesh: Mesh | None
    ) -> PrefillInputs:
        """Buffers for a shape's first step (committed, as a step's outputs are); ``riding``
        0: no decode rows."""
        ints = lambda *shape: np.zeros(shape, np.int32)
        mixed = (ints(riding), ints(slots)) if riding else (None, None)
        held = PrefillInputs(
            ints(tokens), ints(rows), ints(rows), *mixed, ints(slots, width), ints(slots)
        )
        return commit(held, mesh)

    def deleted(self) -> bool:
        """Whether a program took any of them (``DecodeInputs.deleted``)."""
        return any(x.is_deleted() for x in jax.tree.leaves(self))


@partial(jax.jit, static_argnames=("packing",), donate_argnames=("held",), keep_unused=True)
def _prefill_inputs(
    held: PrefillInputs, last_tokens: jax.Array, inputs: jax.Array, packing: Packing
) -> PrefillInputs:
    """A ragged prefill's host inputs (tokens, lengths, slots, decode slots or none, block
    table, key lengths) from their one buffer, and the slots' last tokens where decode rows
    ride, written into the buffers of ``held`` (donated), as ``_decode_inputs`` writes the
    decode's: the prefill then sees the same addresses every step of its shape."""
    del held
    tokens, lengths, slots, decode_slots, table, kv_lengths = unpack(inputs, packing)
    riding = decode_slots is not None
    last = jnp.copy(last_tokens) if riding else None
    return PrefillInputs(tokens, lengths, slots, decode_slots, last, table, kv_lengths)


@partial(jax.jit, static_argnames=("packing",), donate_argnames=("held",), keep_unused=True)
def _decode_inputs(
    held: DecodeInputs, last_tokens: jax.Array, inputs: jax.Array, packing: Packing
) -> tuple[DecodeInputs, tuple[jax.Array, ...]]:
    """A decode step's host inputs from their one buffer (``spark_jax.serving.packing``): the
    rows' slots, block table, lengths, activity and generated counts; and each row's input
    token, its slot's last token.

    The decode program's own inputs (tokens, activity, block table, lengths) are written into
    the buffers of ``held``, the last step's at this width, donated (so kept even if this
    program does not read them): the decode then sees the same addresses every step. XLA
    keeps a program's kernels as a CUDA graph and re-records it whenever an argument moves:
    on an H100, a 32-layer decode step of 64 rows with new argument buffers took 7.2 ms of
    host time to dispatch against 1.6 ms with them in place (``benchmarks/NOTES.md``). The
    pick gets its rows in buffers of their own (its activity too): the decode takes
    ``held``'s (``decode_returning_inputs``)."""
    del held
    row_slots, table, lengths, active, generated = unpack(inputs, packing)
    tokens = _gather_tokens(last_tokens, row_slots)
    return DecodeInputs(tokens, active, table, lengths), (row_slots, active, generated)


def put_rows(whole: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """``whole`` with ``rows[i]`` written at row ``slots[i]``: the rows of a step or an
    admission, each its own slot (padding rows name slot S, out of range: dropped). Distinct
    slots let XLA's GPU scatter store the rows plainly instead of updating them atomically
    (``unique_indices``; the K/V writes' scatters measured 2-3x faster so)."""
    return whole.at[slots].set(rows, mode="drop", unique_indices=True)


@partial(jax.jit, static_argnames=("packing",), donate_argnames=("held",), keep_unused=True)
def _chunk_inputs(
    held: ChunkInputs, last_tokens: jax.Array, inputs: jax.Array, packing: Packing
) -> ChunkInputs:
    """A multi-step decode's host inputs (rows' slots, block table, lengths, steps and
    generated counts) from their one buffer, and each row's first token, written into the
    buffers of ``held`` (donated), as ``_decode_inputs`` writes the decode's."""
    del held
    row_slots, table, lengths, row_steps, generated = unpack(inputs, packing)
    tokens = _gather_tokens(last_tokens, row_slots)
    return ChunkInputs(ChunkRows(tokens, row_slots, row_steps, generated), table, lengths)


@jax.jit
def _set_last_tokens(last_tokens: jax.Array, row_slots: jax.Array, tokens: jax.Array) -> jax.Array:
    """Each row's last token into its slot (padding rows' slots are out of range: dropped).
    The last tokens are not donated, as in ``_pick_rows``."""
    return put_rows(last_tokens, row_slots, tokens)


@partial(jax.jit, static_argnames=("packing",), donate_argnames=("token_counts",))
def _set_rows(
    token_counts: jax.Array,
    prompt_mask: jax.Array,
    by_slot: SampleRows,
    admission: jax.Array,
    packing: Packing,
) -> tuple[jax.Array, jax.Array, SampleRows]:
    """The sampler state of newly admitted sequences, built here from their token ids. The
    ``admission`` buffer (``spark_jax.serving.packing``) holds ``slots[R]``, ``tokens[R, L]``,
    ``prompt_lengths[R]``, ``lengths[R]`` and ``settings``: rows ``slots`` (padding rows name
    slot ``S``: their writes are dropped) get the counts of their outputs so far and the mask
    of their prompts, from ``tokens`` (the prompt's ``prompt_lengths[r]`` tokens, then the
    output's up to ``lengths[r]``; padding after), and their sampling settings (an R-row
    ``SampleRows``).

    Built on the device, an admission uploads its token ids rather than two dense [V] rows
    (640 KB at a 128k vocabulary), and the rows a step admits go in one program and one
    transfer. Only the counts are donated: they are the last pick's output, which nothing
    else reads. The prompt masks and settings are inputs of the pick still in flight, and
    donating a buffer that a queued program reads makes the host wait for that program."""
    slots, tokens, prompt_lengths, lengths, settings = unpack(admission, packing)
    rows, width = tokens.shape
    vocab = token_counts.shape[1]
    position = jnp.arange(width)[None, :]
    in_prompt = position < prompt_lengths[:, None]
    in_output = ~in_prompt & (position < lengths[:, None])
    row = jnp.broadcast_to(jnp.arange(rows)[:, None], tokens.shape)
    ids = lambda keep: jnp.where(keep, tokens, vocab)  # out of range: dropped
    counts = jnp.zeros((rows, vocab), token_counts.dtype)
    counts = counts.at[row, ids(in_output)].add(1, mode="drop")
    mask = jnp.zeros((rows, vocab), bool).at[row, ids(in_prompt)].set(True, mode="drop")
    token_counts = put_rows(token_counts, slots, counts)
    prompt_mask = put_rows(prompt_mask, slots, mask)
    put = lambda whole, new: put_rows(whole, slots, new)
    return token_counts, prompt_mask, jax.tree.map(put, by_slot, settings)


@dataclass
class HostTokens:
    """One step's picks on the host, by row (the logprob fields when asked for).

    A plain step's fields are [B, ...]; a verify step's are [B, T, ...] (T = K + 1 positions:
    the kept drafts, then the target's token), with each row's kept and verified drafts.
    """

    tokens: np.ndarray
    logprobs: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    num_accepted: np.ndarray | None = None  # int[B]: a verify step's kept drafts
    num_drafts: np.ndarray | None = None  # int[B]: a verify step's verified drafts
    num_tokens: np.ndarray | None = None  # int[B]: a multi-step decode's tokens per row

    def row_tokens(self, row: int) -> list[tuple[int, int | None]]:
        """(token, position) of each token row ``row`` picked, in order (position None: a
        plain step's one token), as ``request.token_logprobs`` indexes them."""
        if self.num_accepted is not None:
            n = int(self.num_accepted[row]) + 1
        elif self.num_tokens is not None:
            n = int(self.num_tokens[row])
        else:
            return [(int(self.tokens[row]), None)]
        return [(int(t), i) for i, t in enumerate(self.tokens[row, :n].tolist())]


@dataclass(frozen=True)
class WarmStep:
    """One step shape for warm-up: the runner's ``kind`` step ("decode", "verify", "chunk",
    "prefill", or a ragged prefill: "ragged", "mixed" with decode rows riding) over a
    ``shape`` (a decode: its table width; a prefill: rows and chunk or source length)."""

    kind: str
    shape: tuple[int, ...]
    adapted: bool = False  # the variant with an adapter row


@dataclass(frozen=True)
class WarmGroup:
    """Step shapes compiled together. ``lower`` traces a step's program on fresh inputs
    (each run donates the cache, so every call builds its own); ``run`` runs the steps once
    (given the threads to compile what it compiles on)."""

    steps: list[WarmStep]
    lower: Callable[[WarmStep], jax.stages.Lowered]
    run: Callable[[list[WarmStep], int], None]


def check_sampler_width(
    params: SamplingParams, eos_token_ids: Sequence[int], vocab_size: int
) -> None:
    """The engine's sampler has a fixed width of stop ids and logit-bias entries per row, and
    their ids must be tokens (checked here, at submission: a step that met one would fail
    every request in flight)."""
    for token in (*params.logit_bias, *params.stop_token_ids):
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"token id {token} in logit_bias or stop_token_ids is outside the vocabulary "
                f"[0, {vocab_size}); remove it."
            )
    stops = params.stop_token_set(eos_token_ids)
    if max(len(stops), len(params.logit_bias)) > SAMPLER_WIDTH:
        raise ValueError(
            f"at most {SAMPLER_WIDTH} stop token ids (EOS included) and logit_bias entries "
            "per request: the engine's sampler has a fixed shape."
        )


# Every serving step samples every row with the full sampler, its logprob fields and a token
# mask, so one program serves any mix of requests (the fields are read back only when a row
# asks; a step without a guided row reuses one all-ones mask). The sampler's two costly
# passes are chosen per step from its rows' settings, among the four programs compiled at
# warm-up: skipping them at run time would make the host wait for the device at every pick's
# dispatch on the GPU, and the engine dispatches a step before it reads the last one.
RULE = Sampling(greedy=False, want_logprobs=True, guided=True)
PASS_VARIANTS = tuple(
    SamplerPasses(top_k_top_p=f, top_logprobs=t) for f in (False, True) for t in (False, True)
)


# A pick whose every row is plain greedy (``SamplingParams.plain_greedy``) runs the rule's
# argmax form, a program of its own: a plain-greedy row's penalties are neutral (the whole
# sampler's argmax is the same token), so it needs no token counts, and their [rows, V]
# slices are neither gathered nor written back.
GREEDY_RULE = Sampling(greedy=True, want_logprobs=False, guided=True)


@partial(jax.jit, static_argnames=("rule",), donate_argnames=("counts",))
def _pick_rows(
    rule: Sampling,
    logits: jax.Array,
    row_slots: jax.Array,
    active: jax.Array,
    num_generated: jax.Array,
    allowed: jax.Array,
    by_slot: SampleRows,
    counts: jax.Array | None,
    last_tokens: jax.Array,
) -> tuple[jax.Array | None, jax.Array, Chunk]:
    """The rule's pick of rows ``row_slots[b]`` from ``logits[b, V]`` under their token masks
    ``allowed[b, V/32]``: their slots' settings and token counts gathered, the counts and last
    tokens written back to the slots (padding rows name slot ``S``, out of range: their writes
    are dropped). ``counts`` None (``GREEDY_RULE``): none read, None returned.

    The last tokens are not donated: the next decode's gather of them is queued when this
    pick is dispatched, and donating a buffer a queued program reads makes the host wait for
    it (measured on the H200: the whole step, every step)."""
    take = lambda x: jnp.take(x, row_slots, axis=0, mode="clip")
    rows = dataclasses.replace(jax.tree.map(take, by_slot), allowed=allowed)
    picker = None if counts is None else take(counts)
    carry = Carry(None, jnp.zeros_like(row_slots), active, num_generated, picker)
    carry, record = rule.advance(logits, carry, rows, rule.empty_record(carry, rows, 1), 0)
    if counts is not None:
        counts = put_rows(counts, row_slots, carry.picker)
    last_tokens = put_rows(last_tokens, row_slots, record.tokens[:, 0])
    return counts, last_tokens, record


@dataclass
class Picks:
    """One pick's record, still on the device, and the sequence of each of its rows."""

    record: Chunk
    seqs: list[SequenceState | None]  # by row; None: padding or a row that does not sample

    def steps_of(self, row: int) -> int:
        """The tokens row ``row`` has in flight in this pick."""
        return 1

    def read(self) -> HostTokens:
        """The picks on the host, by row, in one transfer (waits for the device); the logprob
        fields only when one of the rows asks for them."""
        want = any(s is not None and s.params.logprobs is not None for s in self.seqs)
        fields = ("tokens", "logprobs", "top_logprobs", "top_ids") if want else ("tokens",)
        # Whole fields, sliced here: slicing on the device would be a program of its own.
        host = jax.device_get([getattr(self.record, f) for f in fields])
        return HostTokens(*(np.asarray(x[:, 0]) for x in host))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Lengths:
    """The cache lengths as the speculative rule reads them (the engine keeps its lengths on
    the host, so the rolled-back ones the rule returns are not read)."""

    lengths: jax.Array

    def with_lengths(self, lengths: jax.Array) -> _Lengths:
        return _Lengths(lengths)


@partial(jax.jit, static_argnames=("rule",), donate_argnames=("counts",))
def _judge_rows(
    rule: Speculation,
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    row_slots: jax.Array,
    active: jax.Array,
    num_generated: jax.Array,
    by_slot: SampleRows,
    counts: jax.Array,
    last_tokens: jax.Array,
) -> tuple[jax.Array, jax.Array, SpecRecord]:
    """The speculative rule's verdict on rows ``row_slots[b]`` of a verify step's logits
    [b, K + 1, V] over their drafts [b, K] (the first ``num_drafts[b]`` real; deterministic,
    so q is one-hot): the counts and last tokens (the target's token after the kept drafts)
    written back to the slots, as ``_pick_rows`` does."""
    take = lambda x: jnp.take(x, row_slots, axis=0, mode="clip")
    settings = jax.tree.map(take, by_slot)
    b, k = drafts.shape
    rows = SpecRows(
        settings.sampler, settings.prompt_mask, settings.max_tokens, num_drafts,
        jnp.zeros((b, 2), jnp.uint32), drafts, jnp.zeros((b, k, 1), jnp.float32),
    )  # fmt: skip
    state = SpecState(_Lengths(jnp.zeros((b,), jnp.int32)), None)
    carry = Carry(state, take(last_tokens), active, num_generated, take(counts))
    proposal = Proposal(logits, drafts, None, num_drafts, None)
    carry, record = rule.advance(proposal, carry, rows, rule.empty_record(carry, rows, 1), 0)
    counts = put_rows(counts, row_slots, carry.picker)
    last_tokens = put_rows(last_tokens, row_slots, carry.tokens)
    return counts, last_tokens, record


@dataclass
class VerifyPicks(Picks):
    """A verify step's verdict (a ``SpecRecord``), still on the device, by row."""

    record: SpecRecord

    def read(self) -> HostTokens:
        want = any(s is not None and s.params.logprobs is not None for s in self.seqs)
        fields = ("tokens", "logprobs", "top_logprobs", "top_ids") if want else ("tokens",)
        counts = ("num_accepted", "num_drafts")
        host = jax.device_get([getattr(self.record, f) for f in fields + counts])
        by_name = dict(zip(fields + counts, (np.asarray(x[:, 0]) for x in host), strict=True))
        return HostTokens(**by_name)


@dataclass
class ChunkPicks(Picks):
    """A multi-step decode's tokens ([B, steps]), still on the device, and each row's count."""

    steps: list[int]  # by row: the tokens the host counts in flight

    def steps_of(self, row: int) -> int:
        return self.steps[row]

    def read(self) -> HostTokens:
        """Every row's tokens, its steps' worth (those past a stop are the host's to drop)."""
        want = any(s is not None and s.params.logprobs is not None for s in self.seqs)
        fields = ("tokens", "logprobs", "top_logprobs", "top_ids") if want else ("tokens",)
        host = jax.device_get([getattr(self.record, f) for f in fields])
        return HostTokens(*map(np.asarray, host), num_tokens=np.array(self.steps))


# A multi-step decode samples like a serving step (its rule's record has the logprob fields)
# with neither guided rows (their masks need the host every step) nor the sampler's costly
# passes: one program per decode width, for the rows that ask for none of them.
CHUNK_RULE = Sampling(
    greedy=False, want_logprobs=True, guided=False, passes=SamplerPasses(False, False)
)


@jit_by_rows(
    argument(5, "inputs", "tokens"),  # its rows' token ids (``ChunkRows``)
    static_argnames=("fn", "rule", "num_steps"),
    donate_argnames=("state", "inputs", "counts"),
    compiler_options=DEVICE_LOOP_OPTIONS,
)
def _decode_chunk(
    fn: Callable,
    rule: Sampling,
    num_steps: int,
    params: Any,
    state: PagedKVCache,
    inputs: ChunkRows,
    by_slot: SampleRows,
    counts: jax.Array,
) -> tuple[PagedKVCache, ChunkRows, jax.Array, tuple[jax.Array, jax.Array], Chunk]:
    """``num_steps`` decode steps and picks of rows ``inputs.row_slots[b]`` in one device call
    (the generation core's step in a loop, as its ``chunk_loop`` runs it with a fixed count):
    their counts and settings gathered from their slots, the counts written back after
    (padding rows name slot ``S``: dropped), as ``num_steps`` serving steps of the decode and
    ``_pick_rows`` would. Returns the cache, ``inputs`` (donated, handed back in their
    buffers: see ``decode_returning_inputs``; the cache comes first, its lengths before the
    rows'), the counts, (each row's last token, a copy of the rows' slots) for the slots'
    last tokens (``_set_last_tokens``, which reads no buffer the next call donates) and the
    record.

    Row b runs its first ``row_steps[b]`` steps (0: padding) whatever it picks: a stop id
    does not stop it here, as it does not stop a serving step's row before the host reads
    it (the host drops what follows). So the keys the host counts computed are the keys
    written, and a page the prefix cache registers holds what its key says."""
    row_slots = inputs.row_slots
    take = lambda x: jnp.take(x, row_slots, axis=0, mode="clip")
    rows = jax.tree.map(take, by_slot)
    carry = Carry(state, inputs.tokens, inputs.row_steps > 0, inputs.generated, take(counts))

    # The core's step in a loop of its own (the core's ``chunk_loop`` is a jit of its own,
    # and its compiler options cannot nest): a fixed trip count, no predicate read back.
    def body(i: jax.Array, loop: tuple[Carry, Chunk]) -> tuple[Carry, Chunk]:
        carry, record = core_step(fn, rule, params, None, loop[0], rows, loop[1], i)
        return dataclasses.replace(carry, active=i + 1 < inputs.row_steps), record

    record = rule.empty_record(carry, rows, num_steps)
    carry, record = jax.lax.fori_loop(0, num_steps, body, (carry, record))
    counts = put_rows(counts, row_slots, carry.picker)
    return carry.state, inputs, counts, (carry.tokens, jnp.copy(row_slots)), record


@jax.jit
def _verify_inputs(last_tokens: jax.Array, row_slots: jax.Array, drafts: jax.Array) -> jax.Array:
    """Each verify row's input [b, K + 1]: its slot's last token, then its drafts [b, K]."""
    return jnp.concatenate([_gather_tokens(last_tokens, row_slots)[:, None], drafts], axis=1)


class SlotPicker:
    """The generation core's sampling (``step.Sampling``) of a step's rows, with each slot's
    state on the device: token counts (penalties), prompt mask, sampling settings (rebuilt
    when the slots' owners change) and last token (the next decode input).

    A serving step is the core's step split in its two halves, the model's forward and the
    rule's pick: the decoding rows are picked from the decode step's logits and the rows
    that end their prefill from the prefill's, each pick over its own rows. A pick whose
    rows are all plain greedy runs the rule's argmax form (``GREEDY_RULE``), which reads and
    writes no token counts.
    """

    def __init__(
        self,
        num_slots: int,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_admitted: int,
        max_len: int,
        mesh: Mesh | None = None,
    ):
        """``max_admitted``: the most sequences one step admits (the rows of the admission
        program); ``max_len``: the most tokens (prompt and output) a sequence holds."""
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_admitted = max_admitted
        self.mesh = mesh
        # The admission program's token widths: a short prompt uploads a short row.
        self.token_ladder = pow2_ladder(min(ADMISSION_MIN_TOKENS, max_len), max_len)
        # Under tensor parallelism the per-token state is split by vocab like the logits that
        # update it, so a pick's outputs come back in the sharding warm-up compiled for.
        by_vocab = mesh is not None and vocab_size % mesh.devices.size == 0
        if by_vocab:
            place = partial(jax.device_put, device=vocab_sharding(mesh))
        else:
            place = partial(commit, mesh=mesh)
        self.counts = place(np.zeros((num_slots, vocab_size), np.int32))
        self.prompt_mask = place(np.zeros((num_slots, vocab_size), bool))
        self.last_tokens = commit(np.zeros((num_slots,), np.int32), mesh)
        # Every slot's settings (prompt mask aside: it is its own array); empty slots sample
        # greedily, unread. Rows change as owners do.
        self.settings = commit(
            SampleRows(self.batch([None] * num_slots), None, np.zeros((num_slots,), np.int32)),
            mesh,
        )
        self._free_masks: dict[int, jax.Array] = {}  # all-ones token masks, by row count
        self._owners: list[int | None] = [None] * num_slots  # admission numbers

    def sync(self, slots: Sequence[SequenceState | None]) -> None:
        """New owners get their slots' sampler rows (output so far, prompt, settings)."""
        owners = [None if s is None else s.admitted for s in slots]
        if owners == self._owners:
            return
        new = [
            seq
            for seq, old in zip(slots, self._owners, strict=True)
            if seq is not None and seq.admitted != old
        ]
        for first in range(0, len(new), self.max_admitted):
            self._set_rows(new[first : first + self.max_admitted])
        self._owners = owners

    def _set_rows(self, seqs: list[SequenceState]) -> None:
        """The sampler rows of up to ``max_admitted`` sequences, in one transfer of their
        token ids and settings and one program (``_set_rows``)."""
        pad = self.max_admitted - len(seqs)
        held = [seq.tokens for seq in seqs]
        width = rung(self.token_ladder, max(map(len, held)))
        tokens = np.zeros((self.max_admitted, width), np.int32)
        for row, ids in enumerate(held):
            tokens[row, : len(ids)] = ids
        host = self._admission(
            [seq.slot for seq in seqs] + [self.num_slots] * pad,
            tokens,
            [len(seq.prompt) for seq in seqs] + [0] * pad,
            [len(ids) for ids in held] + [0] * pad,
            [seq.params for seq in seqs] + [None] * pad,
        )
        self._apply_rows(host)

    def _admission(
        self,
        slots: list[int],
        tokens: np.ndarray,
        prompt_lengths: list[int],
        lengths: list[int],
        params: list[SamplingParams | None],
    ) -> tuple:
        """``_set_rows``' inputs after the state, on the host."""
        settings = SampleRows(
            self.batch(params, on_device=False),
            None,
            np.array([0 if p is None else p.max_tokens for p in params], np.int32),
        )
        as_ints = lambda xs: np.array(xs, np.int32)
        return as_ints(slots), tokens, as_ints(prompt_lengths), as_ints(lengths), settings

    def _apply_rows(self, host: tuple) -> None:
        """``_set_rows`` on ``_admission``'s host inputs, packed into one transfer."""
        buffer, packing = pack(host)
        self.counts, self.prompt_mask, self.settings = _set_rows(
            self.counts, self.prompt_mask, self.settings, jax.device_put(buffer), packing
        )

    def by_slot(self) -> SampleRows:
        """Every slot's sampling settings and prompt mask."""
        return dataclasses.replace(self.settings, prompt_mask=self.prompt_mask)

    def pick(self, logits: jax.Array, seqs: list[SequenceState | None]) -> Picks:
        """The next tokens of ``seqs`` (by row of ``logits[b, V]``; None: no pick) at their
        generated counts, under their guides' token masks (a guided row's matcher must have
        seen every token before: the engine reads the step in flight before the pick, see
        ``run``'s ``before_pick``); their slots' last tokens become these."""
        nowhere = self.num_slots
        row_slots = np.array([nowhere if s is None else s.slot for s in seqs], np.int32)
        active = np.array([s is not None for s in seqs])
        generated = np.array([0 if s is None else s.num_scheduled for s in seqs], np.int32)
        row_slots, active, generated = self.rows_on_device((row_slots, active, generated))
        return self.pick_rows(logits, seqs, row_slots, active, generated)

    def rows_on_device(self, rows: tuple[np.ndarray, ...]) -> tuple[jax.Array, ...]:
        """A pick's row inputs (slots, activity, generated counts) placed as a decode step's
        come out of ``_decode_inputs``: committed (``commit``), so every pick, after a decode
        or a prefill, runs the program warm-up compiled."""
        return commit(rows, self.mesh)

    def pick_rows(
        self,
        logits: jax.Array,
        seqs: list[SequenceState | None],
        row_slots: jax.Array,
        active: jax.Array,
        generated: jax.Array,
    ) -> Picks:
        """``pick`` with the rows' slots, activity and generated counts already uploaded."""
        params = [None if s is None else s.params for s in seqs]
        passes = None  # every row plain greedy: the argmax program
        if not all(p is None or p.plain_greedy for p in params):
            passes = SamplerPasses.for_params(params, self.vocab_size)
        return self._pick_with(passes, logits, seqs, row_slots, active, generated)

    def _pick_with(
        self,
        passes: SamplerPasses | None,
        logits: jax.Array,
        seqs: list[SequenceState | None],
        row_slots: jax.Array,
        active: jax.Array,
        generated: jax.Array,
    ) -> Picks:
        """The pick program of ``passes`` (None: the plain-greedy one) run on these rows."""
        args = self._pick_args(passes, logits, seqs, row_slots, active, generated)
        counts, self.last_tokens, record = _pick_rows(*args)
        self.counts = self.counts if counts is None else counts
        return Picks(record, seqs)

    def _pick_args(
        self,
        passes: SamplerPasses | None,
        logits: jax.Array,
        seqs: list[SequenceState | None],
        row_slots: jax.Array,
        active: jax.Array,
        generated: jax.Array,
    ) -> tuple:
        """``_pick_rows``' arguments for these rows (passes None: the plain-greedy pick's)."""
        rows = (logits, row_slots, active, generated, self._allowed(seqs), self.by_slot())
        if passes is None:
            return (GREEDY_RULE, *rows, None, self.last_tokens)
        return (dataclasses.replace(RULE, passes=passes), *rows, self.counts, self.last_tokens)

    def judge(
        self,
        logits: jax.Array,
        seqs: list[SequenceState | None],
        device_rows: tuple[jax.Array, ...],
    ) -> VerifyPicks:
        """The verdict on a verify step's rows (``device_rows``: their drafts, draft counts,
        slots, activity and generated counts, uploaded); no row of it is guided."""
        want = any(s is not None and s.params.logprobs is not None for s in seqs)
        rule = Speculation(logits.shape[1] - 1, None, greedy=False, with_top=want)
        self.counts, self.last_tokens, record = _judge_rows(
            rule, logits, *device_rows, self.by_slot(), self.counts, self.last_tokens
        )
        return VerifyPicks(record, seqs)

    def warm_judge(self, logits: jax.Array) -> None:
        """Runs the verdict programs (with and without logprobs) on a verify step's logits
        [b, K + 1, V] of no row."""
        b, t = logits.shape[:2]
        host = (
            np.zeros((b, t - 1), np.int32),
            np.zeros((b,), np.int32),
            np.full((b,), self.num_slots, np.int32),
            np.zeros((b,), bool),
            np.zeros((b,), np.int32),
        )
        for want in (False, True):
            rule = Speculation(t - 1, None, greedy=False, with_top=want)
            self.counts, self.last_tokens, _ = _judge_rows(
                rule, logits, *jax.device_put(host), self.by_slot(), self.counts,
                self.last_tokens,
            )  # fmt: skip

    def _allowed(self, seqs: list[SequenceState | None]) -> jax.Array:
        """The rows' token masks: their guides', all ones for free rows (one stored array per
        row count when no row is guided)."""
        guides = [None if s is None else s.guide for s in seqs]
        if any(g is not None for g in guides):
            return upload(fill_bitmask(guides, self.vocab_size))
        n = len(seqs)
        if n not in self._free_masks:
            ones = np.full((n, bitmask_width(self.vocab_size)), -1, np.int32)
            self._free_masks[n] = upload(ones)
        return self._free_masks[n]

    def batch(self, params: list[SamplingParams | None], on_device: bool = True) -> SamplerBatch:
        return SamplerBatch.from_params(
            params,
            self.vocab_size,
            self.eos_token_ids,
            min_width=SAMPLER_WIDTH,
            on_device=on_device,
        )

    def warm(self, logits: list[jax.Array], compile_threads: int) -> None:
        """Runs each pick program (logits shape x sampler passes, compiled on
        ``compile_threads`` threads) and the row setter once on no row."""
        n = self.num_slots
        runs = []
        for x in logits:
            rows = x.shape[0]
            host = (
                np.full((rows,), n, np.int32),
                np.zeros((rows,), bool),
                np.zeros((rows,), np.int32),
            )
            placed = self.rows_on_device(host)
            runs += [(passes, x, [None] * rows, *placed) for passes in PASS_VARIANTS]
            runs += [(None, x, [None] * rows, *placed)]  # the plain-greedy pick
        # Compiled on threads first (XLA compiles outside the GIL), then each run once.
        lowered = [_pick_rows.lower(*self._pick_args(*run)) for run in runs]
        with ThreadPoolExecutor(compile_threads) as pool:
            list(pool.map(lambda program: program.compile(), lowered))
        for run in runs:
            self._pick_with(*run)
        nobody = [n] * self.max_admitted  # the admission program at every token width
        zeros = [0] * self.max_admitted
        for width in self.token_ladder:
            tokens = np.zeros((self.max_admitted, width), np.int32)
            host = self._admission(nobody, tokens, zeros, zeros, [None] * self.max_admitted)
            self._apply_rows(host)
        jax.block_until_ready((self.last_tokens, self.counts))


def _prefill_samples(rows: list[PrefillRow], padded: int) -> list[SequenceState | None]:
    """Each prefill row's sequence if the row ends its prefill (it samples), else None."""
    return _padded([r.seq if r.last else None for r in rows], padded)


def _padded(seqs: list[SequenceState | None], rows: int) -> list[SequenceState | None]:
    """``seqs`` and None up to ``rows``."""
    return [*seqs, *[None] * (rows - len(seqs))]


class PagedExecutor:
    """A decoder-only model's steps over a paged KV cache (see the module docstring).

    decode_widths: the decode step's row counts (the lowest that holds a step's decoding rows
    runs it). width_ladder: the block table's widths in pages.
    ``adapter_rows_change_the_program`` (the runner's): warm-up compiles each step with and
    without an adapter row.
    """

    def __init__(
        self,
        model: Any,
        num_slots: int,
        num_pages: int,
        page_size: int,
        max_pages_per_seq: int,
        width_ladder: list[int],
        decode_widths: list[int],
        max_admitted: int,
        num_speculative_tokens: int = 0,
        num_scheduler_steps: int = 1,
        keep_hidden: bool = False,
        ragged_prefill: bool = False,
        mixed: bool = False,
    ):
        if mixed and (keep_hidden or not ragged_prefill):
            raise ValueError(
                "decode rows ride only in ragged prefill batches that keep no hidden states; "
                "pass ragged_prefill=True and keep_hidden=False, or mixed=False."
            )
        c = model.config
        self.runner = model.runner
        self.ragged_prefill = ragged_prefill  # prefill batches are ragged (``ChunkBudget``)
        # Decode rows ride in the prefill batch (``ChunkBudget.mixed``): every prefill
        # program also takes the top decode width's rows, none of them real when none ride.
        self.mixed = mixed
        self.num_mixed_steps = 0  # prefills that carried decode rows
        self.num_speculative_tokens = num_speculative_tokens  # K: 0 runs no verify step
        self.num_scheduler_steps = num_scheduler_steps  # a multi-step decode's steps
        self.num_multi_step_calls = 0  # multi-step decodes run
        self.adapter_rows_change_the_program = bool(self.runner.adapter_rows_change_the_program)
        self.num_slots = num_slots
        self.num_pages = num_pages
        self.max_pages_per_seq = max_pages_per_seq
        self.decode_widths = decode_widths
        self.decode_steps_by_width: Counter[int] = Counter()
        self.mesh = model.mesh
        self.state = commit_cache(
            PagedKVCache.create(
                c.num_layers, num_slots, num_pages, page_size, max_pages_per_seq,
                c.num_kv_heads, c.head_dim, model.dtype, self.runner.kv_cache_dtype,
            ),
            self.mesh,
        )  # fmt: skip
        self.width_ladder = width_ladder
        if self._decode_reads_pages_in_place(model):
            # Each row's attention then reads its own pages whatever the table's width: one
            # table width instead of a ladder, so fewer compiles at startup.
            self.width_ladder = [max_pages_per_seq]
        self.table = BlockTable(num_slots, max_pages_per_seq, num_pages)
        # The decode, multi-step decode and ragged prefill programs' inputs by program and
        # shape (``_decode_inputs``, ``_chunk_inputs``, ``_prefill_inputs``).
        self._held: dict[tuple[type, tuple[int, ...]], Any] = {}
        # ``keep_hidden`` (a draft head's engine): every prefill, decode and verify step
        # writes its final hidden states here, [slot, position, D], for the head to read.
        self.hidden_rows: jax.Array | None = None
        if keep_hidden:
            shape = (num_slots, max_pages_per_seq * page_size, c.hidden_size)
            self.hidden_rows = commit(jnp.zeros(shape, model.dtype), self.mesh)
        self.sampler = SlotPicker(
            num_slots, c.vocab_size, model.eos_token_ids, max_admitted,
            max_pages_per_seq * page_size, self.mesh,
        )  # fmt: skip

    def _decode_reads_pages_in_place(self, model: Any) -> bool:
        """True where the decode step's attention reads the pages in place (cuDNN's paged
        attention or our paged kernel, on the GPU) at every decode width, rather than
        gathering the rows."""
        c = model.config
        window = next((w for w in c.sliding_windows if w), None)
        return all(
            paged_kernel(
                jax.ShapeDtypeStruct((b, 1, c.num_heads, c.head_dim), model.dtype),
                self.state.k[0],
                window,
                model.options,
            )
            is not None
            for b in self.decode_widths
        )

    def _lora(self, adapters: Sequence[int]) -> dict[str, Any]:
        # Adapters go to the runner only when a pool exists, so plain models keep one compile.
        return {} if self.runner.lora_pool is None else {"adapters": list(adapters)}

    def _hidden(self) -> dict[str, bool]:
        """The steps' ``with_hidden`` argument when they keep their hidden states."""
        return {} if self.hidden_rows is None else {"with_hidden": True}

    def _keep(self, out: Any, row_slots: Sequence[int], starts: Sequence[int]) -> jax.Array:
        """A step's logits; with ``hidden_rows``, its hidden states [B, T, D] are written
        there first, row b's at slot ``row_slots[b]`` (out of range: dropped) from position
        ``starts[b]`` (host arrays: the step's own were donated with its cache)."""
        if self.hidden_rows is None:
            return out
        logits, hidden = out
        host = (np.asarray(row_slots, np.int32), np.asarray(starts, np.int32))
        self.hidden_rows = _store_hidden(self.hidden_rows, hidden, *jax.device_put(host))
        return logits

    def _device_state(self, width: int) -> PagedKVCache:
        table = upload(self.table.pages[:, :width])
        return self.state.with_block_table(table).with_lengths(upload(self.table.lengths))

    # -- one step ---------------------------------------------------------------------------

    def run(
        self,
        plan: StepPlan,
        slots: Sequence[SequenceState | None],
        before_pick: Callable[[], None] | None = None,
    ) -> list[Picks]:
        """Dispatches one step's decode and prefill rows and the picks of the rows that
        sample; nothing waits for the device. ``before_pick`` is called once, after the
        decode rows' forward is dispatched and before any pick: the engine reads the step in
        flight there, so its guided rows' matchers see their last tokens while the forward
        runs."""
        self.table.sync([s for s in slots if s is not None])
        riding = plan.decode if self._rides(plan) else []
        picks = []
        if plan.decode and not riding:
            self.sampler.sync(slots)
            picks.append(self._decode(plan, before_pick))
            before_pick = None
        if plan.prefill:
            picks += self._prefill(plan, riding, before_pick, slots)
        elif before_pick is not None:
            before_pick()
        return picks

    def _rides(self, plan: StepPlan) -> bool:
        """Whether the plan's decode rows ride in its prefill batch (a mixed step): one
        step each, none verifying drafts."""
        return (
            self.mixed
            and bool(plan.prefill)
            and plan.num_steps == 1
            and not any(s.drafts for s in plan.decode)
        )

    def chunkable(self, rows: Sequence[SequenceState]) -> bool:
        """Whether ``rows`` can decode several steps in one device call (``_decode_chunk``):
        none guided or speculative (the host acts on those between steps), none asking for
        the sampler's costly passes, and no adapters (the chunk takes none)."""
        if self.num_scheduler_steps < 2 or self.runner.lora_pool is not None:
            return False
        if any(s.guide is not None or s.speculative for s in rows):
            return False
        return SamplerPasses.for_params([s.params for s in rows], self.sampler.vocab_size) == (
            CHUNK_RULE.passes
        )

    def _decode(self, plan: StepPlan, before_pick: Callable[[], None] | None) -> Picks:
        """The decoding rows packed at the lowest decode width that holds them (a verify
        step when one of them has drafts; a multi-step decode when the plan has steps);
        ``before_pick`` between the forward and the pick (before both in the other two)."""
        rows = plan.decode
        b = rung(self.decode_widths, len(rows))
        self.decode_steps_by_width[b] += 1
        width = rung(self.width_ladder, max(len(s.pages) for s in rows))
        row_slots = np.full((b,), self.num_slots, np.int32)
        row_slots[: len(rows)] = [s.slot for s in rows]
        table = np.full((b, width), self.table.none, np.int32)
        table[: len(rows)] = self.table.pages[row_slots[: len(rows)], :width]
        lengths = np.zeros((b,), np.int32)
        lengths[: len(rows)] = self.table.lengths[row_slots[: len(rows)]]
        active = np.arange(b) < len(rows)
        generated = np.zeros((b,), np.int32)
        generated[: len(rows)] = [s.num_scheduled for s in rows]
        adapters = [s.adapter for s in rows] + [-1] * (b - len(rows))
        seqs: list[SequenceState | None] = [*rows, *[None] * (b - len(rows))]
        for i, seq in enumerate(rows):
            self.table.lengths[seq.slot] += plan.steps_of(i)
        if before_pick is not None and (plan.num_steps > 1 or any(s.drafts for s in rows)):
            before_pick()  # no guided row runs in these (see ``chunkable``, the engine's drafts)
            before_pick = None
        if plan.num_steps > 1:
            steps = np.zeros((b,), np.int32)
            steps[: len(rows)] = [plan.steps_of(i) for i in range(len(rows))]
            host = (row_slots, table, lengths, steps, generated)
            return self._chunk(plan.num_steps, seqs, host)
        if any(s.drafts for s in rows):
            host = (row_slots, table, lengths, active, generated)
            return self._verify(rows, seqs, host, adapters)
        host = (row_slots, table, lengths, active, generated)
        starts = lengths
        held, (row_slots, active, generated) = self._upload_decode_inputs(host)
        state = self.state.with_block_table(held.block_table).with_lengths(held.lengths)
        (tokens, rows_active), out, self.state = self.runner.decode(
            state,
            held.tokens,
            held.active,
            **self._lora(adapters),
            **self._hidden(),
            returning_inputs=True,
        )
        # Kept for the next step at this shape: the decode hands its inputs back in the
        # buffers it took (its cache's table and lengths too), so the next step donates
        # buffers no queued program reads.
        self._held[DecodeInputs, held.block_table.shape] = DecodeInputs(
            tokens, rows_active, self.state.block_table, self.state.lengths
        )
        logits = self._keep(out, host[0], starts)
        if before_pick is not None:
            before_pick()
        return self.sampler.pick_rows(logits, seqs, row_slots, active, generated)

    def _upload_decode_inputs(
        self, host: tuple[np.ndarray, ...]
    ) -> tuple[DecodeInputs, tuple[jax.Array, ...]]:
        """A decode step's host inputs (slots, block table, lengths, activity, generated
        counts) on the device in one transfer (each array a transfer of its own cost the host
        more than the rest of the dispatch): the decode program's in the buffers its last
        step at this width used (``_decode_inputs``), and the pick's rows."""
        buffer, packing = pack(host)
        held = self._held_inputs(DecodeInputs, host[1].shape)
        return _decode_inputs(held, self.sampler.last_tokens, jax.device_put(buffer), packing)

    def _held_inputs(self, kind: type, shape: tuple[int, int]) -> DecodeInputs | ChunkInputs:
        """The buffers the last ``kind`` program of this block-table shape [rows, width]
        handed back, or new ones."""
        held = self._held.get((kind, shape))
        return kind.zeros(*shape, self.mesh) if held is None or held.deleted() else held

    def _chunk(
        self, num_steps: int, seqs: list[SequenceState | None], host: tuple[np.ndarray, ...]
    ) -> ChunkPicks:
        """The decode rows' ``num_steps`` steps in one device call (``_decode_chunk``); ``host``:
        the rows' slots, block table, lengths, steps each and generated counts."""
        self.num_multi_step_calls += 1
        steps = host[3].tolist()
        record = self._run_chunk(num_steps, host)
        return ChunkPicks(record, seqs, steps)

    def _run_chunk(self, num_steps: int, host: tuple[np.ndarray, ...]) -> Chunk:
        """``_decode_chunk`` on these host inputs, written into the buffers the last call of
        this shape handed back, kept for the next; its record."""
        held = self._held_inputs(ChunkInputs, host[1].shape)
        sampler = self.sampler
        self.state, rows, sampler.counts, last, record = _decode_chunk(
            *self._chunk_args(num_steps, host, held)
        )
        sampler.last_tokens = _set_last_tokens(sampler.last_tokens, last[1], last[0])
        self._held[ChunkInputs, host[1].shape] = ChunkInputs(
            rows, self.state.block_table, self.state.lengths
        )
        return record

    def _chunk_args(self, num_steps: int, host: tuple[np.ndarray, ...], held: ChunkInputs) -> tuple:
        """``_decode_chunk``'s arguments: the host inputs in one transfer, written into
        ``held`` (``_chunk_inputs``)."""
        buffer, packing = pack(host)
        held = _chunk_inputs(held, self.sampler.last_tokens, jax.device_put(buffer), packing)
        state = self.state.with_block_table(held.block_table).with_lengths(held.lengths)
        return (
            self.runner.decode_fn, CHUNK_RULE, num_steps, self.runner.params, state, held.rows,
            self.sampler.by_slot(), self.sampler.counts,
        )  # fmt: skip

    def _verify(
        self,
        rows: list[SequenceState],
        seqs: list[SequenceState | None],
        host: tuple[np.ndarray, ...],
        adapters: list[int],
    ) -> VerifyPicks:
        """The decode rows' verify step: each row's last token and drafts at its positions
        (the scheduler reserved their pages), then the verdict. The host's lengths count the
        last token only: the kept drafts join when the verdict is read."""
        row_slots, table, lengths, active, generated = host
        k = self.num_speculative_tokens
        drafts = np.zeros((len(seqs), k), np.int32)
        num_drafts = np.zeros((len(seqs),), np.int32)
        for i, seq in enumerate(rows):
            drafts[i, : len(seq.drafts)] = seq.drafts
            num_drafts[i] = len(seq.drafts)
        real = active.astype(np.int32) + num_drafts  # tokens verified per row
        host = (row_slots, table, lengths, active, generated, drafts, num_drafts, real)
        host_slots, starts = row_slots, lengths
        row_slots, table, lengths, active, generated, drafts, num_drafts, real = jax.device_put(
            host
        )
        state = self.state.with_block_table(table).with_lengths(lengths)
        tokens = _verify_inputs(self.sampler.last_tokens, row_slots, drafts)
        out, self.state = self.runner.verify(
            state, tokens, real, **self._lora(adapters), **self._hidden()
        )
        logits = self._keep(out, host_slots, starts)
        device_rows = (drafts, num_drafts, row_slots, active, generated)
        return self.sampler.judge(logits, seqs, device_rows)

    def _prefill(
        self,
        plan: StepPlan,
        riding: list[SequenceState],
        before_pick: Callable[[], None] | None,
        slots: Sequence[SequenceState | None],
    ) -> list[Picks]:
        """Runs the chunks, and the ``riding`` decode rows a step each in the same forward;
        then the admitted rows' sampler state (``slots``' new owners: only the picks read
        it, so the device starts on the forward first); ``before_pick``; then the picks of
        the rows that end their prefill and of the riding rows, from their logits."""
        rows, padded = plan.prefill, plan.prefill_rows
        pad = padded - len(rows)
        nowhere = self.num_slots  # a slot out of range: its writes are dropped
        row_slots = [r.seq.slot for r in rows] + [nowhere] * pad
        # A ragged batch's padding rows hold no token; a [B, T] batch's one each.
        chunks = [r.seq.tokens[r.start : r.start + r.length] for r in rows]
        chunks += [[] if self.ragged_prefill else [0]] * pad
        seqs = _prefill_samples(rows, padded)
        adapters = [r.seq.adapter for r in rows] + [-1] * pad
        decode_slots = None
        if riding:  # the top decode width's rows, the riding ones first
            self.num_mixed_steps += 1
            seqs += _padded(riding, self.decode_widths[-1])
            decode_slots = [nowhere if s is None else s.slot for s in seqs[padded:]]
            adapters += [-1 if s is None else s.adapter for s in seqs[padded:]]
        if self.ragged_prefill:
            args = (row_slots, chunks, decode_slots, adapters, plan.prefill_len)
            out = self._ragged_prefill(*self._ragged_inputs(*args))
        else:
            out, self.state = self.runner.prefill(
                self._device_state(self.max_pages_per_seq),
                row_slots,
                chunks,
                continuing=True,
                min_len=plan.prefill_len,
                **self._lora(adapters),
                **self._hidden(),
            )
        self.sampler.sync(slots)
        logits = self._keep(out, row_slots, [r.start for r in rows] + [0] * pad)
        for r in rows:
            self.table.lengths[r.seq.slot] = r.start + r.length
        for seq in riding:
            self.table.lengths[seq.slot] += 1
        if before_pick is not None:
            before_pick()
        # The prefill rows' pick and the riding rows' (each at a width the decode has).
        outs = logits if decode_slots is not None else (logits,)
        picks = []
        for x, part in zip(outs, (seqs[:padded], seqs[padded:]), strict=False):
            if any(s is not None for s in part):
                picks.append(self.sampler.pick(x, part))
        return picks

    def _ragged_inputs(
        self,
        row_slots: list[int],
        chunks: list[list[int]],
        decode_slots: list[int] | None,
        adapters: list[int],
        total: int,
    ) -> tuple[PrefillInputs, tuple[int, ...], list[int] | None]:
        """A ragged prefill's inputs (decode rows riding: ``decode_slots``) in the buffers
        the last one of its shape handed back, in one transfer (``_prefill_inputs``); their
        shape; the adapter of each token (None without a LoRA pool)."""
        lengths = [len(c) for c in chunks]
        tokens = np.zeros((total,), np.int32)
        tokens[: sum(lengths)] = [t for c in chunks for t in c]
        width = self.max_pages_per_seq
        host = (
            tokens,
            np.asarray(lengths, np.int32),
            np.asarray(row_slots, np.int32),
            None if decode_slots is None else np.asarray(decode_slots, np.int32),
            self.table.pages[:, :width],
            self.table.lengths,
        )
        riding = 0 if decode_slots is None else len(decode_slots)
        shape = (total, len(chunks), riding, self.num_slots, width)
        held = self._held.get((PrefillInputs, shape))
        if held is None or held.deleted():
            held = PrefillInputs.zeros(*shape, self.mesh)
        last = None if decode_slots is None else self.sampler.last_tokens
        buffer, packing = pack(host)
        held = _prefill_inputs(held, last, jax.device_put(buffer), packing)
        per_token = None
        if self.runner.lora_pool is not None:
            decoding = sum(s < self.num_slots for s in decode_slots or [])
            per_token = token_adapters(adapters, lengths, decoding, total)
        return held, shape, per_token

    def _ragged_prefill(
        self, held: PrefillInputs, shape: tuple[int, ...], adapters: list[int] | None
    ) -> Any:
        """The ragged prefill on inputs ``_ragged_inputs`` wrote; they come back in the same
        buffers, kept for the next prefill of this shape (as the decode's: ``_decode``)."""
        state = self.state.with_block_table(held.block_table).with_lengths(held.kv_lengths)
        inputs, out, self.state = self.runner.prefill_held(
            state, *held[:5], adapters=adapters, **self._hidden()
        )
        self._held[PrefillInputs, shape] = PrefillInputs(
            *inputs, self.state.block_table, self.state.lengths
        )
        return out

    # -- warm-up ----------------------------------------------------------------------------

    def warm_groups(self, prefill_shapes: list[tuple[int, int]]) -> list[WarmGroup]:
        """Every decode width x block-table width and (rows, chunk) prefill batch, run on
        rows out of range."""
        steps = [WarmStep("decode", (b, w)) for b in self.decode_widths for w in self.width_ladder]
        if self.num_speculative_tokens:
            steps += [
                WarmStep("verify", (b, w)) for b in self.decode_widths for w in self.width_ladder
            ]
        if self.num_scheduler_steps > 1 and self.runner.lora_pool is None:
            steps += [
                WarmStep("chunk", (b, w)) for b in self.decode_widths for w in self.width_ladder
            ]
        kind = "ragged" if self.ragged_prefill else "prefill"
        steps += [WarmStep(kind, shape) for shape in prefill_shapes]
        if self.mixed:  # the same batches with decode rows riding
            steps += [WarmStep("mixed", shape) for shape in prefill_shapes]
        return [WarmGroup(steps, self.lower, partial(_run_warm_steps, self))]

    def warm_rest(self, max_admitted: int) -> None:
        """Nothing beyond the steps and the sampler (no beam lane)."""
        del max_admitted

    def lower(self, step: WarmStep) -> jax.stages.Lowered:
        """The program of one warm-up step, traced but not compiled."""
        if step.kind == "chunk":
            return self._lower_chunk(step)
        return _lower(self, step)

    def warm_chunk(self, step: WarmStep) -> None:
        """Runs a multi-step decode on no row (an empty block table)."""
        self._run_chunk(self.num_scheduler_steps, self._warm_chunk_host(step))

    def _warm_chunk_host(self, step: WarmStep) -> tuple[np.ndarray, ...]:
        """A warm-up multi-step decode's host inputs: rows in no slot, running no step."""
        b, width = step.shape
        row = lambda: np.zeros((b,), np.int32)
        slots, table = np.full((b,), self.num_slots, np.int32), np.full((b, width), self.num_pages)
        return slots, table.astype(np.int32), row(), row(), row()

    def _lower_chunk(self, step: WarmStep) -> jax.stages.Lowered:
        """``_decode_chunk``'s program for a warm-up step, its inputs made as a run makes
        them (in buffers of their own: the run's held ones stay where they are)."""
        host = self._warm_chunk_host(step)
        held = ChunkInputs.zeros(*host[1].shape, self.mesh)
        return _decode_chunk.lower(*self._chunk_args(self.num_scheduler_steps, host, held))

    def warm_inputs(self, step: WarmStep) -> tuple[tuple, dict[str, Any]]:
        if step.kind in ("decode", "verify"):  # no active row, over an empty block table
            b, width = step.shape
            kwargs = self._lora(_warm_adapters(b, step.adapted)) | self._hidden()
            zeros = np.zeros((b,), np.int32)
            host = (zeros, np.full((b, width), self.num_pages, np.int32), zeros, zeros != 0, zeros)
            if step.kind == "verify":  # its inputs as a run makes them
                slots, table, lengths, _, _ = jax.device_put(host)
                state = self.state.with_block_table(table).with_lengths(lengths)
                drafts = upload(np.zeros((b, self.num_speculative_tokens), np.int32))
                tokens = _verify_inputs(self.sampler.last_tokens, slots, drafts)
                return (state, tokens, upload(zeros)), kwargs
            # The decode's inputs as a run uploads them, and its program.
            held, _ = self._upload_decode_inputs(host)
            state = self.state.with_block_table(held.block_table).with_lengths(held.lengths)
            return (state, held.tokens, held.active), kwargs | {"returning_inputs": True}
        rows, chunk = step.shape  # rows x chunk tokens into slots out of range
        adapters = _warm_adapters(rows, step.adapted)
        if step.kind in ("ragged", "mixed"):  # ``chunk`` tokens in all, the first row's
            decode_slots = None
            if step.kind == "mixed":  # the top decode width's rows, none real
                decode_slots = [self.num_slots] * self.decode_widths[-1]
                adapters += [-1] * len(decode_slots)
            chunks = [[0] * chunk] + [[]] * (rows - 1)
            args = ([self.num_slots] * rows, chunks, decode_slots, adapters, chunk)
            held, _, per_token = self._ragged_inputs(*args)
            state = self.state.with_block_table(held.block_table).with_lengths(held.kv_lengths)
            return (state, *held[:5]), {"adapters": per_token} | self._hidden()
        state = self._device_state(self.max_pages_per_seq)
        kwargs = {"continuing": True, "min_len": chunk} | self._hidden() | self._lora(adapters)
        return (state, [self.num_slots] * rows, [[0] * chunk] * rows), kwargs

    def warm_keep(self, out: Any) -> jax.Array:
        """A warm-up step's logits, its hidden states stored nowhere (slots out of range) as
        a run stores them."""
        if self.hidden_rows is None:
            return out
        b = out[1].shape[0]
        return self._keep(out, [self.num_slots] * b, [0] * b)


def _lower(executor: PagedExecutor | DenseExecutor, step: WarmStep) -> jax.stages.Lowered:
    """A warm-up step's program (inputs made as a run makes them)."""
    args, kwargs = executor.warm_inputs(step)
    runner = executor.runner
    if step.kind in ("ragged", "mixed"):  # (the paged executor's)
        return runner.prefill_held(*args, **kwargs, lower=True)
    lower = {"decode": runner.lower_decode, "prefill": runner.lower_prefill}.get(step.kind)
    return (lower or runner.lower_verify)(*args, **kwargs)


def _warm_adapters(rows: int, adapted: bool) -> list[int]:
    """A warm-up batch's adapters: the base, or (``adapted``) adapter 0 in the first row."""
    return [0 if adapted and i == 0 else -1 for i in range(rows)]


def _run_warm_steps(
    executor: PagedExecutor | DenseExecutor, steps: list[WarmStep], compile_threads: int
) -> None:
    """Runs each base step once (its adapter variants are compiled only), then the pick of
    every logits shape they give (compiled on ``compile_threads`` threads) and the decode's
    token gather."""
    runner, sampler = executor.runner, executor.sampler
    shapes: dict[int, jax.Array] = {}
    verified: dict[int, jax.Array] = {}
    for step in [s for s in steps if not s.adapted]:
        if step.kind == "chunk":  # the paged executor's multi-step decode, picks inside
            executor.warm_chunk(step)
            continue
        args, kwargs = executor.warm_inputs(step)
        if step.kind == "decode":  # (the paged executor's hands its inputs back first)
            out, executor.state = runner.decode(*args, **kwargs)[-2:]
        elif step.kind == "verify":
            out, executor.state = runner.verify(*args, **kwargs)
            logits = executor.warm_keep(out)
            verified[logits.shape[0]] = logits
            continue
        elif step.kind in ("ragged", "mixed"):  # (hands its inputs back first, as decode does)
            out, executor.state = runner.prefill_held(*args, **kwargs)[-2:]
        else:
            out, executor.state = runner.prefill(*args, **kwargs)
        logits = executor.warm_keep(out)
        for x in logits if isinstance(logits, tuple) else (logits,):  # a mixed step's pair
            shapes[x.shape[0]] = x
    sampler.warm(list(shapes.values()), compile_threads)
    for logits in verified.values():
        sampler.warm_judge(logits)


class DenseExecutor:
    """An encoder-decoder model's steps over its dense per-slot cache, and the beam lane.

    Each slot holds its own decoder keys (``max_model_len`` positions: the two seed tokens
    and the generated ones) and its source's cross-attention keys (``max_source_len``).
    Sources admitted in one step are prefilled as one batch, padded to the row ladder with
    copies of the first that write nowhere. The beam lane has cache rows of its own.
    """

    def __init__(
        self,
        model: Any,
        num_slots: int,
        max_model_len: int,
        max_source_len: int,
        max_num_beams: int,
        max_admitted: int,
    ):
        self.runner = model.runner
        self.adapter_rows_change_the_program = bool(self.runner.adapter_rows_change_the_program)
        self.eos_token_id = model.config.eos_token_id
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.max_source_len = max_source_len
        self.max_num_beams = max_num_beams
        self.mesh = model.mesh
        state = self.runner.init_state(num_slots, max_model_len, max_source_len)
        self.state = commit_cache(state, self.mesh)
        self.sampler = SlotPicker(
            num_slots, model.config.vocab_size, model.eos_token_ids, max_admitted,
            max_source_len + max_model_len, self.mesh,
        )  # fmt: skip
        self.new_beam_lane()

    def new_beam_lane(self) -> None:
        """An empty beam lane (at start, and after a failed step)."""
        # The same rows, length and sources as the greedy cache, committed like it; its row
        # table makes its prefills programs of their own (warmed in their own group).
        self.beams = BeamLane(
            self.runner, self.max_num_beams, self.num_slots, self.max_model_len,
            self.max_source_len,
        )  # fmt: skip
        self.beams.carry = commit(self.beams.carry, self.mesh)

    def _lora(self, adapters: Sequence[int]) -> dict[str, Any]:
        return {} if self.runner.lora_pool is None else {"adapters": list(adapters)}

    # -- one step ---------------------------------------------------------------------------

    def run(
        self,
        plan: StepPlan,
        slots: Sequence[SequenceState | None],
        before_pick: Callable[[], None] | None = None,
    ) -> list[Picks]:
        """Dispatches one step's decode rows (every slot runs; idle ones are masked) and
        whole-source prefills, and the picks of both (every prefilled source samples: its
        prefill ends in the step that admits it); nothing waits for the device.
        ``before_pick``: as ``PagedExecutor.run``'s."""
        self.sampler.sync(slots)
        picks = []
        if not plan.decode and before_pick is not None:
            before_pick()
        if plan.decode:
            decoding = set(id(s) for s in plan.decode)
            seqs = [s if s is not None and id(s) in decoding else None for s in slots]
            active = np.array([s is not None for s in seqs])
            adapters = [-1 if s is None else s.adapter for s in slots]
            logits, self.state = self.runner.decode(
                self.state, self.sampler.last_tokens, upload(active), **self._lora(adapters)
            )
            if before_pick is not None:
                before_pick()
            picks.append(self.sampler.pick(logits, seqs))
        if plan.prefill:
            picks.append(self._prefill(plan))
        return picks

    def _prefill(self, plan: StepPlan) -> Picks:
        """Encodes the admitted sources and seeds their decoders; picks their first tokens."""
        seqs = [row.seq for row in plan.prefill]
        pad = plan.prefill_rows - len(seqs)
        nowhere = self.num_slots  # a slot out of range: its writes are dropped
        first = seqs[0]
        row_slots = [s.slot for s in seqs] + [nowhere] * pad
        prompts = [s.prompt for s in seqs] + [first.prompt] * pad
        requests = [s.params for s in seqs] + [first.params] * pad
        adapters = [s.adapter for s in seqs] + [-1] * pad
        chunk_logits, self.state = self.runner.prefill(
            self.state, row_slots, prompts, requests, **self._lora(adapters)
        )
        samples = _prefill_samples(plan.prefill, len(row_slots))
        return self.sampler.pick(chunk_logits, samples)

    def run_beams(self, limit: int) -> dict[int, BeamResult]:
        """One chunk of search steps of every running beam request, after admitting up to
        ``limit`` waiting ones; the results of those that finished, by lane index."""
        lane = self.beams
        if not lane.busy:
            return {}
        lane.admit(limit=limit)
        lane.retire(np.asarray(lane.dispatch()))
        lane.collect()
        results, lane.results = dict(lane.results), {}
        return results

    # -- warm-up ----------------------------------------------------------------------------

    def warm_groups(self, prefill_shapes: list[tuple[int, int]]) -> list[WarmGroup]:
        """The decode step and every (rows, source length) prefill, run on rows out of
        range; then every prefill again on the beam lane's cache, whose row table (beams read
        their history through it) makes its prefills programs of their own."""
        steps = [WarmStep("decode", ())] + [WarmStep("prefill", s) for s in prefill_shapes]
        beam_steps = [WarmStep("prefill", s) for s in prefill_shapes]
        return [
            WarmGroup(steps, self.lower, partial(_run_warm_steps, self)),
            WarmGroup(beam_steps, self._lower_beam_prefill, self._run_beam_prefills),
        ]

    def lower(self, step: WarmStep) -> jax.stages.Lowered:
        """The program of one warm-up step, traced but not compiled."""
        return _lower(self, step)

    def warm_keep(self, out: jax.Array) -> jax.Array:
        """A warm-up step's logits (its steps keep no hidden states)."""
        return out

    def warm_inputs(self, step: WarmStep) -> tuple[tuple, dict[str, Any]]:
        n = self.num_slots
        if step.kind == "decode":  # no active row
            tokens, active = self.sampler.last_tokens, upload(np.zeros((n,), bool))
            return (self.state, tokens, active), self._lora(_warm_adapters(n, step.adapted))
        rows, length = step.shape  # rows sources of length EOS tokens into slots out of range
        source = [self.eos_token_id] * min(length, self.max_source_len)
        request = self._warmup_request()
        args = (self.state, [n] * rows, [source] * rows, [request] * rows)
        return args, self._lora(_warm_adapters(rows, step.adapted))

    def _beam_warm_inputs(self, step: WarmStep) -> tuple[tuple, dict[str, Any]]:
        args, kwargs = self.warm_inputs(step)
        return (self.beams.carry.state, *args[1:]), kwargs

    def _lower_beam_prefill(self, step: WarmStep) -> jax.stages.Lowered:
        args, kwargs = self._beam_warm_inputs(step)
        return self.runner.lower_prefill(*args, **kwargs)

    def _run_beam_prefills(self, steps: list[WarmStep], compile_threads: int) -> None:
        del compile_threads  # compiled with the group
        for step in steps:  # variants too: nothing else runs them
            args, kwargs = self._beam_warm_inputs(step)
            _, cache = self.runner.prefill(*args, **kwargs)
            self.beams.carry = dataclasses.replace(self.beams.carry, state=cache)

    def warm_rest(self, max_admitted: int) -> None:
        """Runs 1 .. ``max_admitted`` one-step searches at once: the programs that depend on
        how many requests one step admits, then the search chunk itself."""
        tgt_lang = self._warmup_request().tgt_lang
        dummy = BeamRequest([self.eos_token_id] * 4, tgt_lang=tgt_lang, num_beams=1, max_new=1)
        for n in range(1, min(max_admitted, self.num_slots) + 1):
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
