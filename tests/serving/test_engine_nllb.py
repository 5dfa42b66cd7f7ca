"""``sj.Engine`` on NLLB: continuous batching of translations, batch-invariant, no leaks.

A tiny random M2M100 (``helpers``): requests with mixed target languages, greedy and
seeded sampling, different sources and output lengths, more than the engine's slots, give
exactly what each gives alone through ``sj.generate``; a warmed engine never compiles.
"""

from __future__ import annotations

import helpers
import numpy as np
import pytest
from helpers import CompileCounter

import spark_jax as sj
from spark_jax.model import Model
from spark_jax.serving.engine import Engine
from spark_jax.serving.executor import DenseExecutor
from spark_jax.serving.warmup import run_steps_again


@pytest.fixture(scope="module")
def model() -> Model:
    runner = helpers.ours(helpers.tiny_hf(encoder_layers=2, decoder_layers=2, seed=3))
    return Model(runner.config, runner.params, tokenizer=None, runner=runner)


@pytest.fixture(scope="module")
def engine(model) -> Engine:
    # Sources of up to 40 tokens: a source ladder to 64, not the model's 128 (fewer programs).
    engine = sj.Engine(
        model, max_num_seqs=6, max_model_len=32, max_prefill_seqs=4, max_num_beams=4,
        max_source_len=64,
    )  # fmt: skip
    engine.warmup()
    return engine


def _params(i: int) -> sj.SamplingParams:
    languages = ("fra_Latn", "deu_Latn", None)  # None: the runner's default (fra_Latn)
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=i),
        dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, seed=100 + i),
    ]
    max_tokens = int(np.random.RandomState(i).randint(1, 25))
    return sj.SamplingParams(max_tokens=max_tokens, tgt_lang=languages[i % 3], **kinds[i % 3])


def test_engine_on_an_encoder_decoder_model_drives_the_dense_cache(engine):
    assert isinstance(engine.executor, DenseExecutor) and engine.pages_in_use == 0
    with pytest.raises(ValueError, match="page_size does not apply to an encoder-decoder"):
        sj.Engine(engine.model, page_size=16)
    with pytest.raises(ValueError, match="prefix caching does not apply to an encoder-decoder"):
        sj.Engine(engine.model, enable_prefix_caching=True)
    assert not engine.enable_prefix_caching and engine.metrics().prefix_cache_hit_rate is None


def test_20_mixed_translations_give_what_each_gives_alone_and_never_compile(model, engine):
    sources = helpers.random_sources(seed=11, count=20, max_len=40)
    params = [_params(i) for i in range(20)]
    with CompileCounter() as counter:
        results = engine.generate_many(sources, params)
    alone = [sj.generate(model, s, p).output_tokens for s, p in zip(sources, params, strict=True)]
    assert [r.output_tokens for r in results] == alone
    assert counter.count == 0
    assert {r.finish_reason for r in results} == {"stop", "length"}
    assert engine.slots_in_use == 0 and not engine.has_unfinished()


def test_the_warm_up_steps_run_again_build_nothing_and_change_no_output(engine):
    """``warmup.run_steps_again`` (the engine runs it on the GPU, see its module) over the
    dense cache and the beam lane: no program built, the same translations after it."""
    sources = helpers.random_sources(seed=12, count=4, max_len=40)
    params = [_params(i) for i in range(4)]
    before = engine.generate_many(sources, params)
    with CompileCounter() as counter:
        run_steps_again(engine.executor, engine.prefill_shapes(), engine.scheduler.row_ladder[-1])
    assert counter.count == 0
    after = engine.generate_many(sources, params)
    assert [r.output_tokens for r in after] == [r.output_tokens for r in before]
    assert engine.slots_in_use == 0 and not engine.has_unfinished()


def test_aborted_translations_give_back_their_slots(engine):
    sources = helpers.random_sources(seed=12, count=10)
    ids = [engine.add_request(s, sj.SamplingParams(max_tokens=20)) for s in sources]
    outputs = engine.step()  # admits 4 (the prefill rows' top) and samples their first token
    aborted = [i for i in ids[::2] if engine.abort(i)]  # False for any that already ended
    outputs += list(engine.run())
    finished = {o.request_id: o.result for o in outputs if o.finished}
    assert sorted(finished) == ids
    assert len(aborted) >= 3
    assert all(finished[i].finish_reason == "abort" for i in aborted)
    assert engine.slots_in_use == 0 and not engine.has_unfinished()


def test_bad_translation_requests_are_refused_before_any_work(engine):
    source = helpers.random_sources(seed=13, count=1)[0]
    with pytest.raises(ValueError, match=r"unknown language code 'fra_latn'"):
        engine.add_request(source, sj.SamplingParams(tgt_lang="fra_latn"))
    with pytest.raises(ValueError, match="source is empty"):
        engine.add_request([], sj.SamplingParams())
    with pytest.raises(ValueError, match="max_model_len=32"):
        engine.add_request(source, sj.SamplingParams(max_tokens=31))
    assert not engine.has_unfinished()


def test_beam_and_greedy_requests_share_the_loop_and_match_their_solo_results(model, engine):
    """Beam searches (num_beams 1-4, mixed languages, lengths and stopping rules) submitted
    with greedy translations: each gives the hypotheses of ``sj.generate_beam`` of it alone
    (scores to 1e-5); no compiles."""
    sources = helpers.random_sources(seed=14, count=9, max_len=40)
    rules = [True, False, "never"]
    beams = [
        sj.BeamRequest(
            sources[i],
            tgt_lang=("fra_Latn", "deu_Latn")[i % 2],
            num_beams=1 + i % 4,
            max_new=6 + 3 * i,
            length_penalty=(0.6, 1.0, 1.3)[i % 3],
            early_stopping=rules[i % 3],
            num_return_sequences=1 + (i % 4) // 2,
        )
        for i in range(6)
    ]
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=12)
    with CompileCounter() as counter:
        ids = [engine.add_request(s, greedy) for s in sources[6:]]
        ids += [engine.add_beam_request(b) for b in beams]
        results = {o.request_id: o.result for o in engine.run() if o.finished}
    assert counter.count == 0
    alone = [sj.generate_beam(model, [b])[0] for b in beams]
    ours = [results[i] for i in ids[3:]]
    assert [r.sequences for r in ours] == [r.sequences for r in alone]
    # The lane's cache is longer than a solo call's: sums over masked keys may round apart.
    for mine, theirs in zip(ours, alone, strict=True):
        np.testing.assert_allclose(mine.scores, theirs.scores, rtol=1e-5)
    solo = [sj.generate(model, s, greedy).output_tokens for s in sources[6:]]
    assert [results[i].output_tokens for i in ids[:3]] == solo
    assert engine.slots_in_use == 0 and not engine.has_unfinished()


def test_an_aborted_beam_request_reports_abort_and_leaves_nothing_behind(engine):
    sources = helpers.random_sources(seed=15, count=3)
    ids = [engine.add_beam_request(sj.BeamRequest(s, num_beams=4, max_new=20)) for s in sources]
    assert engine.abort(ids[2])  # still waiting: leaves the queue
    outputs = engine.step()
    assert engine.abort(ids[0])  # searching: reported now, its search's result dropped
    outputs += list(engine.run())
    results = {o.request_id: o.result for o in outputs if o.finished}
    assert sorted(results) == sorted(ids)  # each reported once
    assert results[ids[0]].sequences == results[ids[2]].sequences == []
    assert results[ids[1]].sequences
    assert not engine.has_unfinished() and not engine.beams.busy
    with pytest.raises(ValueError, match="num_beams=16"):
        engine.add_beam_request(sj.BeamRequest(sources[0], num_beams=16))
