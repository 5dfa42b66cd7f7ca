"""The serving engine's scheduling policy alone: plain Python, no model, no device.

Arrivals admitted first come, first served by free slots and pages; finishes freeing them;
the newest sequence preempted on page exhaustion and recomputed with its tokens kept; chunked
prefill within the ladders and the B*T budget; the dense (encoder-decoder) policy.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from spark_jax.serving.pages import BlockTable, PageAllocator
from spark_jax.serving.scheduler import (
    ChunkBudget,
    Scheduler,
    SequenceState,
    StepPlan,
    pow2_ladder,
    ragged_ladder,
)


def paged(
    slots=4, pages=8, page_size=4, max_batch_tokens=64, chunk_low=16, rows=4, caching=False,
    max_num_batched_tokens=None, mixed=False,
) -> Scheduler:  # fmt: skip
    """``mixed``: ragged batches that the decode rows ride in (else [B, T] ones)."""
    ladder = (ragged_ladder if mixed else pow2_ladder)(chunk_low, max_batch_tokens)
    budget = ChunkBudget(max_batch_tokens, ladder, ragged=mixed, mixed=mixed)
    top = max(1, min(rows, max_batch_tokens // chunk_low))
    pool = PageAllocator(pages, enable_prefix_caching=caching)
    return Scheduler(slots, pow2_ladder(1, top), pool, page_size, budget, max_num_batched_tokens)


def seq(i: int, prompt_len: int) -> SequenceState:
    return SequenceState(i, list(range(prompt_len)))


def run_step(s: Scheduler) -> StepPlan:
    """One step as the engine runs it: plan, (device), advance, then one token read back per
    sampled row."""
    plan = s.plan()
    s.advance(plan)
    for row in plan.samples:
        row.in_flight -= 1
        row.generated.append(7)
    return plan


def test_the_policy_modules_import_no_jax():
    for module in ("spark_jax.serving.scheduler", "spark_jax.serving.pages"):
        tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [n for n in names if n and n.split(".")[0] in ("jax", "flax")], module


def test_arrivals_are_admitted_first_come_first_served_by_free_slots_and_pages():
    s = paged(slots=2, pages=8, page_size=4)
    a, b, c = seq(0, 10), seq(1, 3), seq(2, 3)  # a needs 3 pages, b and c one each
    for x in (a, b, c):
        s.add(x)
    plan = s.plan()
    assert [r.seq for r in plan.prefill] == [a, b]  # two slots: c waits
    assert [r.length for r in plan.prefill] == [10, 3] and plan.prefill_len == 16
    assert plan.prefill_rows == 2 and not plan.decode
    assert s.pages_in_use == 4 and s.slots_in_use == 2 and list(s.waiting) == [c]
    assert a.admitted < b.admitted


def test_a_head_of_queue_too_big_for_the_free_pages_blocks_those_behind_it():
    s = paged(slots=4, pages=4, page_size=4)
    big, small = seq(0, 13), seq(1, 2)  # big needs 4 pages
    s.add(seq(9, 2))
    run_step(s)  # one page taken
    s.add(big)
    s.add(small)
    plan = s.plan()
    assert not plan.prefill and list(s.waiting) == [big, small]  # FCFS: small does not jump


def test_finishes_free_their_slot_and_pages_for_the_next_arrival():
    s = paged(slots=1, pages=2, page_size=4)
    a, b = seq(0, 8), seq(1, 8)
    s.add(a)
    s.add(b)
    run_step(s)
    assert s.slots_in_use == 1 and list(s.waiting) == [b]
    s.release(a)  # finished
    assert s.slots_in_use == 0 and s.pages_in_use == 0
    plan = s.plan()
    assert [r.seq for r in plan.prefill] == [b] and b.slot == 0


def test_decode_rows_are_oldest_first_and_get_a_page_on_a_boundary():
    s = paged(slots=2, pages=8, page_size=4)
    a, b = seq(0, 4), seq(1, 3)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled and sampled
    assert len(a.pages) == 1 and len(b.pages) == 1
    plan = run_step(s)
    assert plan.decode == [a, b]
    assert len(a.pages) == 2 and len(b.pages) == 1  # a's 5th key starts a page, b's 4th not
    assert a.num_computed == 5 and b.num_computed == 4


def test_a_multi_step_decode_reserves_every_rows_keys_and_stops_each_at_its_max_new():
    s = paged(slots=2, pages=8, page_size=4)
    a, b = seq(0, 4), seq(1, 3)
    b.max_new = 3
    for x in (a, b):
        s.add(x)
    run_step(s)  # both prefilled and sampled (one token each)
    plan = s.plan()
    assert not s.extend(plan, 1) and plan.num_steps == 1  # one step is no extension
    assert s.extend(plan, 4)
    assert plan.num_steps == 4 and plan.decode_steps == [4, 2]  # b: 2 tokens to its max_new
    assert len(a.pages) == 2 and len(b.pages) == 2  # a's keys 4-7, b's keys 3-4
    s.advance(plan)
    assert (a.num_computed, a.in_flight) == (8, 4) and (b.num_computed, b.in_flight) == (5, 2)


def test_a_multi_step_decode_needs_free_pages_and_no_foreseen_finish_while_one_waits():
    s = paged(slots=2, pages=3, page_size=4)
    a, b = seq(0, 4), seq(1, 4)
    for x in (a, b):
        s.add(x)
    run_step(s)  # two pages held, one free
    plan = s.plan()  # a and b both cross into a page: one is preempted
    assert plan.preempted and not s.extend(plan, 4)
    s = paged(slots=1, pages=8, page_size=4)
    a, c = seq(0, 2), seq(1, 2)
    a.max_new = 3
    s.add(a)
    run_step(s)
    s.add(c)  # waits for a's slot, which a frees two tokens from now
    plan = s.plan()
    assert not s.extend(plan, 4) and plan.decode_steps == [] and len(a.pages) == 1
    a.max_new = 10
    assert s.extend(plan, 4)  # no finish foreseen: the call goes on


def test_page_exhaustion_preempts_the_newest_which_is_recomputed_with_its_tokens():
    s = paged(slots=2, pages=2, page_size=4)
    old, new = seq(0, 4), seq(1, 4)
    s.add(old)
    s.add(new)
    run_step(s)  # each holds its one page; both sampled a token
    plan = s.plan()  # both cross a boundary: no page is free, so the newest goes
    assert plan.preempted == [new] and plan.decode == [old]
    assert not plan.prefill  # a step that preempted admits nobody
    assert new.slot is None and new.pages == [] and new.num_computed == 0
    assert list(s.waiting) == [new] and new.generated == [7]  # its output is kept
    assert s.num_preemptions == 1 and new.num_preemptions == 1
    s.advance(plan)
    s.release(old)  # finished
    plan = s.plan()
    assert [(r.seq, r.start, r.length) for r in plan.prefill] == [(new, 0, 5)]
    assert new.prefill_target == 5 and new.tokens == [0, 1, 2, 3, 7]  # prompt + output


def test_a_sequence_preempted_by_an_older_one_in_the_same_step_does_not_decode():
    s = paged(slots=3, pages=3, page_size=2)
    a, b, c = seq(0, 2), seq(1, 2), seq(2, 2)
    for x in (a, b, c):
        s.add(x)
    run_step(s)
    plan = s.plan()  # a takes c's page; b then finds none and preempts itself
    assert plan.decode == [a] and plan.preempted == [c, b]
    assert list(s.waiting) == [b, c]  # both back at the head of the queue


def test_chunked_prefill_respects_the_ladders_and_the_token_budget():
    s = paged(slots=4, pages=64, page_size=4, max_batch_tokens=64, chunk_low=16, rows=4)
    long, short = seq(0, 80), seq(1, 5)
    s.add(long)
    s.add(short)
    plan = s.plan()
    # Alone, long takes 64; a second row would halve the cap (2 rows x 32), which long's
    # chunk already passes, so short waits.
    assert [(r.seq, r.length) for r in plan.prefill] == [(long, 64)]
    assert (plan.prefill_rows, plan.prefill_len) == (1, 64)
    s.advance(plan)
    plan = s.plan()  # long's last 16 fit beside a second row: short is admitted
    assert [(r.seq, r.start, r.length) for r in plan.prefill] == [(long, 64, 16), (short, 0, 5)]
    assert (plan.prefill_rows, plan.prefill_len) == (2, 16)
    assert plan.samples == [long, short]
    s.advance(plan)
    for x in (long, short):
        x.generated.append(7)
    s.add(big := seq(2, 50))
    plan = s.plan()  # two decode rows, then big's first chunk: one row alone, so 50
    assert plan.decode == [long, short] and [(r.seq, r.length) for r in plan.prefill] == [(big, 50)]
    assert (plan.prefill_rows, plan.prefill_len) == (1, 64)
    s.add(mid := seq(3, 40))
    s.advance(plan)
    plan = s.plan()
    assert [r.seq for r in plan.prefill] == [mid] and plan.prefill[0].length == 40
    for shape in s.prefill_shapes():
        assert shape[0] * shape[1] <= 64
    assert (plan.prefill_rows, plan.prefill_len) in s.prefill_shapes()


def test_a_ragged_budget_bounds_real_tokens_and_pads_only_their_total():
    """Ragged batches: rows join while real tokens remain in the budget (a long prompt takes
    what is left, as a chunk), every batch has the row ladder's top of rows, and only the
    total is padded, to a rung of the ragged ladder."""
    budget = ChunkBudget(64, ragged_ladder(16, 64), ragged=True)
    s = Scheduler(4, pow2_ladder(1, 4), PageAllocator(64), 4, budget)
    assert ragged_ladder(16, 64) == [16, 24, 32, 40, 48, 56, 64]
    assert s.prefill_shapes() == [(4, t) for t in ragged_ladder(16, 64)]
    a, b, c = seq(0, 20), seq(1, 30), seq(2, 50)
    for x in (a, b, c):
        s.add(x)
    plan = s.plan()  # 20 + 30, then c takes the 14 left (a [B, T] batch took a and b only)
    rows = lambda plan: [(r.seq, r.start, r.length) for r in plan.prefill]  # noqa: E731
    assert rows(plan) == [(a, 0, 20), (b, 0, 30), (c, 0, 14)]
    assert (plan.prefill_rows, plan.prefill_len) == (4, 64)
    run_step(s)
    plan = s.plan()  # c's rest, 36 tokens: padded to 40, not to a power of two
    assert plan.decode == [a, b] and rows(plan) == [(c, 14, 36)]
    assert (plan.prefill_rows, plan.prefill_len) == (4, 40)


def test_a_mixed_budget_counts_the_decode_rows_riding_in_the_batch():
    """Mixed batches: a step's decode rows ride in its ragged batch, so they take a token each
    of the budget and of the padded total."""
    budget = ChunkBudget(64, ragged_ladder(16, 64), ragged=True, mixed=True)
    s = Scheduler(4, pow2_ladder(1, 4), PageAllocator(64), 4, budget)
    a, b, c = seq(0, 20), seq(1, 30), seq(2, 70)
    for x in (a, b):
        s.add(x)
    plan = s.plan()  # no decode row yet: the whole budget
    rows = lambda plan: [(r.seq, r.start, r.length) for r in plan.prefill]  # noqa: E731
    assert rows(plan) == [(a, 0, 20), (b, 0, 30)] and plan.prefill_len == 56
    run_step(s)
    s.add(c)
    plan = s.plan()  # a and b decode: c gets 64 - 2 tokens, the total 64
    assert plan.decode == [a, b] and rows(plan) == [(c, 0, 62)]
    assert (plan.prefill_rows, plan.prefill_len) == (4, 64)
    run_step(s)
    plan = s.plan()  # c's last 8 tokens beside a's and b's decode rows: 10, padded to 16
    assert plan.decode == [a, b] and rows(plan) == [(c, 62, 8)] and plan.prefill_len == 16


def test_the_row_ladder_caps_the_rows_of_one_prefill():
    s = paged(slots=8, pages=64, page_size=4, max_batch_tokens=64, chunk_low=16, rows=2)
    for i in range(5):
        s.add(seq(i, 3))
    plan = s.plan()
    assert len(plan.prefill) == 2 and len(s.waiting) == 3


def test_abort_takes_a_sequence_out_wherever_it_is():
    s = paged(slots=1)
    a, b = seq(0, 3), seq(1, 3)
    s.add(a)
    s.add(b)
    run_step(s)
    s.remove(b)  # waiting
    s.remove(a)  # running
    assert not s.waiting and s.slots_in_use == 0 and s.pages_in_use == 0
    assert s.plan().empty


def test_the_dense_policy_prefills_whole_sources_and_never_preempts():
    s = Scheduler(3, pow2_ladder(1, 2))  # no pages, no chunks; 2 sources per step
    seqs = [seq(i, 30 + i) for i in range(4)]
    for x in seqs:
        s.add(x)
    plan = s.plan()
    assert [(r.seq, r.length) for r in plan.prefill] == [(seqs[0], 30), (seqs[1], 31)]
    assert plan.prefill_rows == 2 and plan.prefill_len == 0 and plan.samples == seqs[:2]
    run_step_after(s, plan)
    plan = run_step(s)
    assert plan.decode == seqs[:2] and [r.seq for r in plan.prefill] == [seqs[2]]
    for _ in range(50):  # long outputs never need pages
        plan = run_step(s)
        assert not plan.preempted and plan.decode == seqs[:3]
    assert s.pages_in_use == 0 and list(s.waiting) == [seqs[3]]
    assert s.prefill_shapes() == [(1, 0), (2, 0)]


def run_step_after(s: Scheduler, plan: StepPlan) -> None:
    s.advance(plan)
    for row in plan.samples:
        row.in_flight -= 1
        row.generated.append(7)


def test_a_page_pool_needs_a_page_size():
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(2, [1], PageAllocator(4))


def finish(s: Scheduler, x: SequenceState) -> None:
    s.release(x)
    s.pages.check()


# ------------------------------------------------------------------------- prefix caching


def test_a_prompt_starting_with_cached_pages_computes_only_the_rest():
    s = paged(slots=2, pages=16, page_size=4, caching=True)
    first = SequenceState(0, list(range(10)))
    s.add(first)
    run_step(s)  # 10 tokens: pages 0-1 full and registered, page 2 partial
    assert s.pages.num_cached == 2
    second = SequenceState(1, list(range(8)) + [50, 51, 52])  # shares the first 8 tokens
    s.add(second)
    plan = s.plan()
    assert [(r.seq, r.start, r.length) for r in plan.prefill] == [(second, 8, 3)]
    assert second.pages[:2] == first.pages[:2] and second.num_cached_tokens == 8
    assert all(s.pages.references(p) == 2 for p in first.pages[:2])
    assert s.pages.hit_rate == 0.5  # first found none of its 2 full pages, second both
    s.advance(plan)
    finish(s, first)
    finish(s, second)
    assert s.pages.in_use == 0 and s.pages.num_cached == 2


def test_a_prompt_wholly_cached_still_computes_its_last_token():
    s = paged(slots=2, pages=16, page_size=4, caching=True)
    s.add(a := SequenceState(0, list(range(8))))
    run_step(s)
    a_pages = list(a.pages)
    finish(s, a)
    s.add(b := SequenceState(1, list(range(8))))
    plan = s.plan()
    # Page 1 holds the last token, whose logits b samples: it is computed, in a page of b's.
    assert [(r.start, r.length) for r in plan.prefill] == [(4, 4)] and b.pages[0] == a_pages[0]
    assert b.pages[1] != a_pages[1]


def test_keys_depend_on_every_earlier_token_and_on_the_adapter():
    s = paged(slots=3, pages=24, page_size=4, caching=True)
    s.add(a := SequenceState(0, list(range(12)), cache_salt="fr"))
    run_step(s)
    s.add(other := SequenceState(1, list(range(12)), cache_salt="de"))  # another adapter
    s.add(shifted := SequenceState(2, [99] + list(range(1, 12)), cache_salt="fr"))
    plan = s.plan()
    assert [(r.seq, r.start) for r in plan.prefill] == [(other, 0), (shifted, 0)]
    assert not set(other.pages) & set(a.pages) and not set(shifted.pages) & set(a.pages)
    assert other.num_cached_tokens == shifted.num_cached_tokens == 0


def test_keys_made_page_by_page_as_a_sequence_grows_are_those_of_its_tokens_at_once():
    growing = SequenceState(0, list(range(9)), cache_salt="fr")
    first = growing.keys(2, 4)  # the prompt's full pages
    growing.generated += [40, 41, 42, 43, 44, 45, 46]  # decoded: 16 tokens, 4 full pages
    at_once = SequenceState(1, list(range(9)) + [40, 41, 42, 43, 44, 45, 46], cache_salt="fr")
    assert growing.keys(4, 4) == at_once.keys(4, 4) and growing.keys(4, 4)[:2] == first
    assert len(set(at_once.keys(4, 4))) == 4  # a page's key is its whole prefix's, not its own
    late = SequenceState(2, list(range(9)) + [40, 41, 42, 43, 44, 45, 47], cache_salt="fr")
    assert late.keys(4, 4)[:3] == at_once.keys(4, 4)[:3]  # the last token is in page 4 only
    assert late.keys(4, 4)[3] != at_once.keys(4, 4)[3]


def test_idle_cached_pages_are_evicted_least_recently_released_first():
    s = paged(slots=1, pages=4, page_size=4, caching=True)
    s.add(a := SequenceState(0, list(range(9))))  # 2 full pages + 1
    run_step(s)
    finish(s, a)
    assert s.pages.num_free == 4 and s.pages.num_cached == 2  # idle, still cached
    s.add(b := SequenceState(1, [70 + i for i in range(13)]))  # needs all 4 pages
    run_step(s)
    assert s.pages.num_cached == 3  # a's pages evicted, b's 3 full pages registered
    finish(s, b)
    s.add(c := SequenceState(2, list(range(9))))
    plan = s.plan()
    assert plan.prefill[0].seq is c and plan.prefill[0].start == 0  # a's pages are gone


def test_a_reset_prefix_cache_forgets_every_prefix_and_keeps_running_rows_pages():
    s = paged(slots=2, pages=16, page_size=4, caching=True)
    s.add(a := SequenceState(0, list(range(9))))
    s.add(b := SequenceState(1, [50 + i for i in range(9)]))
    run_step(s)
    finish(s, a)  # a's 2 full pages idle in the cache; b's held
    assert s.pages.num_cached == 4 and s.pages.in_use == 3
    held = list(b.pages)
    assert s.pages.reset_prefix_cache() == 4
    s.pages.check()
    assert s.pages.num_cached == 0 and s.pages.num_free == 13 and b.pages == held
    assert all(s.pages.references(p) == 1 for p in held)
    s.add(c := SequenceState(2, list(range(9))))  # a's prompt: computed again, whole
    plan = s.plan()
    assert [(r.seq, r.start, r.length) for r in plan.prefill] == [(c, 0, 9)]
    s.advance(plan)
    finish(s, b)
    finish(s, c)
    s.pages.check()
    assert s.pages.in_use == 0 and s.pages.num_cached == 2  # c's pages, registered anew


@pytest.mark.parametrize("mixed", [False, True])
def test_preemption_and_aborts_with_the_cache_leave_no_page_or_reference_behind(mixed):
    """2 000 requests over a pool that preempts, random aborts, the prefix cache on: every page
    and reference comes back, with [B, T] batches and with mixed ones."""
    rng = __import__("random").Random(0)
    s = paged(
        slots=4, pages=12, page_size=4, max_batch_tokens=32, chunk_low=16, caching=True,
        mixed=mixed,
    )  # fmt: skip
    prefixes = [list(range(100 * k, 100 * k + 8)) for k in range(3)]
    live: list[SequenceState] = []
    for i in range(2000):
        x = SequenceState(i, rng.choice(prefixes) + [rng.randrange(1000)] * rng.randint(1, 6))
        x.max_new = rng.randint(1, 12)
        s.add(x)
        live.append(x)
        run_step(s)
        for y in [y for y in live if y.slot is not None and len(y.generated) >= y.max_new]:
            s.release(y)  # finished
            live.remove(y)
        if rng.random() < 0.3 and live:
            s.remove(victim := rng.choice(live))  # aborted, waiting or running
            live.remove(victim)
        s.pages.check()
    assert s.num_preemptions > 0 and s.pages.hits > 0
    for y in live:
        s.remove(y)
    s.pages.check()
    assert s.pages.in_use == 0 and s.slots_in_use == 0
    assert all(s.pages.references(p) == 0 for p in range(12))


def test_the_step_budget_counts_decode_rows_before_prefill_chunks():
    s = paged(slots=4, pages=64, page_size=4, max_batch_tokens=64, chunk_low=16,
              max_num_batched_tokens=50)  # fmt: skip
    for i in range(2):
        s.add(seq(i, 3))
    run_step(s)  # two rows decode from now on
    s.add(long := seq(9, 60))
    plan = s.plan()
    # 50 - 2 decode rows = 48 tokens of prefill: the chunk ladder's 32 (16, 32, 64).
    assert len(plan.decode) == 2 and [(r.seq, r.length) for r in plan.prefill] == [(long, 32)]
    assert (plan.prefill_rows, plan.prefill_len) == (1, 32)


def test_the_block_table_follows_a_page_list_that_shrank_and_grew_between_syncs():
    """A speculative row gives back a rejected draft's page and takes another for its next
    drafts before the next sync: same count, other page. The table must name the new page,
    or the row's keys land in a page another row now owns."""
    table = BlockTable(num_slots=2, max_pages_per_seq=4, num_pages=9)
    x = seq(0, 8)
    x.slot, x.admitted, x.pages, x.num_computed = 1, 0, [3, 5], 8
    table.sync([x])
    assert table.pages[1].tolist() == [3, 5, 9, 9]
    x.pages = [3, 6]  # page 5 given back, page 6 taken
    table.sync([x])
    assert table.pages[1].tolist() == [3, 6, 9, 9]
    x.pages = [4]  # a shorter list that differs at its start
    table.sync([x])
    assert table.pages[1].tolist() == [4, 9, 9, 9] and table.pages[0].tolist() == [9] * 4
