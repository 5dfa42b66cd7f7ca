"""Speculative decoding inside the engine: the same outputs as without, fewer steps.

The contracts: greedy outputs (and their logprobs) equal the engine's without speculation
for every method (prompt lookup, a draft model, layer skip) and K, on one batch mixing
speculative rows, rows that opt out, stop ids, max_tokens and an abort; seeded sampled
outputs do not depend on the batch, and the deterministic drafts' rejection rule (prompt
lookup's, and a draft model's argmax) is the general rule with a one-hot q (whose
distribution tests/generation/test_speculative.py checks); a warmed engine never compiles;
no page leaks.
The scheduler's part (draft pages, roll back) is checked without JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CompileCounter, random_prompt

import spark_jax as sj
from spark_jax.generation.draft_training import HeadTraining, train_draft_head
from spark_jax.generation.speculative import rejection_sample
from spark_jax.models import draft_head
from spark_jax.serving.engine import Engine
from spark_jax.serving.pages import PageAllocator
from spark_jax.serving.scheduler import Scheduler, SequenceState

# One decode width, one block-table width and one prefill shape: few programs to compile.
SMALL = dict(
    max_num_seqs=8, max_batch_tokens=64, min_chunk=64, page_size=8, max_model_len=128,
    decode_widths=[8], min_decode_pages=16,
)  # fmt: skip


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def drafters(tiny_llama, reference) -> dict[str, dict]:
    """Each method's own speculative_config keys: a draft model (the target with its weights
    nudged: it agrees often, not always), a skipped layer, and a draft head trained briefly
    on the batch's greedy outputs (it drafts most of them right)."""
    _, model = tiny_llama
    noise = jax.random.key(7)

    def nudge(x):
        return x + 0.3 * jnp.std(x) * jax.random.normal(noise, x.shape, x.dtype)

    draft = sj.Model(model.config, jax.tree.map(nudge, model.params), model.tokenizer)
    prompts, _, _ = mixed_batch()
    sequences = [p + r.output_tokens for p, r in zip(prompts, reference, strict=True)]
    config = draft_head.head_config(model.config, intermediate_size=32, num_heads=2)
    training = HeadTraining(steps=100, batch_size=8, token_positions=64, learning_rate=5e-3)
    head = train_draft_head(model, sequences, [len(p) for p in prompts], config, training)
    return {
        "ngram": {},
        "draft": {"draft_model": draft},
        "layer-skip": {"skip_layers": [1]},
        "head": {"draft_head": (head.params, config)},
    }


def method(name: str, k: int, drafters: dict[str, dict]) -> dict:
    """The speculative_config of method ``name`` with K = ``k``."""
    return {"method": name, "num_speculative_tokens": k, **drafters[name]}


def mixed_batch() -> tuple[list[list[int]], list[sj.SamplingParams], list[bool]]:
    """Repetitive prompts (prompt lookup finds continuations) and plain random ones; greedy
    rows with and without stop ids, one with logprobs; every third request opts out."""
    prompts = [random_prompt(i, 6) * 4 for i in range(7)]
    prompts += [random_prompt(50 + i, 21) for i in range(3)]
    params = []
    for i in range(len(prompts)):
        extra = dict(ignore_eos=True) if i % 2 else dict(stop_token_ids=tuple(range(3, 128, 13)))
        if i == 4:
            extra["logprobs"] = 3
        params.append(sj.SamplingParams(temperature=0.0, max_tokens=9 + 3 * i, **extra))
    return prompts, params, [i % 3 != 2 for i in range(len(prompts))]


def drive(engine: Engine, prompts, params, speculative, abort: int | None = None):
    """Every request's result; request ``abort`` is aborted after the third step."""
    ids = [
        engine.add_request(p, sp, speculative=s)
        for p, sp, s in zip(prompts, params, speculative, strict=True)
    ]
    results, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.result
        steps += 1
        if steps == 3 and abort is not None:
            engine.abort(ids[abort])
    return [results[i] for i in ids]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """The batch's results from the engine without speculation."""
    _, model = tiny_llama
    prompts, params, speculative = mixed_batch()
    return drive(Engine(model, **SMALL), prompts, params, speculative)


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["ngram", "draft", "layer-skip", "head"])
def test_greedy_outputs_equal_the_engine_without_speculation(
    tiny_llama, drafters, reference, name, k
):
    _, model = tiny_llama
    engine = Engine(model, **SMALL, speculative_config=method(name, k, drafters))
    prompts, params, speculative = mixed_batch()
    aborted = 5
    results = drive(engine, prompts, params, speculative, abort=aborted)
    for i, (got, want) in enumerate(zip(results, reference, strict=True)):
        if i == aborted:
            assert got.finish_reason == "abort"
            assert got.output_tokens == want.output_tokens[: len(got.output_tokens)]
            continue
        assert got.output_tokens == want.output_tokens, i
        assert got.finish_reason == want.finish_reason
        if want.logprobs is not None:
            assert [lp.token_id for lp in got.logprobs] == got.output_tokens
            np.testing.assert_allclose(
                [lp.logprob for lp in got.logprobs], [lp.logprob for lp in want.logprobs],
                atol=1e-4,
            )  # fmt: skip
            assert [sorted(lp.top) for lp in got.logprobs] == [
                sorted(lp.top) for lp in want.logprobs
            ]
    metrics = engine.metrics()
    assert 0 < metrics.num_accepted_tokens <= metrics.num_draft_tokens
    assert metrics.pages_in_use == 0 and engine.slots_in_use == 0
    engine.scheduler.pages.check()


@pytest.mark.parametrize("name", ["ngram", "draft", "head"])
def test_preempted_speculative_rows_resume_with_the_same_outputs(
    tiny_llama, drafters, reference, name
):
    """A pool too small for the batch: rows are preempted (drafts never cause it) and
    recomputed, and every output is still the engine's without speculation. A draft model's
    (or head's) row is fed its sequence again in the slot it resumes in, 16 tokens a call."""
    _, model = tiny_llama
    small = SMALL | dict(min_chunk=16)
    config = method(name, 4, drafters)
    engine = Engine(model, **small, kv_pages=20, speculative_config=config)
    prompts, params, speculative = mixed_batch()
    results = drive(engine, prompts, params, speculative)
    assert engine.num_preemptions > 0
    assert [r.output_tokens for r in results] == [r.output_tokens for r in reference]
    assert engine.pages_in_use == 0
    engine.scheduler.pages.check()


@pytest.mark.parametrize("name", ["ngram", "layer-skip", "head"])
def test_a_warmed_speculative_engine_never_compiles_and_sampling_ignores_the_batch(
    tiny_llama, drafters, name
):
    """Greedy, seeded sampled (with penalties and top-p) and logprob rows after warm-up: no
    compile; each sampled request's output is the one it gets alone."""
    _, model = tiny_llama
    engine = Engine(
        model, max_num_seqs=4, max_batch_tokens=32, min_chunk=32, page_size=8,
        max_model_len=64, decode_widths=[4], speculative_config=method(name, 3, drafters),
    )  # fmt: skip
    engine.warmup(compile_threads=2)
    prompts = [random_prompt(i, 5) * 3 for i in range(6)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        sj.SamplingParams(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True),
        sj.SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.2, seed=2,
                          max_tokens=20, ignore_eos=True),
        sj.SamplingParams(temperature=0.0, logprobs=2, max_tokens=20),
        sj.SamplingParams(temperature=0.5, top_k=5, seed=3, max_tokens=20, logprobs=1),
        sj.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    ]  # fmt: skip
    with CompileCounter() as counter:
        together = engine.generate_many(prompts, params)
    assert counter.count == 0
    for i in (1, 2, 4):
        (alone,) = engine.generate_many([prompts[i]], [params[i]])
        assert alone.output_tokens == together[i].output_tokens
    assert engine.metrics().num_accepted_tokens > 0
    assert engine.pages_in_use == 0


def test_a_draft_head_in_the_engine_drafts_what_it_drafts_in_generate_speculative(
    tiny_llama, drafters
):
    """Each request alone: the engine's head (fed from the executor's kept hidden states)
    keeps exactly as many drafts as generate_speculative's head (fed from its dense verify
    steps), so it drafts the same tokens: a position off by one would draft others."""
    _, model = tiny_llama
    engine = Engine(model, **SMALL, speculative_config=method("head", 3, drafters))
    prompts, params, _ = mixed_batch()
    for i in (1, 3, 7, 9):
        before = engine.metrics().num_accepted_tokens
        (result,) = engine.generate_many([prompts[i]], [params[i]])
        alone = sj.generate_speculative(
            model, prompts[i], params[i], 3, "head", head=drafters["head"]["draft_head"]
        )
        assert result.output_tokens == alone.output_tokens
        assert engine.metrics().num_accepted_tokens - before == alone.spec_stats["num_accepted"]
        assert alone.spec_stats["num_accepted"] > 0


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_adapted_rows_verify_with_their_adapter(tiny_llama, tmp_path_factory, name):
    """LoRA with speculation: a batch of rows under two adapters and the base gives the
    engine's outputs without speculation (the target's adapter applies when verifying; a
    draft model drafts without it)."""
    from helpers import add_peft_adapters, model_from_hf

    hf, base = tiny_llama
    adapted = model_from_hf(hf)
    adapted.enable_lora(max_adapters=2, max_rank=4)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    add_peft_adapters(adapted, hf, {"a": lora, "b": lora}, tmp_path_factory)
    prompts = [random_prompt(300 + i, 6) * 3 for i in range(6)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, adapter=adapter)
        for adapter in ["a", None, "b", "a", "b", None]
    ]
    small = SMALL | dict(max_num_seqs=4, decode_widths=[4])
    want = Engine(adapted, **small).generate_many(prompts, params)
    plain = [dataclasses.replace(p, adapter=None) for p in params]
    assert [r.output_tokens for r in want] != [
        r.output_tokens for r in Engine(adapted, **small).generate_many(prompts, plain)
    ]  # the adapters matter
    config = method(name, 3, {"ngram": {}, "draft": {"draft_model": base}})
    engine = Engine(adapted, **small, speculative_config=config)
    got = engine.generate_many(prompts, params)
    assert [r.output_tokens for r in got] == [r.output_tokens for r in want]
    assert engine.metrics().num_accepted_tokens > 0


def test_deterministic_drafts_are_judged_as_drafts_of_a_one_hot_q():
    """q None (prompt lookup's drafts) gives the very draws of the general rule with q
    one-hot, whose output distribution is the target's (the chi-square test of
    test_speculative.py)."""
    vocab, k = 7, 3
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (k + 1, vocab)) * 2, axis=-1)
    drafts = jnp.asarray([2, 5, 2], jnp.int32)
    one_hot = jax.nn.one_hot(drafts, vocab)
    keys = jax.random.split(jax.random.key(1), 256)
    judge = jax.jit(jax.vmap(rejection_sample, in_axes=(None, None, None, None, 0)))
    for m in range(k + 1):
        plain = judge(probs, drafts, None, jnp.int32(m), keys)
        general = judge(probs, drafts, one_hot, jnp.int32(m), keys)
        np.testing.assert_array_equal(plain[0], general[0])
        np.testing.assert_array_equal(plain[1], general[1])


def test_speculative_config_mistakes_name_what_is_valid(tiny_llama):
    _, model = tiny_llama
    cases = [
        ({"method": "nope", "num_speculative_tokens": 2}, "'ngram', 'draft', 'layer-skip', 'head'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "'prompt_lookup_max'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "do not apply"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "min_ngram"),
        ({"method": "draft", "num_speculative_tokens": 2}, "needs draft_model"),
        ({"method": "layer-skip", "num_speculative_tokens": 2}, "needs skip_layers"),
        ({"method": "layer-skip", "num_speculative_tokens": 2, "skip_layers": [5]}, "outside"),
        ({"method": "head", "num_speculative_tokens": 2}, "needs draft_head"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            Engine(model, **SMALL, speculative_config=config)
    other = sj.Model(
        dataclasses.replace(model.config, vocab_size=64),
        {
            **model.params,
            "embed_tokens": {"embedding": model.params["embed_tokens"]["embedding"][:64]},
        },
    )
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        Engine(
            model, **SMALL, speculative_config=method("draft", 2, {"draft": {"draft_model": other}})
        )


# ------------------------------------------------------------------------------ the policy


def _decoding(scheduler: Scheduler, prompt_len: int, ids=(0,)) -> list[SequenceState]:
    seqs = [SequenceState(i, list(range(prompt_len)), max_new=100, speculative=True) for i in ids]
    for seq in seqs:
        scheduler.add(seq)
    scheduler.advance(scheduler.plan())
    for seq in seqs:
        seq.generated.append(1)
        seq.in_flight = 0
    return seqs


def test_drafts_get_pages_while_free_and_give_them_back_when_rejected():
    pool = PageAllocator(4)
    scheduler = Scheduler(2, [1, 2], pool, page_size=4)
    (seq,) = _decoding(scheduler, 7)  # 7 keys: 2 pages, the next key at position 7
    seq.drafts = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    plan = scheduler.plan()
    assert plan.decode == [seq] and not plan.preempted
    assert len(seq.pages) == 4 and seq.drafts == [1, 2, 3, 4, 5, 6, 7, 8]  # cut to 16 keys
    scheduler.advance(plan)
    assert seq.num_computed == 8 and seq.drafts == []
    scheduler.accept(seq, 2)  # keys 0..9 kept; the next at 10: three pages
    assert seq.num_computed == 10 and len(seq.pages) == 3 and pool.num_free == 1
    pool.check()


def test_drafts_never_preempt_an_other_row():
    pool = PageAllocator(4)
    scheduler = Scheduler(2, [1, 2], pool, page_size=4)
    old, new = _decoding(scheduler, 3, ids=(0, 1))  # a page each, next keys at position 3
    old.drafts, new.drafts = list(range(10)), [5, 6]
    plan = scheduler.plan()
    assert plan.decode == [old, new] and not plan.preempted
    assert len(old.pages) == 3 and old.drafts == list(range(8))  # the two free pages
    assert len(new.pages) == 1 and new.drafts == []
