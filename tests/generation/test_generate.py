"""The engine's contracts: KV consistency, batch independence, bounded compilation, slots."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_prompt

import spark_jax as sj
from spark_jax.generation import generate as engine
from spark_jax.generation import step
from spark_jax.models import decoder

GREEDY = sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_prefill_then_decode_gives_the_logits_of_one_prefill(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(7, 30)
    full = model.logits(ids)
    runner = model.runner
    for split in (1, 11, 29):
        state = runner.init_state(2, 64)
        logits, state = runner.prefill(state, [1], [ids[:split]])
        np.testing.assert_allclose(np.asarray(logits[0]), full[split - 1], rtol=0, atol=1e-5)
        for t in range(split, 30):
            tokens = jnp.asarray([0, ids[t]], jnp.int32)
            logits, state = runner.decode(state, tokens, jnp.asarray([False, True]))
            np.testing.assert_allclose(np.asarray(logits[1]), full[t], rtol=0, atol=1e-5)
        assert np.asarray(state.lengths).tolist() == [0, 30]


def test_chunked_prefill_appends_to_a_row(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(8, 40)
    full = model.logits(ids)
    state = model.runner.init_state(1, 64)
    _, state = model.runner.prefill(state, [0], [ids[:17]])
    logits, state = model.runner.prefill(state, [0], [ids[17:]], continuing=True)
    np.testing.assert_allclose(np.asarray(logits[0]), full[-1], rtol=0, atol=1e-5)


def test_verify_scores_every_position_and_rollback_is_lowering_a_length(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(9, 20)
    full = model.logits(ids)
    runner = model.runner
    state = runner.init_state(1, 64)
    _, state = runner.prefill(state, [0], [ids[:10]])
    draft = [ids[10], ids[11], 5, 6]  # two right tokens, two wrong ones
    logits, state = runner.verify(state, jnp.asarray([draft]), jnp.asarray([4]))
    np.testing.assert_allclose(np.asarray(logits[0, :2]), full[10:12], atol=1e-5)
    state = state.with_lengths(jnp.asarray([12]))  # reject the two wrong drafts
    logits, state = runner.decode(state, jnp.asarray([ids[12]]), jnp.asarray([True]))
    np.testing.assert_allclose(np.asarray(logits[0]), full[12], atol=1e-5)


def test_rows_of_a_batch_are_independent_sequences(tiny_llama):
    _, model = tiny_llama
    prompts = [random_prompt(10, 3), random_prompt(11, 37), random_prompt(12, 16)]
    alone = [sj.generate(model, p, GREEDY).output_tokens for p in prompts]
    together = sj.generate_batch(model, prompts, GREEDY)
    assert [r.output_tokens for r in together] == alone
    mixed = [GREEDY, sj.SamplingParams(temperature=0.0, max_tokens=3), GREEDY]
    short = sj.generate_batch(model, prompts, mixed)
    assert short[1].output_tokens == alone[1][:3] and short[1].finish_reason == "length"
    assert short[0].output_tokens == alone[0]


def test_stop_token_ends_generation_and_is_returned(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(13, 9)
    free = sj.generate(model, ids, GREEDY).output_tokens
    stop_at = free[4]
    first = free.index(stop_at)
    params = sj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at])
    result = sj.generate(model, ids, params)
    assert result.output_tokens == free[: first + 1]
    assert result.finish_reason == "stop" and result.stop_reason == stop_at


def test_model_eos_ids_stop_generation_unless_ignored(tiny_llama):
    hf, _ = tiny_llama
    from helpers import model_from_hf

    ids = random_prompt(14, 9)
    model = model_from_hf(hf)
    free = sj.generate(model, ids, GREEDY).output_tokens
    model.generation_config = {"eos_token_id": [free[2]]}
    eos_model = sj.Model(model.config, model.params, generation_config=model.generation_config)
    stopped = sj.generate(eos_model, ids, sj.SamplingParams(temperature=0.0, max_tokens=12))
    assert stopped.output_tokens == free[: free.index(free[2]) + 1]
    assert stopped.finish_reason == "stop"
    ignored = sj.generate(eos_model, ids, GREEDY)
    assert ignored.output_tokens == free


def test_a_batch_without_a_consumer_ends_every_row_as_the_streamed_batch_does(tiny_llama):
    # generate_batch with no on_token checks whole chunks in numpy; streaming goes token by
    # token. Stops land mid-chunk, on the first token, at min_tokens and at max_tokens.
    _, model = tiny_llama
    prompts = [random_prompt(40 + i, 5 + 3 * i) for i in range(6)]
    free = [r.output_tokens for r in sj.generate_batch(model, prompts, GREEDY)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[0][5]]),
        sj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[1][0]]),
        sj.SamplingParams(
            temperature=0.0, max_tokens=12, min_tokens=3, stop_token_ids=[free[2][0], free[2][4]]
        ),
        sj.SamplingParams(temperature=0.0, max_tokens=1),
        sj.SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[free[4][8]]),
        sj.SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
    ]
    streamed: list[sj.StreamOutput] = []
    batch = sj.generate_batch(model, prompts, params)
    stream = sj.generate_batch(model, prompts, params, on_token=streamed.append)
    summary = lambda rs: [(r.output_tokens, r.finish_reason, r.stop_reason) for r in rs]
    assert summary(batch) == summary(stream)
    first_stop = free[0].index(free[0][5])
    assert batch[0].output_tokens == free[0][: first_stop + 1]
    assert (len(batch[1].output_tokens), batch[1].finish_reason) == (1, "stop")
    assert len(batch[2].output_tokens) >= 3  # the first token is a stop id, held off
    assert (len(batch[3].output_tokens), batch[3].finish_reason) == (1, "length")
    assert batch[4].stop_reason == free[4][8] and len(batch[4].output_tokens) <= 9
    assert [e.token_id for e in streamed if e.index == 2] == stream[2].output_tokens
    assert [lp.token_id for lp in batch[5].logprobs] == batch[5].output_tokens
    assert batch[5].logprobs == stream[5].logprobs


def test_fixed_count_chunks_give_the_early_exit_chunks_results(tiny_llama):
    """``LoopOptions(exit_early=False)``: every chunk runs all its steps, rows that ended idle
    in it (stops mid-chunk, a stop on the first token, short max_tokens, a seeded sampled row)."""
    _, model = tiny_llama
    prompts = [random_prompt(60 + i, 4 + 3 * i) for i in range(5)]
    free = [r.output_tokens for r in sj.generate_batch(model, prompts, GREEDY)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[0][3]]),
        sj.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[free[1][0]]),
        sj.SamplingParams(temperature=0.0, max_tokens=2),
        sj.SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=11),
        sj.SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True),
    ]
    summary = lambda rs: [(r.output_tokens, r.finish_reason, r.logprobs) for r in rs]
    early = summary(sj.generate_batch(model, prompts, params))
    fixed = summary(
        sj.generate_batch(model, prompts, params, loop=sj.LoopOptions(exit_early=False))
    )
    assert fixed == early
    assert [len(tokens) for tokens, _, _ in fixed][:3] == [free[0].index(free[0][3]) + 1, 1, 2]


def test_streaming_callback_sees_every_token_in_order(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(15, 6)
    seen: list[int] = []
    result = sj.generate_streaming(model, ids, GREEDY, seen.append)
    assert seen == result.output_tokens and len(seen) == 12
    events = list(sj.stream(model, ids, GREEDY))
    assert [e.token_id for e in events[:-1]] == seen
    assert events[-1].output_tokens == seen


def test_slots_are_given_back_when_the_consumer_raises(tiny_llama):
    _, model = tiny_llama

    def explode(_token: int) -> None:
        raise RuntimeError("client went away")

    with pytest.raises(RuntimeError, match="client went away"):
        sj.generate_streaming(model, random_prompt(16, 5), GREEDY, explode)
    assert model.slot_pool.in_use == 0
    stream = sj.stream(model, random_prompt(16, 5), GREEDY)
    next(stream)
    assert model.slot_pool.in_use == 1
    stream.close()  # the consumer stops early
    assert model.slot_pool.in_use == 0


def test_prompts_of_twenty_lengths_compile_one_prefill_per_bucket_and_one_decode(tiny_llama):
    hf, _ = tiny_llama
    from helpers import model_from_hf

    model = model_from_hf(hf)
    decoder.prefill.clear_cache()
    step.chunk_loop.clear_cache()
    step.pick.clear_cache()
    lengths = list(range(1, 61, 3))  # 20 lengths over the buckets 16, 32, 64
    for n in lengths:
        sj.generate(model, random_prompt(n, n), sj.SamplingParams(temperature=0.0, max_tokens=4))
    buckets = {decoder.bucket(n) for n in lengths}
    assert decoder.prefill._cache_size() == len(buckets) == 3
    # The decode step runs inside the engine's device loop: one compile of the loop.
    assert step.chunk_loop._cache_size() == 1
    assert step.pick._cache_size() == 1


def test_bad_prompts_are_refused_before_any_device_work(tiny_llama):
    _, model = tiny_llama
    with pytest.raises(ValueError, match="empty"):
        sj.generate(model, [], GREEDY)
    with pytest.raises(ValueError, match="outside"):
        sj.generate(model, [1, 500], GREEDY)
    with pytest.raises(ValueError, match=r"\[-1\] outside"):
        sj.generate(model, np.array([3, -1]), GREEDY)
    with pytest.raises(ValueError, match=r"\[1267650600228229401496703205376\] outside"):
        sj.generate(model, [2, 2**100], GREEDY)  # past int64: said, not overflowed
    with pytest.raises(ValueError, match="positions"):
        sj.generate(model, [1] * 500, sj.SamplingParams(max_tokens=100))
    assert model.slot_pool.in_use == 0


def test_a_device_loop_that_retires_rows_early_fails_loudly_and_frees_slots(
    tiny_llama, monkeypatch
):
    _, model = tiny_llama
    real = step.run_chunk

    def retiring(*args, **kwargs):
        carry, chunk = real(*args, **kwargs)
        return carry, dataclasses.replace(chunk, valid=jnp.zeros_like(chunk.valid))

    monkeypatch.setattr(engine, "run_chunk", retiring)
    with pytest.raises(RuntimeError, match="bug"):
        sj.generate(model, random_prompt(17, 5), GREEDY)
    assert model.slot_pool.in_use == 0


@pytest.mark.parametrize("field", ["steps_per_sync", "prefill_tokens_per_call"])
def test_loop_options_refuse_a_count_below_one(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        sj.LoopOptions(**{field: 0})


def test_a_long_batch_is_prefilled_in_groups_of_rows_in_order():
    """``LoopOptions.prefill_tokens_per_call``: consecutive rows, each call within the budget of
    padded positions (at least one row), every row's adapter with it, logits in row order."""
    calls = []

    class Runner:
        def prefill(self, state, slots, prompts, requests, adapters=None):
            calls.append((list(slots), [len(p) for p in prompts], requests, adapters))
            return np.asarray(slots, np.float32)[:, None] * np.ones((1, 3)), state + 1

    prompts = [[1] * n for n in (5, 30, 7, 2, 9)]  # the longest pads to 32 positions
    plist = list("abcde")
    logits, state = engine._prefill_in_groups(
        Runner(), 0, prompts, plist, [4, 3, 2, 1, 0], max_tokens=64
    )
    assert [c[0] for c in calls] == [[0, 1], [2, 3], [4]]
    assert [c[2] for c in calls] == [["a", "b"], ["c", "d"], ["e"]]
    assert [c[3] for c in calls] == [[4, 3], [2, 1], [0]]
    assert state == 3 and np.asarray(logits)[:, 0].tolist() == [0, 1, 2, 3, 4]
    calls.clear()
    engine._prefill_in_groups(Runner(), 0, prompts, plist, None, max_tokens=10)
    assert [c[0] for c in calls] == [[0], [1], [2], [3], [4]] and calls[0][3] is None
