"""Beam search against HF ``generate(num_beams=...)``, co-batching invariance, validation."""

from __future__ import annotations

import itertools

import helpers
import numpy as np
import pytest
import torch

from spark_jax.generation import beam, step
from spark_jax.generation.beam import BeamRequest, generate_beam

MAX_NEW = 20


@pytest.fixture(scope="module")
def hf():
    return helpers.tiny_hf(encoder_layers=2, decoder_layers=3)


@pytest.fixture(scope="module")
def runner(hf):
    return helpers.ours(hf)


def _hf_beam(hf, sources, tgt_lang="fra_Latn", **knobs):
    ids, mask = helpers.padded_batch(sources)
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            forced_bos_token_id=helpers.LANGUAGE_IDS[tgt_lang],
            max_new_tokens=knobs.pop("max_new") + 1,  # + the forced language token
            output_scores=True,
            return_dict_in_generate=True,
            **knobs,
        )
    return [
        helpers.strip_hf_output(r) for r in out.sequences.tolist()
    ], out.sequences_scores.numpy()


GRID = list(itertools.product([2, 4, 5], [0.6, 1.0, 1.3], [True, False, "never"]))


@pytest.mark.parametrize("num_beams, length_penalty, early_stopping", GRID)
def test_beam_search_is_sequence_identical_to_hf(
    hf, runner, num_beams, length_penalty, early_stopping
):
    sources = helpers.random_sources(seed=10, count=10)
    knobs = dict(
        num_beams=num_beams,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        max_new=MAX_NEW,
    )
    ref_sequences, ref_scores = _hf_beam(hf, sources, **knobs)
    results = generate_beam(runner, [BeamRequest(s, **knobs) for s in sources])
    assert [r.sequences[0] for r in results] == ref_sequences
    np.testing.assert_allclose([r.scores[0] for r in results], ref_scores, rtol=0, atol=1e-4)


def test_early_stopping_modes_lead_to_different_translations(runner):
    """Guards the grid above against a model whose beams never differ by stopping rule."""
    sources = helpers.random_sources(seed=10, count=10)
    best = {
        mode: [
            r.sequences[0]
            for r in generate_beam(
                runner,
                [
                    BeamRequest(
                        s, num_beams=2, length_penalty=1.3, early_stopping=mode, max_new=MAX_NEW
                    )
                    for s in sources
                ],
            )
        ]
        for mode in (True, False, "never")
    }
    assert best[True] != best[False] != best["never"]


def test_several_returned_sequences_match_hf_in_order(hf, runner):
    sources = helpers.random_sources(seed=11, count=6)
    knobs = dict(num_beams=4, length_penalty=1.0, early_stopping=False, max_new=MAX_NEW)
    ref_sequences, ref_scores = _hf_beam(hf, sources, num_return_sequences=3, **knobs)
    results = generate_beam(
        runner, [BeamRequest(s, num_return_sequences=3, **knobs) for s in sources]
    )
    assert [seq for r in results for seq in r.sequences] == ref_sequences
    ours = [score for r in results for score in r.scores]
    np.testing.assert_allclose(ours, ref_scores, rtol=0, atol=1e-4)


def _mixed_requests() -> list[BeamRequest]:
    rng = np.random.default_rng(12)
    langs = ["fra_Latn", "deu_Latn", "zho_Hans", None]
    modes = [True, False, "never"]
    return [
        BeamRequest(
            helpers.random_source(rng, int(rng.integers(3, 40))),
            tgt_lang=langs[i % 4],
            num_beams=[1, 2, 3, 4, 5][i % 5],
            max_new=int(rng.integers(4, MAX_NEW)),
            length_penalty=[0.6, 1.0, 1.3][i % 3],
            early_stopping=modes[i % 3],
            num_return_sequences=1 + (i % 2) * ([1, 2, 3, 4, 5][i % 5] > 1),
        )
        for i in range(8)
    ]


def _as_tuples(results):
    return [(r.sequences, np.round(r.scores, 4).tolist()) for r in results]


def test_co_batched_requests_give_the_results_of_each_run_alone(runner):
    requests = _mixed_requests()
    alone = [generate_beam(runner, [r])[0] for r in requests]
    together = generate_beam(runner, requests)
    assert _as_tuples(together) == _as_tuples(alone)
    # Too few rows for all beams at once: later requests reuse the rows of finished ones.
    assert _as_tuples(generate_beam(runner, requests, max_rows=8)) == _as_tuples(alone)


def test_the_target_language_of_each_request_is_forced(hf, runner):
    sources = helpers.random_sources(seed=13, count=4)
    knobs = dict(num_beams=3, length_penalty=1.0, early_stopping=True, max_new=MAX_NEW)
    for lang in ("deu_Latn", "zho_Hans"):
        ref_sequences, _ = _hf_beam(hf, sources, tgt_lang=lang, **knobs)
        results = generate_beam(runner, [BeamRequest(s, tgt_lang=lang, **knobs) for s in sources])
        assert [r.sequences[0] for r in results] == ref_sequences


@pytest.mark.parametrize(
    "knobs, message",
    [
        (dict(num_beams=0), "num_beams must be an integer >= 1"),
        (dict(num_beams=2, num_return_sequences=3), r"num_return_sequences \(3\) must be <="),
        (dict(max_new=0), "max_new must be an integer >= 1"),
        (dict(early_stopping="sometimes"), "early_stopping must be"),
    ],
)
def test_invalid_beam_requests_are_refused_naming_the_field(knobs, message):
    with pytest.raises(ValueError, match=message):
        BeamRequest([helpers.LANGUAGE_IDS["eng_Latn"], 5, helpers.EOS], **knobs)


def test_one_bad_request_fails_the_whole_call_naming_it(runner):
    good = BeamRequest(helpers.random_sources(seed=14, count=1)[0])
    with pytest.raises(ValueError, match=r"request 1: unknown language code 'xx_Latn'"):
        generate_beam(runner, [good, BeamRequest(good.prompt_tokens, tgt_lang="xx_Latn")])
    with pytest.raises(ValueError, match="request 0: the source is empty"):
        generate_beam(runner, [BeamRequest([]), good])


def _layout_requests(rng: np.random.Generator, count: int, call: int) -> list[BeamRequest]:
    """Requests that differ in every knob but share one layout: 4 beams at most, max_new <= 14
    (cache 16), sources of 17-32 tokens (bucket 32)."""
    return [
        BeamRequest(
            helpers.random_source(rng, int(rng.integers(17, 33))),
            tgt_lang=["fra_Latn", "deu_Latn", None][(call + i) % 3],
            num_beams=[3, 4][(call + i) % 2],
            max_new=int(rng.integers(6, 15)),
            length_penalty=[0.6, 1.0, 1.3][(call + i) % 3],
            early_stopping=[True, False, "never"][(call * 2 + i) % 3],
            num_return_sequences=1 + (call + i) % 3,
        )
        for i in range(count)
    ]


def test_the_device_search_loop_compiles_once_per_layout(runner):
    """Calls with different requests, one (rows, beams, max_new, source) bucket: one compile of
    the search loop and one of the first step, whatever the knobs and admission waves."""
    step.chunk_loop.clear_cache()
    beam._start.clear_cache()
    rng = np.random.default_rng(15)
    for call in range(3):  # 4 requests of 3-4 beams: 16 rows, all admitted at once
        generate_beam(runner, _layout_requests(rng, 4, call))
    # 7 requests for 16 rows: admitted in waves of different sizes as rows free up.
    waves = _layout_requests(rng, 7, 3)
    generate_beam(runner, waves, max_rows=16)
    assert step.chunk_loop._cache_size() == 1
    assert beam._start._cache_size() == 1


@pytest.mark.parametrize("max_len", [96, 40])  # chunked prefix moves; one whole-buffer chunk
def test_reordering_moves_every_valid_position_of_each_row(max_len):
    """Row r ends up equal to row source[r] below its length, whatever part of the buffer the
    reorder skips; cross K/V move only when asked."""
    from spark_jax.ops.kv_cache import EncoderDecoderCache

    rng = np.random.default_rng(3)
    cache = EncoderDecoderCache.create(2, 6, max_len, 8, 2, 4, np.float32)
    fill = lambda xs: tuple(rng.normal(size=x.shape).astype(np.float32) for x in xs)
    lengths = np.array([33, 5, 0, 70 % max_len, 12, 1], np.int32)
    cache = EncoderDecoderCache(
        fill(cache.k), fill(cache.v), fill(cache.cross_k), fill(cache.cross_v), lengths, lengths
    )
    source = np.array([3, 3, 0, 1, 4, 2], np.int32)
    for with_cross in (False, True):
        moved = cache.gather_rows(source, with_cross)
        np.testing.assert_array_equal(moved.lengths, lengths[source])
        for before, after in zip(cache.k + cache.v, moved.k + moved.v, strict=True):
            for row, src in enumerate(source):
                n = lengths[src]
                np.testing.assert_array_equal(np.asarray(after)[row, :n], before[src, :n])
        cross = (moved.cross_k[0], cache.cross_k[0][source] if with_cross else cache.cross_k[0])
        np.testing.assert_array_equal(*cross)
