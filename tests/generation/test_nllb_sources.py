"""An NLLB source given raw (text tokens only) with ``src_lang`` is built into
``[src_lang] tokens </s>`` by the library, as HF's ``NllbTokenizer`` builds it: greedy, beam
search and the engine then give what the built source gives. A built source is used as is."""

from __future__ import annotations

import helpers
import pytest

import spark_jax as sj
from spark_jax.model import Model


@pytest.fixture(scope="module")
def model() -> Model:
    runner = helpers.ours(helpers.tiny_hf(encoder_layers=1, decoder_layers=1, seed=5))
    return Model(runner.config, runner.params, tokenizer=None, runner=runner)


def _raw_and_built(seed: int) -> tuple[list[int], list[int]]:
    built = helpers.random_sources(seed=seed, count=1, min_len=6, max_len=12)[0]
    return built[1:-1], built  # random_sources are [eng_Latn] pieces </s>


def test_a_raw_source_with_src_lang_translates_like_the_built_source(model):
    raw, built = _raw_and_built(1)
    assert model.runner.source_tokens(raw, sj.SamplingParams(src_lang="eng_Latn")) == built
    params = sj.SamplingParams(temperature=0.0, max_tokens=8, tgt_lang="deu_Latn")
    with_lang = sj.SamplingParams(
        temperature=0.0, max_tokens=8, tgt_lang="deu_Latn", src_lang="eng_Latn"
    )
    assert (
        sj.generate(model, raw, with_lang).output_tokens
        == sj.generate(model, built, params).output_tokens
    )
    assert (
        sj.generate(model, built, with_lang).output_tokens
        == sj.generate(model, built, params).output_tokens
    )


def test_beam_search_and_the_engine_build_raw_sources_too(model):
    raw, built = _raw_and_built(2)
    beam = dict(tgt_lang="fra_Latn", num_beams=3, max_new=8)
    (from_raw,) = sj.generate_beam(model, [sj.BeamRequest(raw, src_lang="eng_Latn", **beam)])
    (from_built,) = sj.generate_beam(model, [sj.BeamRequest(built, **beam)])
    assert from_raw.sequences == from_built.sequences
    engine = sj.Engine(model, max_num_seqs=4, max_model_len=16, max_num_beams=4)
    params = sj.SamplingParams(temperature=0.0, max_tokens=8, src_lang="eng_Latn")
    (result,) = engine.generate_many([raw], params)
    assert result.output_tokens == sj.generate(model, built, params).output_tokens
    assert result.num_prompt_tokens == len(built)


def test_a_source_starting_with_another_language_than_src_lang_is_refused(model):
    _, built = _raw_and_built(3)
    with pytest.raises(ValueError, match="another language's token than 'fra_Latn'"):
        sj.generate(model, built, sj.SamplingParams(src_lang="fra_Latn", tgt_lang="deu_Latn"))
