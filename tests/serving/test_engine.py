"""The batching engine's contracts: batch invariance, no leaks, preemption, bounded compiles.

One warmed engine (16 slots, 128-token prefill batches, 16-token pages) serves most tests, so
its compiles are paid once; the pool-exhaustion test builds a second, deliberately small one.
"""

from __future__ import annotations

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CompileCounter, random_prompt

import spark_jax as sj
from spark_jax.ops.kv_cache import PagedKVCache
from spark_jax.ops.sampling import SamplerBatch
from spark_jax.serving import engine as engine_module
from spark_jax.serving import executor as executor_module
from spark_jax.serving.engine import Engine
from spark_jax.serving.executor import SAMPLER_WIDTH, SlotPicker
from spark_jax.serving.pages import PageAllocator
from spark_jax.serving.scheduler import SequenceState
from spark_jax.serving.warmup import run_steps_again


def mixed_params(i: int, max_tokens: int) -> sj.SamplingParams:
    """Greedy and seeded sampling with every processor, by request index."""
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=1.0, seed=i),
        dict(temperature=0.7, top_p=0.9, seed=1000 + i),
        dict(temperature=1.2, top_k=20, repetition_penalty=1.3, seed=i),
        dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5),
        dict(temperature=0.9, min_p=0.05, seed=i, stop_token_ids=tuple(range(0, 128, 9))),
    ]
    return sj.SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)])


def solo(model: sj.Model, prompts, params) -> list[list[int]]:
    return [sj.generate(model, p, sp).output_tokens for p, sp in zip(prompts, params, strict=True)]


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    _, model = tiny_llama
    engine = Engine(model, max_num_seqs=16, max_batch_tokens=128, page_size=16)
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def invariance_run(engine):
    """64 requests, prompts of 1-300 tokens, mixed sampling, run after warm-up, compiles counted."""
    rng = np.random.RandomState(0)
    prompts = [random_prompt(100 + i, int(rng.randint(1, 301))) for i in range(64)]
    params = [mixed_params(i, int(rng.randint(1, 33))) for i in range(64)]
    with CompileCounter() as counter:
        results = engine.generate_many(prompts, params)
    return prompts, params, results, counter.count


# ------------------------------------------------------------------------------ the cache


def test_a_scrambled_paged_cache_gives_the_logits_of_one_prefill(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(3, 37)
    full = model.logits(ids)
    c = model.config
    kv = PagedKVCache.create(c.num_layers, 2, 16, 4, 12, c.num_kv_heads, c.head_dim, jnp.float32)
    table = np.full((2, 12), 16, np.int32)
    table[1, :10] = [9, 2, 14, 0, 7, 11, 3, 5, 12, 1]  # row 1 owns ten pages, out of order
    kv = kv.with_block_table(jnp.asarray(table))
    logits, kv = model.runner.prefill(kv, [1], [ids[:13]], continuing=True)
    logits, kv = model.runner.prefill(kv, [1], [ids[13:30]], continuing=True)
    np.testing.assert_allclose(np.asarray(logits[0]), full[29], atol=1e-5)
    for t in range(30, 37):
        tokens = jnp.asarray([0, ids[t]], jnp.int32)
        logits, kv = model.runner.decode(kv, tokens, jnp.asarray([False, True]))
        np.testing.assert_allclose(np.asarray(logits[1]), full[t], atol=1e-5)
    assert np.asarray(kv.lengths).tolist() == [0, 37]


def test_the_page_allocator_refuses_what_it_does_not_have():
    pages = PageAllocator(4)
    taken = pages.allocate(3)
    with pytest.raises(RuntimeError, match="1 are free"):
        pages.allocate(2)
    pages.free(taken)
    assert pages.in_use == 0 and sorted(pages.allocate(4)) == [0, 1, 2, 3]


def test_admitted_rows_sampler_state_is_built_on_the_device_as_the_host_would_build_it():
    """Counts of the output so far, the prompt's mask and the settings, for more sequences
    than one admission program takes (two programs), one of them preempted with output;
    the slots nobody joined keep their rows."""
    vocab, eos = 40, (3,)
    picker = SlotPicker(8, vocab, eos, max_admitted=2, max_len=200)
    rng = np.random.RandomState(0)
    seqs = []
    for i, (prompt_len, out_len) in enumerate([(5, 0), (70, 0), (1, 9), (130, 60)]):
        params = dataclasses.replace(mixed_params(i, 64), seed=i)  # the engine sets every seed
        seq = SequenceState(i, rng.randint(0, vocab, prompt_len).tolist(), params=params)
        seq.generated = rng.randint(0, vocab, out_len).tolist() + [vocab - 1] * (out_len > 0)
        seq.slot, seq.admitted = [6, 0, 3, 7][i], i
        seqs.append(seq)
    before = {slot: np.asarray(picker.counts[slot]) for slot in (1, 2, 4, 5)}
    slots = [None] * 8
    for seq in seqs:
        slots[seq.slot] = seq
    picker.sync(slots)
    counts, mask = np.asarray(picker.counts), np.asarray(picker.prompt_mask)
    settings = jax.tree.map(np.asarray, picker.settings)
    for seq in seqs:
        want_counts = np.bincount(seq.generated, minlength=vocab)
        np.testing.assert_array_equal(counts[seq.slot], want_counts)
        np.testing.assert_array_equal(mask[seq.slot], np.bincount(seq.prompt, minlength=vocab) > 0)
        row = SamplerBatch.from_params([seq.params], vocab, eos, min_width=SAMPLER_WIDTH)
        got = jax.tree.map(lambda x, slot=seq.slot: x[slot], settings.sampler)
        jax.tree.map(np.testing.assert_array_equal, got, jax.tree.map(lambda x: x[0], row))
        assert settings.max_tokens[seq.slot] == seq.params.max_tokens
    for slot, row in before.items():
        np.testing.assert_array_equal(counts[slot], row)


# ------------------------------------------------------------------------ the acceptance


def test_64_mixed_requests_give_the_tokens_each_gives_alone(tiny_llama, invariance_run):
    _, model = tiny_llama
    prompts, params, results, _ = invariance_run
    assert [r.output_tokens for r in results] == solo(model, prompts, params)
    assert {r.finish_reason for r in results} == {"length", "stop"}


def test_plain_greedy_picks_take_the_argmax_program_and_the_samplers_tokens(engine, monkeypatch):
    """Picks whose rows are all plain greedy run the rule's argmax form (``GREEDY_RULE``: no
    token counts read or written); the same requests asking for logprobs (not plain greedy:
    the whole sampler) give the same tokens."""
    calls = []
    pick = executor_module._pick_rows

    def spy(rule, *args):
        if rule == executor_module.GREEDY_RULE:
            calls.append(args[0].shape[0])
        return pick(rule, *args)

    monkeypatch.setattr(executor_module, "_pick_rows", spy)
    prompts = [random_prompt(700 + i, 5 + 23 * i) for i in range(6)]
    plain = sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with CompileCounter() as counter:
        argmax = engine.generate_many(prompts, [plain] * len(prompts))
        picked = len(calls)
        sampler = engine.generate_many(prompts, [dataclasses.replace(plain, logprobs=0)] * 6)
    assert counter.count == 0
    assert picked > 0 and len(calls) == picked  # the second run never took the argmax program
    assert [r.output_tokens for r in argmax] == [r.output_tokens for r in sampler]
    assert all(len(r.output_tokens) == 12 for r in argmax)


def test_a_warmed_engine_never_compiles_through_every_decode_width(engine, invariance_run):
    """...with its prefills' steps mixed: the decode rows riding in the prefill batches."""
    *_, compiles = invariance_run
    assert compiles == 0
    assert engine.executor.num_mixed_steps > 0
    assert set(engine.executor.decode_steps_by_width) == {1, 2, 4, 8, 16}


def test_the_warm_up_steps_run_again_build_nothing_and_change_no_output(engine, invariance_run):
    """On the GPU a warmed engine runs its warm-up steps once more, so their CUDA graphs are
    recorded before it serves (``warmup.run_steps_again``): a program built there would drop
    them all again, and the pass must leave the engine serving as before."""
    prompts, params, results, _ = invariance_run
    with CompileCounter() as counter:
        run_steps_again(engine.executor, engine.prefill_shapes(), engine.scheduler.row_ladder[-1])
    assert counter.count == 0
    again = engine.generate_many(prompts[:8], params[:8])
    assert [r.output_tokens for r in again] == [r.output_tokens for r in results[:8]]


@pytest.mark.parametrize("batches", ["padded", "ragged"])
def test_padded_and_ragged_prefill_give_the_same_tokens_and_never_compile_after_warmup(
    tiny_llama, invariance_run, batches
):
    """The invariance run's first 40 requests (the default engine's: ragged prefill batches
    with the decode rows riding in them) through an engine whose prefill batches are [B, T]
    or ragged with no decode row in them: the same tokens (each request's alone), no compile
    after warm-up, nothing leaked; ragged, every batch of the top row count and a total on
    the ladder it was given (``prefill_sizes``, not the default's eighths)."""
    _, model = tiny_llama
    prompts, params, results = (x[:40] for x in invariance_run[:3])
    sizes = (24, 40, 64, 88, 128)
    option = {"ragged_prefill": False} if batches == "padded" else {"mixed_batches": False}
    if batches == "ragged":
        option["prefill_sizes"] = sizes
    other = Engine(model, max_num_seqs=16, max_batch_tokens=128, page_size=16, **option)
    if batches == "ragged":
        assert other.prefill_shapes() == [(8, t) for t in sizes]
    other.warmup()
    shapes = []
    run = other.executor.run

    def spy(plan, slots, before_pick=None):
        if plan.prefill:
            real = sum(row.length for row in plan.prefill)
            shapes.append((plan.prefill_rows, plan.prefill_len, real))
        return run(plan, slots, before_pick)

    other.executor.run = spy
    with CompileCounter() as counter:
        got = other.generate_many(prompts, params)
    assert [r.output_tokens for r in got] == [r.output_tokens for r in results]
    assert counter.count == 0
    assert other.executor.num_mixed_steps == 0
    if batches == "ragged":
        assert shapes and all(rows == 8 and real <= n in sizes for rows, n, real in shapes)
        assert any(n - real < 16 < real for _, n, real in shapes)  # totals, not rows, padded
    assert other.pages_in_use == 0 and other.slots_in_use == 0


def test_the_decode_program_reads_its_inputs_at_the_same_addresses_every_step(engine, monkeypatch):
    """XLA keeps a program's kernels as a CUDA graph and re-records it whenever an argument
    moves (on an H100, 5.6 ms more host time a decode step at 32 layers): each step's decode
    inputs are written into the buffers the last step at that width used, admissions and
    prefills in between. The decode takes them all (donated) and hands them back, so the
    next step's write donates no buffer that a queued program still reads (on the H200 that
    made the host wait for the program)."""
    runner = engine.executor.runner
    decode, seen = runner.decode, {}

    def spy(state, tokens, active, **kwargs):
        arrays = (tokens, active, state.block_table, state.lengths)
        seen.setdefault(tokens.shape[0], []).append(
            tuple(a.unsafe_buffer_pointer() for a in arrays)
        )
        out = decode(state, tokens, active, **kwargs)
        assert all(a.is_deleted() for a in arrays)
        return out

    monkeypatch.setattr(runner, "decode", spy)
    params = sj.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ids = [engine.add_request(random_prompt(500 + i, 20 + i), params) for i in range(6)]
    for step in range(60):
        if step % 4 == 0 and step < 40:  # one more request every few steps: 6 -> 16 rows
            ids.append(engine.add_request(random_prompt(600 + step, 30), params))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert len(seen[8]) >= 5 and len(seen[16]) >= 5
    for width, steps in seen.items():  # the draining widths too
        assert len(set(steps)) == 1, f"width {width}: {len(set(steps))} address sets"


def test_the_prefill_program_reads_its_inputs_at_the_same_addresses_every_step(engine, monkeypatch):
    """The ragged prefill's inputs too (its decode rows' and every slot's last token among
    them) are written into the buffers the last prefill of its shape used, taken by the
    program and handed back: a step of each shape dispatches one address set (a shape: the
    total, and whether decode rows ride, as they do in a prefill beside running rows)."""
    runner = engine.executor.runner
    prefill, seen = runner.prefill_held, {}

    def spy(state, *inputs, **kwargs):
        arrays = (*(x for x in inputs if x is not None), state.block_table, state.lengths)
        shape = (inputs[0].shape[0], inputs[3] is not None)
        seen.setdefault(shape, []).append(tuple(a.unsafe_buffer_pointer() for a in arrays))
        out = prefill(state, *inputs, **kwargs)
        assert all(a.is_deleted() for a in arrays)
        return out

    monkeypatch.setattr(runner, "prefill_held", spy)
    params = sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i in range(12):  # a 20-token prompt a step beside the running rows: 32-token totals
        engine.add_request(random_prompt(800 + i, 20), params)
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert len(seen[32, True]) >= 6
    assert len(seen[32, False]) == 1  # the first, onto an idle engine: no row rides
    for shape, steps in seen.items():
        assert len(set(steps)) == 1, f"{shape}: {len(set(steps))} address sets"


def multi_step_params(i: int, max_tokens: int) -> sj.SamplingParams:
    """Settings a multi-step decode takes (no top-k / top-p / top logprobs), by index; every
    seventh request asks for top-p, so the steps that hold it run one step at a time."""
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=1.0, seed=i, logprobs=0),
        dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=3),
        dict(temperature=0.9, min_p=0.05, seed=i, stop_token_ids=tuple(range(0, 128, 9))),
        dict(temperature=1.2, repetition_penalty=1.3, seed=i),
        dict(temperature=0.0, stop_token_ids=tuple(range(5, 128, 11))),
        dict(temperature=0.7, top_p=0.9, seed=1000 + i),
    ]
    return sj.SamplingParams(max_tokens=max_tokens, **kinds[i % len(kinds)])


def test_multi_step_decode_gives_each_request_its_tokens_alone_and_frees_every_page(
    tiny_llama, monkeypatch
):
    """Four decode steps per device call where the rows allow it, over a page pool small
    enough to preempt: every request's tokens (and logprob) as alone, stops inside a call
    dropped, nothing compiled after warm-up, every page and slot given back. Each call's
    inputs lie where the last call of its shape left them, taken and handed back by the
    call (as the decode's: see the test above)."""
    _, model = tiny_llama
    chunk, seen = executor_module._decode_chunk, {}

    def spy(fn, rule, num_steps, params, state, rows, *args):
        arrays = (*rows, state.block_table, state.lengths)
        seen.setdefault(state.block_table.shape, []).append(
            tuple(a.unsafe_buffer_pointer() for a in arrays)
        )
        out = chunk(fn, rule, num_steps, params, state, rows, *args)
        assert all(a.is_deleted() for a in arrays)
        return out

    spy.lower = chunk.lower  # warm-up compiles the program itself
    monkeypatch.setattr(executor_module, "_decode_chunk", spy)
    # max_model_len: the longest request (99 + 40 tokens) with room, not the model's 512: two
    # block-table widths to warm up instead of three. Two decode widths, not four (every width
    # is the other engine's test): half the multi-step programs to warm up.
    engine = Engine(
        model, max_num_seqs=8, max_batch_tokens=64, kv_pages=40, num_scheduler_steps=4,
        max_model_len=160, decode_widths=[1, 8],
    )  # fmt: skip
    engine.warmup()
    rng = np.random.RandomState(3)
    prompts = [random_prompt(300 + i, int(rng.randint(1, 100))) for i in range(40)]
    params = [multi_step_params(i, int(rng.randint(1, 41))) for i in range(40)]
    with CompileCounter() as counter:
        results = engine.generate_many(prompts, params)
    assert counter.count == 0
    alone = [sj.generate(model, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [r.output_tokens for r in results] == [r.output_tokens for r in alone]
    assert {r.finish_reason for r in results} == {"length", "stop"}
    for ours, ref in zip(results, alone, strict=True):
        if ref.logprobs:
            got = [lp.logprob for lp in ours.logprobs]
            assert got == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-5)
    assert engine.executor.num_multi_step_calls > 0 and engine.num_preemptions > 0
    assert sum(map(len, seen.values())) > 10  # warm-up's calls and the run's
    for shape, calls in seen.items():
        assert len(set(calls)) == 1, f"shape {shape}: {len(set(calls))} address sets"
    assert engine.pages_in_use == 0 and engine.slots_in_use == 0
    # Requests whose stop id (inside a call) is the last token of a page, then prompts that go
    # on from their outputs: the prefix cache hands these the pages the first ones left, the
    # stop id's page included, whose keys must be those of the tokens they name.
    stops = sj.SamplingParams(
        temperature=0.0, stop_token_ids=tuple(range(5, 128, 11)), min_tokens=20, max_tokens=40
    )
    candidates = [random_prompt(500 + i, 14 + i % 16) for i in range(120)]
    ends = sj.generate_batch(model, candidates, stops)  # one batch: each row's own result
    prompts = [
        p
        for p, r in zip(candidates, ends, strict=True)
        if r.finish_reason == "stop" and (len(p) + len(r.output_tokens)) % 16 == 0
    ][:4]
    assert len(prompts) == 4
    first = engine.generate_many(prompts, stops)
    assert [r.output_tokens for r in first] == solo(model, prompts, [stops] * 4)
    again = [p + r.output_tokens + [i] for i, (p, r) in enumerate(zip(prompts, first, strict=True))]
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with CompileCounter() as counter:
        continued = engine.generate_many(again, greedy)
    assert counter.count == 0
    assert all(
        r.timings["cached_tokens"] == len(p) - 1 for p, r in zip(again, continued, strict=True)
    )
    assert [r.output_tokens for r in continued] == solo(model, again, [greedy] * len(again))
    assert engine.pages_in_use == 0
    engine.scheduler.pages.check()


def system_prompt_requests(n: int, seed: int):
    """``n`` requests: one of 3 system prompts (40 tokens: 2 full pages of 16) + a question."""
    rng = np.random.RandomState(seed)
    systems = [random_prompt(600 + k, 40) for k in range(3)]
    prompts = [
        systems[rng.randint(3)] + random_prompt(700 + i, int(rng.randint(1, 20))) for i in range(n)
    ]
    return prompts, [mixed_params(i, int(rng.randint(1, 9))) for i in range(n)]


def test_200_requests_sharing_system_prompts_give_the_tokens_they_give_uncached(tiny_llama):
    _, model = tiny_llama
    prompts, params = system_prompt_requests(200, seed=5)
    runs, metrics = {}, {}
    # The default engine (mixed batches) with the cache on and off, and a [B, T] one with it.
    engines = {}
    for caching, ragged in ((True, True), (False, True), ("padded", False)):
        eng = engines[caching] = Engine(
            model,
            max_num_seqs=8,
            max_batch_tokens=64,
            enable_prefix_caching=bool(caching),
            ragged_prefill=ragged,
        )
        runs[caching] = eng.generate_many(prompts, params)
        assert eng.pages_in_use == 0 and eng.slots_in_use == 0
        eng.scheduler.pages.check()
        metrics[caching] = eng.metrics()
    assert [r.output_tokens for r in runs[True]] == [r.output_tokens for r in runs[False]]
    assert [r.output_tokens for r in runs["padded"]] == [r.output_tokens for r in runs[False]]
    on, off = metrics[True], metrics[False]
    assert on.prefix_cache_hit_rate > 0.5 and off.prefix_cache_hit_rate is None
    per_request = sum(r.timings["cached_tokens"] for r in runs[True])
    assert on.cached_prompt_tokens == per_request > 0 and off.cached_prompt_tokens == 0
    assert on.prompt_tokens + on.cached_prompt_tokens == off.prompt_tokens
    # Emptied, the cache gives the next requests nothing: they compute their whole prompts.
    assert engines[False].reset_prefix_cache() is False  # nothing to empty
    assert engines[True].reset_prefix_cache() is True
    again = engines[True].generate_many(prompts[:6], params[:6])
    assert [r.timings["cached_tokens"] for r in again][0] == 0
    assert engines[True].metrics().cached_prompt_tokens > on.cached_prompt_tokens  # the rest
    assert [r.output_tokens for r in again] == [r.output_tokens for r in runs[True][:6]]


# -------------------------------------------------------------------------------- the APIs


def test_streamed_deltas_add_up_to_each_final_result(engine):
    ids = [engine.add_request(random_prompt(i, 5 + i), mixed_params(i, 6)) for i in range(5)]
    streamed: dict[int, list[int]] = {i: [] for i in ids}
    finals = {}
    for out in engine.run():
        streamed[out.request_id] += out.new_token_ids
        if out.finished:
            finals[out.request_id] = out.result.output_tokens
    assert streamed == finals and set(finals) == set(ids)


def test_async_streams_run_together_and_closing_one_aborts_it(engine):
    async def consume(prompt, params, keep: int | None):
        tokens = []
        stream = engine.stream(prompt, params)
        async for out in stream:
            tokens += out.new_token_ids
            if keep is not None and len(tokens) >= keep:
                await stream.aclose()
                break
        return tokens

    async def main():
        params = sj.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        return await asyncio.gather(
            consume(random_prompt(1, 7), params, None), consume(random_prompt(2, 9), params, 3)
        )

    full, cut = asyncio.run(main())
    assert len(full) == 10 and len(cut) == 3
    assert engine.slots_in_use == 0 and engine.pages_in_use == 0


def test_a_failed_step_ends_every_request_with_error_and_frees_everything(engine, monkeypatch):
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("device lost")

    for i in range(3):
        engine.add_request(random_prompt(i, 4), sj.SamplingParams(max_tokens=4, seed=i))
    monkeypatch.setattr(engine, "runner", Broken())
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    assert engine.slots_in_use == 0 and engine.pages_in_use == 0
    outputs = engine.step()
    assert [o.result.finish_reason for o in outputs] == ["error"] * 3


def test_requests_that_can_never_run_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    vocab = engine.model.config.vocab_size
    for bad in (dict(logit_bias={vocab: 1.0}), dict(stop_token_ids=(vocab + 3,))):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request([1, 2], sj.SamplingParams(**bad))
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request([1] * 500, sj.SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside"):
        engine.generate_many([[1, 2], [1, 999]])
    assert not engine.has_unfinished()


def test_options_of_the_other_model_kind_and_beam_requests_are_refused(engine, tiny_llama):
    _, model = tiny_llama
    with pytest.raises(ValueError, match="max_source_len, max_num_beams do not apply"):
        Engine(model, max_source_len=8, max_num_beams=2)
    with pytest.raises(ValueError, match="beam search needs an encoder-decoder"):
        engine.add_beam_request(sj.BeamRequest([1, 2, 3]))
    assert not engine.has_unfinished()


def test_logprobs_through_the_engine_equal_those_of_generate(engine, tiny_llama):
    _, model = tiny_llama
    prompts = [random_prompt(900 + i, 5 + 9 * i) for i in range(3)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
        sj.SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=5, ignore_eos=True),
        sj.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    results = engine.generate_many(prompts, params)
    for prompt, p, result in zip(prompts, params, results, strict=True):
        alone = sj.generate(model, prompt, p)
        assert result.output_tokens == alone.output_tokens
        if p.logprobs is None:
            assert not result.logprobs
            continue
        assert [lp.token_id for lp in result.logprobs] == alone.output_tokens
        for ours, ref in zip(result.logprobs, alone.logprobs, strict=True):
            assert ours.logprob == pytest.approx(ref.logprob, abs=1e-5)
            assert list(ours.top) == list(ref.top)


def test_per_request_adapters_through_the_engine_equal_their_solo_results(tmp_path):
    import copy

    import torch
    from helpers import HF_BUILDERS, model_from_hf
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    hf = HF_BUILDERS["llama_tied"]().eval()
    model = model_from_hf(hf)
    model.enable_lora(max_adapters=2, max_rank=4)
    for seed, name in enumerate(["a", "b"]):
        torch.manual_seed(seed)
        config = LoraConfig(
            r=4,
            lora_alpha=8,
            init_lora_weights=False,
            target_modules=["q_proj", "v_proj", "down_proj"],
        )
        get_peft_model(copy.deepcopy(hf), config).save_pretrained(tmp_path / name)
        model.add_adapter(name, tmp_path / name)
    prompts = [random_prompt(950 + i, 4 + 6 * i) for i in range(4)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, adapter=name)
        for name in ["a", None, "b", "a"]
    ]
    # A mixed batch (the default) gives each token its row's adapter, a riding decode row's
    # too; a [B, T] one its rows'.
    padded = Engine(model, max_num_seqs=4, max_batch_tokens=64, page_size=16, ragged_prefill=False)
    padded_results = padded.generate_many(prompts, params)
    engine = Engine(model, max_num_seqs=4, max_batch_tokens=64, page_size=16)
    results = engine.generate_many(prompts, params)
    assert [r.output_tokens for r in results] == solo(model, prompts, params)
    assert [r.output_tokens for r in padded_results] == [r.output_tokens for r in results]
    base = [dataclasses.replace(p, adapter=None) for p in params]
    assert solo(model, prompts, base) != [r.output_tokens for r in results]  # adapters act
    assert engine.slots_in_use == 0 and engine.pages_in_use == 0
    # One 40-token prompt (2 full pages) under each adapter in turn: an adapter's second
    # request finds its own pages, never another adapter's (nor the base's).
    shared = random_prompt(990, 40)
    cached = []
    for name in ["a", "b", None, "a", None]:
        p = sj.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, adapter=name)
        (result,) = engine.generate_many([shared], p)
        assert result.output_tokens == sj.generate(model, shared, p).output_tokens
        cached.append(result.timings["cached_tokens"])
    assert cached == [0, 0, 0, 32, 32]


def test_an_engine_over_device_committed_weights_never_compiles_after_warmup(tiny_llama):
    """Weights restored from a checkpoint sit committed to a device; the step outputs (and the
    sampler state they feed) then are too, which warm-up must have compiled for."""
    _, model = tiny_llama
    params = jax.device_put(model.params, jax.devices()[0])
    committed = sj.Model(model.config, params, model.tokenizer, model.generation_config)
    engine = Engine(committed, max_num_seqs=4, max_batch_tokens=32, page_size=16, max_model_len=64)
    engine.warmup()
    with CompileCounter() as counter:
        engine.generate_many([random_prompt(7, 20), random_prompt(8, 5)], mixed_params(0, 4))
    assert counter.count == 0


def test_gpu_memory_utilization_needs_a_device_that_reports_its_memory(tiny_llama):
    if jax.devices()[0].memory_stats():
        pytest.skip("this device reports its memory (tests/test_gpu_paths.py covers it)")
    with pytest.raises(ValueError, match="pass kv_pages instead"):
        Engine(tiny_llama[1], max_num_seqs=4, gpu_memory_utilization=0.9)


def test_gpu_memory_utilization_counts_an_fp8_caches_pages_at_a_byte_a_value(
    tiny_llama, monkeypatch
):
    # A device that reports 64 MB, 10 of them in use: the pool fills half of it less the
    # weights and a step's working memory, and an fp8 cache's pages take a byte a key or
    # value where a float one's take the model's dtype (fp32 here: 4).
    model = tiny_llama[1]
    stats = {"bytes_limit": 64 << 20, "bytes_in_use": 10 << 20}
    monkeypatch.setattr(engine_module, "device_memory_stats", lambda: stats)
    sizes = {}
    for cache in ("auto", "fp8"):
        m = sj.Model(model.config, model.params, kv_cache_dtype=cache)
        engine = Engine(m, max_num_seqs=4, max_model_len=64, gpu_memory_utilization=0.5)
        pages = engine.scheduler.pages.num_pages
        assert pages % 4 == 0 and engine.executor.num_pages == pages
        assert engine.executor.state.nbytes <= (0.5 * 64 - 10) * 2**20
        sizes[cache] = pages
    wide = np.dtype(model.dtype).itemsize
    assert 0.95 * wide < sizes["fp8"] / sizes["auto"] <= 1.05 * wide


def test_a_step_budget_or_decode_widths_that_cannot_work_are_refused(tiny_llama):
    model = tiny_llama[1]
    with pytest.raises(ValueError, match="max_num_batched_tokens=20 leaves no room"):
        Engine(model, max_num_seqs=8, max_num_batched_tokens=20)
    with pytest.raises(ValueError, match="decode_widths must be positive and end at"):
        Engine(model, max_num_seqs=8, decode_widths=[1, 4])
    with pytest.raises(ValueError, match="prefill_sizes must be positive and end at"):
        Engine(model, max_num_seqs=8, max_batch_tokens=64, prefill_sizes=[16, 48])
    # Mixed batches where they do not apply: asked for, refused; by default, left off.
    with pytest.raises(ValueError, match="max_batch_tokens=32 leaves no room"):
        Engine(model, max_num_seqs=32, max_batch_tokens=32, mixed_batches=True)
    assert not Engine(model, max_num_seqs=32, max_batch_tokens=32).executor.mixed
    with pytest.raises(ValueError, match="leave ragged_prefill on"):
        Engine(model, max_num_seqs=8, ragged_prefill=False, mixed_batches=True)
    head = {"method": "head", "num_speculative_tokens": 2, "draft_head": "unused.npz"}
    with pytest.raises(ValueError, match="does not combine with a draft head"):
        Engine(model, max_num_seqs=8, mixed_batches=True, speculative_config=head)
