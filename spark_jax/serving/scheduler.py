"""The serving engine's scheduling policy: plain Python, no device work.

A ``Scheduler`` holds the waiting queue and the slots of the running sequences; each
``plan()`` turns them into one ``StepPlan``:

1. decode: every running sequence that holds its next input token, oldest admission first.
   With a page pool, a row whose next key starts a new page gets one; when none is free the
   newest running sequence is preempted (its slot and pages freed, back to the head of the
   queue, to be recomputed from prompt + generated tokens; its generated tokens are kept).
   A speculative row (its ``drafts`` set by the engine before ``plan``) also needs the keys
   of its drafts: it gets their pages while some are free, and its drafts are cut to the
   pages it got (drafts never preempt anyone), and to ``max_num_batched_tokens``.
2. prefill: sequences still reading their prompt advance by one chunk, then waiting
   sequences are admitted first come, first served, when a slot (and, with a pool, the pages
   of everything they must compute) is free. A step that preempted admits nobody.

With ``chunks`` (a ``ChunkBudget``) prompts are read in chunks that pack into one ``[B, T]``
batch (B on the row ladder, T on the chunk ladder) with ``B * T <= max_batch_tokens``, or,
ragged, one after another, at most ``max_batch_tokens`` real tokens in all (and,
with ``max_num_batched_tokens``, at most that many tokens in a step, decode rows included;
mixed, the decode rows ride in the ragged batch and count in its tokens);
without, each admitted prompt is read whole in the step that admits it, up to the row
ladder's top of them (an encoder-decoder's source: its encoder attends both ways). Without
a page pool nothing is ever preempted: an admitted sequence always finishes in its slot.

With a prefix-caching page pool (``PageAllocator(enable_prefix_caching=True)``), an admitted
sequence whose tokens start with cached full pages takes them and computes only the rest (at
least its last token, whose logits it samples); its own full pages are registered as their
keys get computed (``register_pages``).

``advance(plan)`` records what a step computed once it is dispatched (a speculative row: its
last token's key; ``accept`` adds its kept drafts once they are read, and gives back the
pages of the rejected ones: rolling back is lowering the computed length). The engine reads a
step's tokens after dispatching the next one, so a sequence may have tokens in flight
(``in_flight``): it is not decoded past its ``max_new`` tokens, and a preempted one is
re-admitted only once its tokens are all read.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_jax.serving.pages import PageAllocator, page_keys


def pow2_ladder(low: int, high: int) -> list[int]:
    """low, 2*low, ... up to high (high itself is the last rung even if not a power of two)."""
    rungs = [low]
    while rungs[-1] < high:
        rungs.append(min(rungs[-1] * 2, high))
    return rungs


def ragged_ladder(low: int, high: int) -> list[int]:
    """A ragged batch's token totals: ``pow2_ladder(low, high)`` and every eighth of
    ``high`` from ``low`` up (low 128, high 1024: 128, 256, 384, ... 1024)."""
    eighths = {k * high // 8 for k in range(1, 9) if k * high // 8 >= low}
    return sorted(set(pow2_ladder(low, high)) | eighths)


def rung(ladder: Sequence[int], n: int) -> int:
    """The lowest rung of ``ladder`` that holds ``n``."""
    return next(r for r in ladder if r >= n)


class SequenceState:
    """One request's place in the schedule: waiting -> running (prefilling, decoding) -> done.

    ``generated`` is the request's output token list (shared with its ``RequestState``, which
    appends to it); ``params``, ``adapter`` and ``guide`` (its ``guided.GuidedRow``, which the
    ``RequestState`` advances) ride along for the executor, the policy never reads them.
    """

    def __init__(
        self,
        seq_id: int,
        prompt: Sequence[int],
        generated: list[int] | None = None,
        params: Any = None,
        adapter: int = -1,
        max_new: int = 1 << 62,
        cache_salt: str | None = None,
        guide: Any = None,
        speculative: bool = False,
    ):
        self.id = seq_id
        self.prompt = list(prompt)
        self.generated = [] if generated is None else generated
        self.params = params
        self.adapter = adapter
        self.max_new = max_new  # tokens it generates at most
        self.cache_salt = cache_salt  # what else its keys depend on (the adapter's name)
        self.in_flight = 0  # tokens dispatched whose values the host has not read yet
        self.page_keys: list[bytes] = []  # prefix-cache keys of its full pages of tokens
        self.num_registered = 0  # its pages registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens its last admission found in the cache
        self.guide = guide  # the guided-decoding matcher (generation.guided), or None
        self.speculative = speculative  # the engine drafts for it
        self.drafts: list[int] = []  # this step's proposed tokens (set before plan)
        self.slot: int | None = None
        self.pages: list[int] = []
        self.num_computed = 0  # tokens whose keys are in the cache
        self.prefill_target = 0  # tokens to compute before the next sample (set on admission)
        self.admitted = -1  # admission number: the newest running sequence is preempted first
        self.num_preemptions = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        """``len(tokens)``, without building the list."""
        return len(self.prompt) + len(self.generated)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def num_scheduled(self) -> int:
        """Tokens generated or being generated."""
        return len(self.generated) + self.in_flight

    def keys(self, num_pages: int, page_size: int) -> list[bytes]:
        """The prefix-cache keys of its first ``num_pages`` pages (of tokens the host has)."""
        have = len(self.page_keys)
        if have < num_pages:
            parent = self.page_keys[-1] if have else None
            run = self.tokens[have * page_size : num_pages * page_size]
            self.page_keys += page_keys(parent, run, page_size, self.cache_salt)
        return self.page_keys[:num_pages]

    def __repr__(self) -> str:
        return f"SequenceState(id={self.id}, slot={self.slot}, computed={self.num_computed})"


@dataclass(frozen=True)
class PrefillRow:
    """One row of a step's prefill batch: ``length`` tokens of ``seq`` from ``start``."""

    seq: SequenceState
    start: int
    length: int

    @property
    def last(self) -> bool:
        """This chunk ends the sequence's prefill: its logits are sampled."""
        return self.start + self.length >= self.seq.prefill_target


@dataclass
class StepPlan:
    """One step: the decode rows, the prefill rows, and who was preempted to make room."""

    decode: list[SequenceState] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    preempted: list[SequenceState] = field(default_factory=list)
    prefill_rows: int = 0  # the prefill batch's rows, padded to the row ladder
    # Its chunk length, padded to the chunk ladder (0: whole prompts); a ragged batch's: its
    # rows' tokens in all, padded to the ladder.
    prefill_len: int = 0
    # A multi-step decode (``Scheduler.extend``): the steps of the device call, and the tokens
    # each decode row generates in it (fewer where its max_new comes first); empty: one each.
    num_steps: int = 1
    decode_steps: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    def steps_of(self, row: int) -> int:
        """The tokens decode row ``row`` generates in this step."""
        return self.decode_steps[row] if self.decode_steps else 1

    @property
    def samples(self) -> list[SequenceState]:
        """The rows that sample a token this step: the decode rows, then finished prefills."""
        return self.decode + [row.seq for row in self.prefill if row.last]


@dataclass(frozen=True)
class ChunkBudget:
    """Chunked prefill: chunks of ``chunk_ladder`` lengths, at most ``max_batch_tokens``
    padded tokens (rows x chunk) per prefill batch.

    ``ragged``: the batch is ragged (``decoder.prefill(ragged=True)``): its rows' chunks lie
    one after another, so ``max_batch_tokens`` bounds their real tokens, any chunk length
    fits, the batch always has the row ladder's top of rows, and only the total is padded,
    to the ladder's rung.

    ``mixed`` (ragged only): a step's decode rows ride in its prefill batch, a token each
    after the rows' (``decoder.prefill``'s ``decode_slots``), so they count in its tokens:
    the prefill rows get what they leave of ``max_batch_tokens``."""

    max_batch_tokens: int
    chunk_ladder: list[int]
    ragged: bool = False
    mixed: bool = False


class Scheduler:
    """Slots, the waiting queue and (optionally) a page pool; ``plan()`` makes each step.

    num_slots: cache rows. row_ladder: the prefill batch's padded row counts (its top: the
    most rows prefilled in one step). pages / page_size: the KV page pool, None for a dense
    cache (no pages, no preemption). chunks: chunked prefill's budget, None to read every
    prompt whole in the step that admits it.
    """

    def __init__(
        self,
        num_slots: int,
        row_ladder: list[int],
        pages: PageAllocator | None = None,
        page_size: int = 0,
        chunks: ChunkBudget | None = None,
        max_num_batched_tokens: int | None = None,
    ):
        if pages is not None and page_size < 1:
            raise ValueError("a page pool needs page_size >= 1.")
        self.num_slots = num_slots
        self.row_ladder = row_ladder
        self.pages = pages
        self.page_size = page_size
        self.chunks = chunks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.slots: list[SequenceState | None] = [None] * num_slots
        self.free_slots = list(range(num_slots))[::-1]
        self.waiting: deque[SequenceState] = deque()
        self.num_preemptions = 0
        self.num_prefilled_tokens = 0  # tokens computed by prefill chunks
        self.num_cached_tokens = 0  # tokens admissions found in the prefix cache
        self._admissions = 0

    # -- queries ----------------------------------------------------------------------------

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk) prefill batch a plan can form (chunk 0: whole prompts; a
        ragged batch: (the row ladder's top, its padded total of tokens))."""
        if self.chunks is None:
            return [(b, 0) for b in self.row_ladder]
        if self.chunks.ragged:
            return [(self.row_ladder[-1], t) for t in self.chunks.chunk_ladder]
        budget = self.chunks.max_batch_tokens
        return [
            (b, t) for b in self.row_ladder for t in self.chunks.chunk_ladder if b * t <= budget
        ]

    @property
    def slots_in_use(self) -> int:
        return self.num_slots - len(self.free_slots)

    @property
    def pages_in_use(self) -> int:
        return 0 if self.pages is None else self.pages.in_use

    def running(self) -> list[SequenceState]:
        """The sequences holding a slot, oldest admission first."""
        return sorted((s for s in self.slots if s is not None), key=lambda s: s.admitted)

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size) if self.pages is not None else 0

    # -- arrivals and departures ------------------------------------------------------------

    def add(self, seq: SequenceState) -> None:
        """Queues a new sequence at the back."""
        self.waiting.append(seq)

    def remove(self, seq: SequenceState) -> None:
        """Takes a sequence out wherever it is (abort): its slot and pages are freed."""
        if seq.slot is not None:
            self.release(seq)
        else:
            self.waiting.remove(seq)

    def release(self, seq: SequenceState) -> None:
        """Gives back the slot and pages of a sequence (finish, abort, preemption, error)."""
        assert seq.slot is not None
        if self.pages is not None:
            self.register_pages(seq)
            self.pages.free(seq.pages)
        self.slots[seq.slot] = None
        self.free_slots.append(seq.slot)
        seq.slot, seq.pages = None, []

    def clear(self) -> list[SequenceState]:
        """Releases every running sequence and empties the queue; returns the running ones."""
        running = self.running()
        for seq in running:
            self.release(seq)
        self.waiting.clear()
        return running

    # -- one step ---------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """This step's rows; admits and preempts as it goes (see the module docstring)."""
        plan = StepPlan()
        self._cut_drafts_to_budget()
        self._plan_decode(plan)
        budget = self.chunks.max_batch_tokens if self.chunks is not None else 0
        riding = len(plan.decode) if self.chunks is not None and self.chunks.mixed else 0
        budget -= riding
        if self.max_num_batched_tokens is not None:
            decoded = sum(1 + len(s.drafts) for s in plan.decode)
            budget = min(budget, self.max_num_batched_tokens - decoded)
        self._plan_prefill(plan, not plan.preempted, budget)
        if plan.prefill:
            plan.prefill_rows = rung(self.row_ladder, len(plan.prefill))
            if self.chunks is not None and self.chunks.ragged:
                plan.prefill_rows = self.row_ladder[-1]
                total = riding + sum(row.length for row in plan.prefill)
                plan.prefill_len = rung(self.chunks.chunk_ladder, total)
            elif self.chunks is not None:
                longest = max(row.length for row in plan.prefill)
                plan.prefill_len = rung(self.chunks.chunk_ladder, longest)
        return plan

    def advance(self, plan: StepPlan) -> None:
        """Records the keys a step puts in the cache and the tokens it samples, once it is
        dispatched; registers the prefilled pages in the prefix cache."""
        for i, seq in enumerate(plan.decode):
            # The last token (a multi-step decode: its tokens but the last); a speculative
            # row's drafts: ``accept``.
            seq.num_computed += plan.steps_of(i)
            seq.in_flight += plan.steps_of(i)
            seq.drafts = []
        for row in plan.prefill:
            row.seq.num_computed = row.start + row.length
            self.num_prefilled_tokens += row.length
            self.register_pages(row.seq)
            if row.last:
                row.seq.in_flight += 1

    def register_pages(self, seq: SequenceState) -> None:
        """Registers the full pages of ``seq`` whose keys are computed and whose tokens the
        host has (a decoded token is known one step after its keys are written)."""
        if self.pages is None or not self.pages.enable_prefix_caching:
            return
        full = min(seq.num_computed, len(seq.prompt) + len(seq.generated)) // self.page_size
        if full > seq.num_registered:
            keys = seq.keys(full, self.page_size)
            for j in range(seq.num_registered, full):
                self.pages.register(seq.pages[j], keys[j])
            seq.num_registered = full

    def accept(self, seq: SequenceState, num_accepted: int) -> None:
        """A read speculative step kept ``num_accepted`` drafts of ``seq``: their keys are
        computed; the pages past the next key (the rejected drafts') go back to the pool."""
        seq.num_computed += num_accepted
        if self.pages is not None and seq.slot is not None:
            keep = self.pages_for(seq.num_computed + 1)
            if len(seq.pages) > keep:
                self.pages.free(seq.pages[keep:])
                seq.pages = seq.pages[:keep]

    def extend(self, plan: StepPlan, num_steps: int) -> bool:
        """Makes a plan of decode rows only a multi-step decode of ``num_steps`` steps in one
        device call, when the pages of every row's keys are free: each row generates
        ``num_steps`` tokens, or fewer where its ``max_new`` comes first, and computes as
        many keys (a stop id inside the call does not stop its row: the host drops what
        follows, as it does a token decoded before the stop was read). False (the plan left
        as it was) when a row lacks pages, or when a finish this policy can foresee would
        keep a waiting sequence out of its slot for the rest of the call."""
        if not plan.decode or plan.prefill or plan.preempted or num_steps < 2:
            return False
        steps = [min(num_steps, s.max_new - s.num_scheduled) for s in plan.decode]
        if self.waiting and min(steps) < num_steps:
            return False
        if self.pages is not None:
            need = [
                max(0, self.pages_for(s.num_computed + n) - len(s.pages))
                for s, n in zip(plan.decode, steps, strict=True)
            ]
            if sum(need) > self.pages.num_free:
                return False
            for seq, n in zip(plan.decode, need, strict=True):
                seq.pages += self.pages.allocate(n)
        plan.num_steps, plan.decode_steps = num_steps, steps
        return True

    def _cut_drafts_to_budget(self) -> None:
        """Drafts, newest rows' first, cut so the decode rows leave a prefill chunk room
        within ``max_num_batched_tokens``."""
        rows = [s for s in self.running() if not s.prefilling and s.num_scheduled < s.max_new]
        if self.max_num_batched_tokens is None or not any(s.drafts for s in rows):
            return
        least = self.chunks.chunk_ladder[0] if self.chunks is not None else 0
        over = sum(1 + len(s.drafts) for s in rows) - (self.max_num_batched_tokens - least)
        for seq in reversed(rows):
            if over <= 0:
                return
            cut = min(over, len(seq.drafts))
            seq.drafts = seq.drafts[: len(seq.drafts) - cut]
            over -= cut

    def _plan_decode(self, plan: StepPlan) -> None:
        for seq in [s for s in self.running() if not s.prefilling]:
            if seq.slot is None:  # preempted for an older sequence in this loop
                continue
            if seq.num_scheduled >= seq.max_new:  # its last token is in flight
                seq.drafts = []
                continue
            if self.pages is not None and seq.num_computed // self.page_size >= len(seq.pages):
                while self.pages.num_free == 0 and seq.slot is not None:
                    plan.preempted.append(self._preempt(self.running()[-1]))
                if seq.slot is None:
                    continue
                seq.pages += self.pages.allocate(1)
            if seq.drafts and self.pages is not None:
                self._reserve_draft_pages(seq)
            plan.decode.append(seq)

    def _reserve_draft_pages(self, seq: SequenceState) -> None:
        """Pages for the keys of ``seq``'s drafts, while some are free; the drafts are cut to
        the positions its pages hold."""
        assert self.pages is not None
        need = self.pages_for(seq.num_computed + 1 + len(seq.drafts)) - len(seq.pages)
        seq.pages += self.pages.allocate(min(max(need, 0), self.pages.num_free))
        room = len(seq.pages) * self.page_size - seq.num_computed - 1
        seq.drafts = seq.drafts[:room]

    def _plan_prefill(self, plan: StepPlan, admit: bool, budget: int) -> None:
        rows = plan.prefill
        for seq in self.running():
            if seq.prefilling and not self._add_chunk(rows, seq, budget):
                return
        while admit and self.waiting and self.free_slots:
            seq = self.waiting[0]
            if seq.in_flight or not self._room(rows, budget):  # a preempted one's last token
                break
            cached = self._cached_pages(seq)
            if self.pages is not None:
                need = self.pages_for(seq.num_tokens) - len(cached)
                if need > self.pages.num_free - self.pages.idle_among(cached):
                    break
            self.waiting.popleft()
            self._admit(seq, cached)
            self._add_chunk(rows, seq, budget)

    def _cached_pages(self, seq: SequenceState) -> list[int]:
        """The pages of the prefix cache that ``seq`` can start with (never its last token's:
        that token is computed, for its logits)."""
        if self.pages is None or not self.pages.enable_prefix_caching:
            return []
        full = (seq.num_tokens - 1) // self.page_size
        return self.pages.cached_prefix(seq.keys(full, self.page_size))

    def _room(self, rows: list[PrefillRow], budget: int) -> int:
        """The longest chunk one more prefill row could take (0: no room this step), keeping
        rows x chunk (both padded to their ladders) within ``budget``."""
        n = len(rows) + 1
        if n > self.row_ladder[-1]:
            return 0
        if self.chunks is None:
            return 1 << 62  # a whole prompt
        if self.chunks.ragged:  # what the batch's real tokens leave of the budget
            return max(budget - sum(row.length for row in rows), 0)
        # The longest rung within the budget: a chunk is padded up to a rung.
        most = budget // rung(self.row_ladder, n)
        cap = max((t for t in self.chunks.chunk_ladder if t <= most), default=0)
        if not cap or any(row.length > cap for row in rows):
            return 0
        return cap

    def _add_chunk(self, rows: list[PrefillRow], seq: SequenceState, budget: int) -> bool:
        cap = self._room(rows, budget)
        if cap:
            start = seq.num_computed
            rows.append(PrefillRow(seq, start, min(seq.prefill_target - start, cap)))
        return bool(cap)

    def _admit(self, seq: SequenceState, cached: list[int]) -> None:
        seq.slot = self.free_slots.pop()
        # Everything it holds is computed again but what the prefix cache has: its prompt
        # and, after a preemption, its output.
        seq.prefill_target = len(seq.prompt) + len(seq.generated)
        seq.num_computed = seq.num_registered = 0
        if self.pages is not None:
            looked_up = (seq.prefill_target - 1) // self.page_size
            if self.pages.enable_prefix_caching:
                self.pages.acquire(cached, looked_up)
            fresh = self.pages.allocate(self.pages_for(seq.prefill_target) - len(cached))
            seq.pages = cached + fresh
            seq.num_computed = seq.num_registered = len(cached)
            seq.num_computed *= self.page_size
        seq.num_cached_tokens = seq.num_computed
        self.num_cached_tokens += seq.num_computed
        seq.admitted = self._admissions
        self._admissions += 1
        self.slots[seq.slot] = seq

    def _preempt(self, seq: SequenceState) -> SequenceState:
        self.release(seq)
        seq.drafts = []
        seq.num_computed = seq.prefill_target = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq
