"""NLLB / M2M100 against HF transformers (fp32, tiny random models): logits, greedy, errors."""

from __future__ import annotations

import helpers
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from spark_jax.models import nllb, weight_spec

FRA = helpers.LANGUAGE_IDS["fra_Latn"]


@pytest.fixture(scope="module")
def hf():
    return helpers.tiny_hf(encoder_layers=2, decoder_layers=3)


@pytest.fixture(scope="module")
def runner(hf):
    return helpers.ours(hf)


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _hf_logits(hf, src, dec) -> np.ndarray:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]))
    return out.logits[0].numpy()


def test_weight_spec_matches_an_hf_checkpoint(hf, runner):
    found = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert weight_spec(runner.config).check(found) == []
    shared_only = {k: s for k, s in found.items() if "embed_tokens" not in k and "lm_head" not in k}
    assert weight_spec(runner.config).check(shared_only) == []


@pytest.mark.parametrize("depths", [(2, 3), (3, 1)])
def test_logits_match_hf_for_sources_and_targets_of_several_lengths(depths):
    hf = helpers.tiny_hf(*depths, seed=sum(depths))
    runner = helpers.ours(hf)
    rng = np.random.default_rng(1)
    for src_len, dec_len in [(3, 1), (9, 6), (40, 23)]:
        src = helpers.random_source(rng, src_len)
        # A pad id inside the target exercises HF's position rule (pads sit at pad_token_id).
        dec = [helpers.EOS, FRA, *rng.integers(helpers.FIRST_PIECE, 90, dec_len).tolist(), 1, 7][
            :dec_len
        ]
        ours = runner.logits(src, dec)
        ref = _hf_logits(hf, src, dec)
        assert ours.shape == ref.shape == (dec_len, helpers.VOCAB_SIZE)
        assert _relative_error(ours, ref) <= 1e-4, (depths, src_len, dec_len)


def test_logits_of_a_padded_batch_of_sources_match_hf(hf, runner):
    sources = helpers.random_sources(seed=2, count=5, min_len=3, max_len=30)
    ids, mask = helpers.padded_batch(sources)
    rng = np.random.default_rng(3)
    dec = torch.tensor([[helpers.EOS, FRA, *rng.integers(4, 90, 10).tolist()] for _ in sources])
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits.numpy()
    src_len = jnp.asarray([len(s) for s in sources], jnp.int32)
    ours = nllb.forward(
        runner.params,
        runner.config,
        jnp.asarray(ids.numpy(), jnp.int32),
        src_len,
        jnp.asarray(dec.numpy(), jnp.int32),
    )
    assert _relative_error(np.asarray(ours), ref) <= 1e-4


def _greedy(runner, sources, max_tokens, slots):
    """A plain host loop over the runner: prefill into ``slots``, then argmax decode steps."""
    state = runner.init_state(num_slots=16, max_len=64, max_prompt_len=max(map(len, sources)))
    logits, state = runner.prefill(state, slots, sources, [None] * len(sources))
    outputs = [[int(t)] for t in np.argmax(np.asarray(logits), axis=-1)]
    for _ in range(max_tokens - 1):
        tokens = np.zeros(16, np.int32)
        active = np.zeros(16, bool)
        for slot, out in zip(slots, outputs, strict=True):
            if out[-1] != helpers.EOS and len(out) < max_tokens:
                tokens[slot], active[slot] = out[-1], True
        if not active.any():
            break
        logits, state = runner.decode(state, jnp.asarray(tokens), jnp.asarray(active))
        picked = np.argmax(np.asarray(logits), axis=-1)
        for slot, out in zip(slots, outputs, strict=True):
            if active[slot]:
                out.append(int(picked[slot]))
    return outputs


def _hf_greedy(hf, sources, max_tokens):
    ids, mask = helpers.padded_batch(sources)
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            forced_bos_token_id=FRA,
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_tokens + 1,  # + the forced language token
        )
    return [helpers.strip_hf_output(row) for row in out.tolist()]


def test_greedy_translation_is_token_identical_to_hf_generate(hf, runner):
    sources = helpers.random_sources(seed=4, count=24)
    ref = _hf_greedy(hf, sources, max_tokens=20)
    # Scattered slots: rows are independent, and unused rows decode alongside.
    slots = [15 - i for i in range(12)] + list(range(12))
    first, second = (
        _greedy(runner, sources[:12], 20, slots[:12]),
        _greedy(runner, sources[12:], 20, slots[12:]),
    )
    assert first + second == ref
    assert any(out[-1] == helpers.EOS for out in ref) and any(out[-1] != helpers.EOS for out in ref)


def test_the_engine_translates_greedily_like_hf(hf, runner):
    import spark_jax.generation.generate as engine
    from spark_jax.model import Model
    from spark_jax.ops.sampling import SamplingParams

    sources = helpers.random_sources(seed=5, count=20)
    model = Model(runner.config, runner.params, tokenizer=None, runner=runner)
    params = SamplingParams(temperature=0.0, max_tokens=20, tgt_lang="fra_Latn")
    results = engine.generate_batch(model, sources, params)
    assert [r.output_tokens for r in results] == _hf_greedy(hf, sources, max_tokens=20)


def test_the_target_language_comes_from_the_request_or_the_default(hf, runner):
    from spark_jax.ops.sampling import SamplingParams

    src = helpers.random_sources(seed=6, count=1)[0]
    state = runner.init_state(4, 32, len(src))
    deu = SamplingParams(tgt_lang="deu_Latn")
    logits, state = runner.prefill(state, [0, 1], [src, src], [deu, SamplingParams()])
    expected_deu = runner.logits(src, [helpers.EOS, helpers.LANGUAGE_IDS["deu_Latn"]])[-1]
    expected_fra = runner.logits(src, [helpers.EOS, FRA])[-1]  # the runner's default
    np.testing.assert_allclose(np.asarray(logits[0]), expected_deu, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits[1]), expected_fra, rtol=1e-5, atol=1e-5)


def test_bad_requests_are_clear_errors(runner):
    from spark_jax.ops.sampling import SamplingParams

    src = helpers.random_sources(seed=7, count=1)[0]
    state = runner.init_state(4, 32, 200)
    with pytest.raises(ValueError, match=r"unknown language code 'fra_latn'.*'fra_Latn'"):
        runner.prefill(state, [0], [src], [SamplingParams(tgt_lang="fra_latn")])
    with pytest.raises(ValueError, match="source is empty"):
        runner.prefill(state, [0], [[]], [None])
    too_long = (
        [helpers.LANGUAGE_IDS["eng_Latn"]] + [5] * (helpers.MAX_POSITIONS - 2) + [helpers.EOS]
    )
    with pytest.raises(ValueError, match="max_position_embeddings - 2"):
        runner.prefill(state, [0], [too_long], [None])
    with pytest.raises(ValueError, match="starts with another language's token than 'deu_Latn'"):
        runner.prefill(state, [0], [src], [SamplingParams(src_lang="deu_Latn")])
    with pytest.raises(ValueError, match="chunked prefill is not supported"):
        runner.prefill_chunk(state, [0], [src], [None])
    # Validation happens before the cache is donated: the state is still usable.
    logits, _ = runner.prefill(state, [0], [src], [None])
    assert logits.shape == (1, helpers.VOCAB_SIZE)


def test_without_any_target_language_prefill_says_how_to_set_one(hf):
    runner = helpers.ours(hf, default_tgt_lang=None)
    src = helpers.random_sources(seed=8, count=1)[0]
    with pytest.raises(ValueError, match="no target language"):
        runner.prefill(runner.init_state(1, 16, len(src)), [0], [src], [None])
