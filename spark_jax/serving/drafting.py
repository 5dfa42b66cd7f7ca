"""The serving engine's drafters: the drafts of each speculative row for the next step.

Between steps, with every speculative row's tokens read, the engine hands its drafter the
rows it will verify and how many drafts each has room for (``propose(rows)``); the drafter
sets each row's ``drafts``. The verify step, the speculative rule and the roll-back are the
engine's, whoever drafted.

- ``LookupRows`` (``"ngram"``): prompt lookup over each row's own tokens, on the host.
- ``ModelRows`` (``"draft"``, ``"layer-skip"``): a draft model (or the target less some
  layers) with a dense KV cache of one row per engine slot. One device call drafts K tokens
  for every row (the rows' last tokens, then K - 1 decode steps), whose result the host
  reads.
- ``HeadRows`` (``"head"``): a draft head (spark_jax.models.draft_head) with a cache row per
  slot, over the target's hidden states, which the executor keeps for every position its
  steps compute (``PagedExecutor.hidden_rows``). One call feeds the head the positions
  computed since its last proposal (the target's state at p and the token at p + 1), then
  chains it K times.

The drafts are the drafter's argmax for every row, sampled ones included: the rule then
judges them as deterministic drafts (q one-hot), which keeps the target's distribution
exactly, as it does for prompt lookup's drafts.

A draft model's row follows its sequence without being told what the verdict was: the host
remembers what it fed each row (the tokens up to the row's last, then K - 1 drafts), and
before the next proposal it keeps the part that still agrees with the sequence's tokens. A
token or two missing are fed by the proposal itself (the last token, and the one before
after a step that kept every draft); more (the whole sequence, for a row that a new
occupant of the slot or a preempted sequence now holds) are fed first, in chunks of a fixed
width. A head's row follows its sequence the same way, by the positions it was fed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation.drafters import (
    DraftModelDrafter,
    HeadDrafter,
    HeadDrafts,
    HeadState,
    ModelDrafts,
    ModelDraftState,
    PromptLookupDrafter,
)
from spark_jax.generation.step import Carry
from spark_jax.models import draft_head
from spark_jax.serving.executor import PagedExecutor, commit, commit_cache, upload
from spark_jax.serving.scheduler import SequenceState


class LookupRows:
    """Prompt lookup (``PromptLookupDrafter``) for each row, from its own tokens."""

    def __init__(self, drafter: PromptLookupDrafter):
        self.drafter = drafter

    def propose(self, rows: Sequence[tuple[SequenceState, int]]) -> None:
        """Sets each row's drafts (at most its room)."""
        for seq, room in rows:
            seq.drafts = self.drafter.propose(seq.tokens, room).tokens

    def warm(self) -> None:
        """Nothing to compile."""


@partial(jax.jit, static_argnames=("verify_fn",), donate_argnames=("cache",))
def _append(verify_fn, params, cache, tokens, counts, lengths):
    """Appends tokens[S, C] (the first ``counts[s]`` real) to the rows of lengths ``lengths``."""
    _, cache = verify_fn(params, tokens, counts, cache.with_lengths(lengths), None)
    return cache


@partial(jax.jit, static_argnames=("program", "k"), donate_argnames=("cache",))
def _propose(program: ModelDrafts, params, cache, pending, counts, lengths, k: int):
    """Each active row's k greedy drafts (int32[S, k]) after its ``counts[s]`` (1 or 2)
    pending tokens ``pending[S, 2]``, the last being the row's last token; rows with count 0
    are left as they are."""
    active = counts > 0
    last = jnp.take_along_axis(pending, jnp.maximum(counts - 1, 0)[:, None], 1)[:, 0]
    lag = jnp.maximum(counts - 1, 0)
    state = ModelDraftState(cache.with_lengths(lengths), lag, pending[:, 0])
    rows = jnp.zeros_like(counts)
    carry = Carry(None, last, active, rows, None)
    keys = jnp.zeros((counts.shape[0], 2), jnp.uint32)  # greedy: no draw reads them
    drafts, _, state = program.propose(
        None, params, state, carry, keys, jnp.zeros(counts.shape, jnp.float32), k, False
    )
    return drafts, state.cache


def _chunks(
    behind: dict[int, list[int]], num_slots: int, width: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The (tokens[S, width], counts[S]) of each call that feeds the slots their missing
    tokens in order, ``width`` at most per call and slot (one program shape)."""
    longest = max((len(t) for t in behind.values()), default=0)
    for start in range(0, longest, width):
        tokens = np.zeros((num_slots, width), np.int32)
        counts = np.zeros((num_slots,), np.int32)
        for slot, missing in behind.items():
            part = missing[start : start + width]
            tokens[slot, : len(part)] = part
            counts[slot] = len(part)
        yield tokens, counts


class _DeviceRows:
    """A device drafter's cache rows, one per engine slot, and the host's record of them.

    Each row's stream of inputs (a draft model's tokens; a head's entries, named by the
    token after each position) is fed in order; ``propose`` feeds a row what it misses (in
    calls of ``chunk``), then one call takes every row's last ``width`` pending inputs and
    chains K drafts. ``lengths`` mirrors the rows' lengths on the device: every call passes
    them, so a row that takes no part keeps its contents (its writes land past its end).
    Subclasses give the stream (``_pending``), the two programs (``_append``, ``_draft``) and
    what a proposal leaves in a row (``_record``).
    """

    width: int  # inputs a proposal call takes per row

    def __init__(self, num_slots: int, k: int, chunk: int, cache: Any):
        self.k = k
        self.chunk = chunk  # the width of the calls that feed a row what it is missing
        self.cache = cache
        self.lengths = np.zeros((num_slots,), np.int32)
        self.fed: list[Any] = [None] * num_slots  # per slot: what its row holds (a subclass's)

    def _pending(self, seq: SequenceState) -> tuple[int, list[int]]:
        """(the inputs of ``seq`` its row holds, the inputs still to feed)."""
        raise NotImplementedError

    def _append(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        """Feeds rows ``counts[s]`` inputs ``tokens[S, C]`` from their ``lengths``."""
        raise NotImplementedError

    def _draft(self, tokens: np.ndarray, counts: np.ndarray) -> jax.Array:
        """Feeds each row's pending inputs ``tokens[S, width]``; its k greedy drafts."""
        raise NotImplementedError

    def _record(self, seq: SequenceState, drafts: np.ndarray) -> None:
        """Notes what a proposal left in ``seq``'s row (and its length on the device)."""
        raise NotImplementedError

    def propose(self, rows: Sequence[tuple[SequenceState, int]]) -> None:
        """Sets each row's drafts (at most its room): one device call (after the calls that
        feed rows what they miss), then one read."""
        if not rows:
            return
        slots = self.lengths.shape[0]
        tokens = np.zeros((slots, self.width), np.int32)
        counts = np.zeros((slots,), np.int32)
        behind: dict[int, list[int]] = {}  # slot -> inputs to feed before the proposal
        for seq, _ in rows:
            known, pending = self._pending(seq)
            self.lengths[seq.slot] = known
            if len(pending) > self.width:
                behind[seq.slot], pending = pending[:-1], pending[-1:]
            counts[seq.slot] = len(pending)
            tokens[seq.slot, : len(pending)] = pending
        for chunk, fed in _chunks(behind, slots, self.chunk):
            self._append(chunk, fed)
            self.lengths += fed
        drafts = np.asarray(self._draft(tokens, counts))
        for seq, room in rows:
            seq.drafts = drafts[seq.slot, :room].tolist()
            self._record(seq, drafts[seq.slot])

    def warm(self) -> None:
        """Compiles and runs both programs once on rows out of use."""
        slots = self.lengths.shape[0]
        self._append(np.zeros((slots, self.chunk), np.int32), np.eye(1, slots, dtype=np.int32)[0])
        self._draft(np.zeros((slots, self.width), np.int32), np.zeros((slots,), np.int32))
        self.lengths[:] = 0
        self.fed = [None] * slots


@dataclass
class _Fed:
    """What a draft cache row holds: ``seq_id``'s first ``count`` tokens, then ``drafts``."""

    seq_id: int
    count: int
    drafts: list[int] = field(default_factory=list)


class ModelRows(_DeviceRows):
    """A draft model's greedy drafts for the engine's rows, from a cache row per slot: its
    inputs are the sequence's tokens; a proposal feeds the last one or two (the token the
    last step kept beside its drafts) and K - 1 of its drafts."""

    width = 2

    def __init__(
        self, drafter: DraftModelDrafter, vocab_size: int, num_slots: int, max_len: int, k: int,
        chunk: int,
    ):  # fmt: skip
        draft = drafter.model
        if draft.config.vocab_size != vocab_size:
            raise ValueError(
                f"the draft model's vocabulary has {draft.config.vocab_size} tokens and the "
                f"target's {vocab_size}; a draft model must share the target's tokenizer."
            )
        # K - 1 drafts past the longest sequence; writes past a row's end are dropped.
        cache = commit_cache(draft.runner.init_state(num_slots, max_len + k), draft.mesh)
        super().__init__(num_slots, k, chunk, cache)
        self.program = drafter.program
        self.params = draft.runner.params

    def _pending(self, seq: SequenceState) -> tuple[int, list[int]]:
        """The row holds the sequence's tokens up to its last proposal and the drafts it fed
        then that the sequence kept; never the last token (a proposal's first input)."""
        fed, tokens = self.fed[seq.slot], seq.tokens
        known = 0
        if fed is not None and fed.seq_id == seq.id:
            known = fed.count
            for draft in fed.drafts:
                if known >= len(tokens) or tokens[known] != draft:
                    break
                known += 1
        known = min(known, len(tokens) - 1)
        return known, tokens[known:]

    def _append(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        self.cache = _append(
            self.program.verify_fn, self.params, self.cache, upload(tokens), upload(counts),
            upload(self.lengths),
        )  # fmt: skip

    def _draft(self, tokens: np.ndarray, counts: np.ndarray) -> jax.Array:
        drafts, self.cache = _propose(
            self.program, self.params, self.cache, upload(tokens), upload(counts),
            upload(self.lengths), self.k,
        )  # fmt: skip
        return drafts

    def _record(self, seq: SequenceState, drafts: np.ndarray) -> None:
        # The row now holds the sequence's tokens and K - 1 drafts (the last one the target
        # scores is never fed).
        count = seq.num_tokens
        self.fed[seq.slot] = _Fed(seq.id, count, drafts[: self.k - 1].tolist())
        self.lengths[seq.slot] = count + self.k - 1


def _gather_hidden(hidden_rows: jax.Array, starts: jax.Array, width: int) -> jax.Array:
    """[S, width, D]: each slot's target states from position ``starts[s]`` on."""
    positions = starts[:, None] + jnp.arange(width)[None, :]
    return jnp.take_along_axis(hidden_rows, positions[:, :, None], axis=1, mode="clip")


@partial(jax.jit, static_argnames=("program",), donate_argnames=("cache",))
def _append_head(program: HeadDrafts, target_params, params, cache, hidden_rows, tokens, counts,
                 lengths):  # fmt: skip
    """Feeds the head the entries of positions lengths[s] .. + counts[s] (the target's state
    there and tokens[S, C], the token after each)."""
    hidden = _gather_hidden(hidden_rows, lengths, tokens.shape[1])
    _, _, cache = program.run(
        target_params, params, tokens, hidden, counts, cache.with_lengths(lengths)
    )
    return cache


@partial(jax.jit, static_argnames=("program", "k"), donate_argnames=("cache",))
def _propose_head(program: HeadDrafts, target_params, params, cache, hidden_rows, tokens,
                  counts, lengths, k: int):  # fmt: skip
    """Each active row's k greedy drafts (int32[S, k]) after feeding its ``counts[s]`` pending
    entries (positions lengths[s] on, their next tokens ``tokens[S, W]``); count 0: left be."""
    hidden = _gather_hidden(hidden_rows, lengths, tokens.shape[1])
    state = HeadState(cache.with_lengths(lengths), tokens, hidden.astype(hidden_rows.dtype), counts)
    carry = Carry(None, tokens[:, 0], counts > 0, jnp.zeros_like(counts), None)
    keys = jnp.zeros((counts.shape[0], 2), jnp.uint32)  # greedy: no draw reads them
    drafts, _, state = program.propose(
        target_params, params, state, carry, keys, jnp.zeros(counts.shape, jnp.float32), k, False
    )
    return drafts, state.cache


class HeadRows(_DeviceRows):
    """A draft head's greedy drafts for the engine's rows, from a head cache row per slot:
    its inputs are the entries of the computed positions p (the target's state there, read
    from the executor, and the token at p + 1, the input named here); a proposal feeds those
    computed since the last (at most K + 1), then chains the head K - 1 times."""

    def __init__(
        self, drafter: HeadDrafter, target: Any, executor: PagedExecutor, max_len: int, k: int,
        chunk: int,
    ):  # fmt: skip
        if executor.hidden_rows is None:
            raise ValueError("a draft head needs an executor that keeps its hidden states.")
        self.program = drafter.program
        num_slots = executor.num_slots
        cache = draft_head.init_cache(self.program.config, num_slots, max_len + k + 1, target.dtype)
        # Beside the target's hidden states (on its devices).
        super().__init__(num_slots, k, chunk, commit(cache, executor.mesh))
        self.width = k + 1
        self.params = drafter.head_params
        self.target_params = target.runner.params
        self.executor = executor

    def _pending(self, seq: SequenceState) -> tuple[int, list[int]]:
        """Positions 0 .. len - 2 are computed; the row holds the true entries up to its last
        proposal (the chained ones after them are never kept)."""
        fed, ids = self.fed[seq.slot], seq.tokens  # (sequence id, true entries)
        known = fed[1] if fed is not None and fed[0] == seq.id else 0
        return known, ids[known + 1 :]

    def _append(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        self.cache = _append_head(
            self.program, self.target_params, self.params, self.cache,
            self.executor.hidden_rows, upload(tokens), upload(counts), upload(self.lengths),
        )  # fmt: skip

    def _draft(self, tokens: np.ndarray, counts: np.ndarray) -> jax.Array:
        drafts, self.cache = _propose_head(
            self.program, self.target_params, self.params, self.cache,
            self.executor.hidden_rows, upload(tokens), upload(counts), upload(self.lengths),
            self.k,
        )  # fmt: skip
        return drafts

    def _record(self, seq: SequenceState, drafts: np.ndarray) -> None:
        count = seq.num_tokens
        self.fed[seq.slot] = (seq.id, count - 1)
        self.lengths[seq.slot] = count - 1 + self.k - 1
