"""Per-request LoRA adapters on NLLB / M2M100 against PEFT: logits, greedy, beam, errors."""

from __future__ import annotations

import helpers
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import add_peft_adapters, make_peft

import spark_jax as sj
from spark_jax.generation import step
from spark_jax.generation.beam import BeamRequest, generate_beam
from spark_jax.model import Model
from spark_jax.models import nllb

FRA = helpers.LANGUAGE_IDS["fra_Latn"]
ATTN = ["q_proj", "k_proj", "v_proj", "out_proj"]
ADAPTERS = {  # name -> LoraConfig kwargs; B initialised non-zero (init_lora_weights=False)
    "all_r4": dict(r=4, lora_alpha=8, target_modules=[*ATTN, "fc1", "fc2"]),
    "self_r8_rslora": dict(
        r=8, lora_alpha=4, target_modules=[f"self_attn.{m}" for m in ATTN], use_rslora=True
    ),
    "cross_ffn_r2": dict(
        r=2, lora_alpha=16, target_modules=[*(f"encoder_attn.{m}" for m in ATTN), "fc1", "fc2"]
    ),
}
MIXED = [None, "all_r4", "self_r8_rslora", "cross_ffn_r2", "all_r4", None]


def _model(hf) -> Model:
    runner = helpers.ours(hf)
    return Model(runner.config, runner.params, tokenizer=None, runner=runner)


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    hf = helpers.tiny_hf(encoder_layers=2, decoder_layers=3)
    model = _model(hf)
    model.enable_lora(max_adapters=4, max_rank=8)
    return hf, model, add_peft_adapters(model, hf, ADAPTERS, tmp_path_factory)


def _relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _hf_logits(hf, src, dec) -> np.ndarray:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([dec]))
    return out.logits[0].numpy()


def test_each_adapter_matches_peft_and_base_rows_match_the_base_model(lora_setup):
    hf, model, peft_models = lora_setup
    plain = _model(hf)
    rng = np.random.default_rng(1)
    for src_len, dec_len in [(5, 3), (30, 12)]:
        src = helpers.random_source(rng, src_len)
        dec = [helpers.EOS, FRA, *rng.integers(helpers.FIRST_PIECE, 90, dec_len).tolist()][:dec_len]
        base_ref = _hf_logits(hf, src, dec)
        np.testing.assert_array_equal(model.logits(src, dec), plain.logits(src, dec))
        for name, peft_model in peft_models.items():
            ref = _hf_logits(peft_model, src, dec)
            assert _relative_error(ref, base_ref) > 1e-2, f"{name} must change the model"
            rel = _relative_error(model.logits(src, dec, adapter=name), ref)
            assert rel <= 1e-4, f"{name}, source {src_len}: relative error {rel:.2e}"


def test_mixed_prefill_and_decode_rows_each_use_their_adapter(lora_setup):
    hf, model, _ = lora_setup
    runner, plain = model.runner, _model(hf).runner
    sources = helpers.random_sources(seed=2, count=len(MIXED))
    slots = [model.adapter_slot(n) for n in MIXED]
    rows = list(range(len(MIXED)))
    state = runner.init_state(8, 16, max(map(len, sources)))
    mixed, state = runner.prefill(state, rows, sources, [None] * len(MIXED), adapters=slots)
    base, _ = plain.prefill(plain.init_state(8, 16, max(map(len, sources))), rows, sources)
    # One decode step over all 8 cache rows: the pool rows follow the cache rows.
    active = jnp.asarray([True] * len(MIXED) + [False] * 2)
    stepped, _ = runner.decode(state, jnp.full((8,), 7, jnp.int32), active, [*slots, -1, -1])
    for row, (name, src) in enumerate(zip(MIXED, sources, strict=True)):
        if name is None:  # adds an exact zero; XLA may order the base matmuls differently
            assert _relative_error(np.asarray(mixed[row]), np.asarray(base[row])) <= 1e-6
        expected = model.logits(src, [helpers.EOS, FRA, 7], adapter=name)
        assert _relative_error(np.asarray(mixed[row]), expected[1]) <= 1e-5
        assert _relative_error(np.asarray(stepped[row]), expected[2]) <= 1e-5


def _greedy_params(name: str | None) -> sj.SamplingParams:
    return sj.SamplingParams(temperature=0.0, max_tokens=12, tgt_lang="fra_Latn", adapter=name)


def _changed(outputs: list, base_outputs: list) -> int:
    """How many requests with an adapter got another output than the base model gives."""
    pairs = zip(MIXED, outputs, base_outputs, strict=True)
    return sum(name is not None and out != base for name, out, base in pairs)


def test_a_mixed_greedy_batch_gives_each_request_its_solo_result(lora_setup):
    hf, model, peft_models = lora_setup
    sources = helpers.random_sources(seed=3, count=len(MIXED))
    params = [_greedy_params(n) for n in MIXED]
    solo = [sj.generate(model, s, p).output_tokens for s, p in zip(sources, params, strict=True)]
    mixed = sj.generate_batch(model, sources, params)
    assert [r.output_tokens for r in mixed] == solo
    one_a_call = sj.LoopOptions(prefill_tokens_per_call=1)  # each source encoded on its own
    grouped = sj.generate_batch(model, sources, params, loop=one_a_call)
    assert [r.output_tokens for r in grouped] == solo
    base = sj.generate_batch(_model(hf), sources, _greedy_params(None))
    assert [solo[i] for i in (0, 5)] == [base[i].output_tokens for i in (0, 5)]
    assert _changed(solo, [r.output_tokens for r in base]) >= 3  # the adapters really act
    ids, mask = helpers.padded_batch(sources[1:4])
    for row, name in enumerate(MIXED[1:4]):
        with torch.no_grad():
            ref = peft_models[name].generate(
                input_ids=ids,
                attention_mask=mask,
                forced_bos_token_id=FRA,
                do_sample=False,
                num_beams=1,
                max_new_tokens=13,  # + the forced language token
            )
        assert solo[1 + row] == helpers.strip_hf_output(ref[row].tolist()), name
    # Changing the adapter mix changes no shape: nothing recompiles.
    # (The engine runs decode steps inside its device loop, step.chunk_loop.)
    before = (nllb.prefill._cache_size(), step.chunk_loop._cache_size())
    for names in (MIXED[::-1], [None] * 5 + ["self_r8_rslora"]):
        sj.generate_batch(model, sources, [_greedy_params(n) for n in names])
    assert (nllb.prefill._cache_size(), step.chunk_loop._cache_size()) == before


def _beam(source, name, **knobs) -> BeamRequest:
    return BeamRequest(source, tgt_lang="fra_Latn", adapter=name, **knobs)


def _as_tuples(results):
    return [(r.sequences, np.round(r.scores, 4).tolist()) for r in results]


def test_mixed_beam_batches_give_each_request_its_solo_result_and_match_peft(lora_setup):
    _, model, peft_models = lora_setup
    sources = helpers.random_sources(seed=5, count=len(MIXED), max_len=16)  # one source bucket
    knobs = [
        dict(num_beams=[2, 3, 4][i % 3], max_new=12, num_return_sequences=1 + i % 2)
        for i in range(len(MIXED))
    ]
    requests = [_beam(s, n, **k) for s, n, k in zip(sources, MIXED, knobs, strict=True)]
    alone = [generate_beam(model, [r])[0] for r in requests]
    assert _as_tuples(generate_beam(model, requests)) == _as_tuples(alone)
    # Too few rows for all beams at once: rows are reused by requests of other adapters.
    assert _as_tuples(generate_beam(model, requests, max_rows=8)) == _as_tuples(alone)
    plain = [_beam(s, None, **k) for s, k in zip(sources, knobs, strict=True)]
    base = generate_beam(model, plain)  # base rows equal the plain model's: tests above
    assert _changed([r.sequences for r in alone], [r.sequences for r in base]) >= 3

    # Against PEFT: two adapters, three sources each, all six searches in one batch.
    names = ["self_r8_rslora", "cross_ffn_r2"]
    ours = generate_beam(
        model, [_beam(s, n, num_beams=3, max_new=12) for n in names for s in sources[:3]]
    )
    ids, mask = helpers.padded_batch(sources[:3])
    for i, name in enumerate(names):
        with torch.no_grad():
            ref = peft_models[name].generate(
                input_ids=ids,
                attention_mask=mask,
                forced_bos_token_id=FRA,
                num_beams=3,
                max_new_tokens=13,  # + the forced language token
                early_stopping=True,
                output_scores=True,
                return_dict_in_generate=True,
            )
        results = ours[3 * i : 3 * i + 3]
        expected = [helpers.strip_hf_output(row) for row in ref.sequences.tolist()]
        assert [r.sequences[0] for r in results] == expected, name
        np.testing.assert_allclose(
            [r.scores[0] for r in results], ref.sequences_scores.numpy(), rtol=0, atol=1e-4
        )


def test_bad_adapters_are_refused_clearly_and_serving_goes_on(lora_setup, tmp_path):
    hf, model, _ = lora_setup
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    other_config = M2M100Config(**{**hf.config.to_dict(), "d_model": 16})
    other = M2M100ForConditionalGeneration(other_config)
    make_peft(other, 0, r=4, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(
        tmp_path / "o"
    )
    with pytest.raises(ValueError, match=r"q_proj: lora_A \(4, 16\).*another base model"):
        model.add_adapter("other_base", tmp_path / "o")
    head = make_peft(hf, 0, r=4, lora_alpha=8, target_modules=["lm_head"])
    head.save_pretrained(tmp_path / "head", save_embedding_layers=False)
    with pytest.raises(ValueError, match="targets module 'lm_head'"):
        model.add_adapter("head", tmp_path / "head")
    head.save_pretrained(tmp_path / "head_saved")  # PEFT adds the tied embedding it trained
    with pytest.raises(ValueError, match=r"lm_head.*not supported"):
        model.add_adapter("head", tmp_path / "head_saved")
    source = helpers.random_sources(seed=7, count=1)[0]
    good = _beam(source, "all_r4", num_beams=2, max_new=12)
    with pytest.raises(ValueError, match=r"request 1: adapter 'nope' is not loaded.*all_r4"):
        generate_beam(model, [good, _beam(source, "nope")])
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded"):
        sj.generate(model, source, _greedy_params("nope"))
    with pytest.raises(ValueError, match="request 0: adapter 'all_r4' is not loaded"):
        generate_beam(_model(hf), [good])
    assert model.slot_pool.in_use == 0
    assert model.lora_pool.names.count(None) == 1  # the refused adapters took no slot
    assert generate_beam(model, [good])[0].sequences[0]
    assert sj.generate(model, source, _greedy_params("cross_ffn_r2")).output_tokens


def test_a_merged_adapter_equals_the_unmerged_output(lora_setup):
    _, model, _ = lora_setup
    src = helpers.random_sources(seed=9, count=1)[0]
    dec = [helpers.EOS, FRA, 11, 12, 13]
    merged = model.merged("cross_ffn_r2")  # fused cross-attention k/v included
    np.testing.assert_allclose(
        merged.logits(src, dec),
        model.logits(src, dec, adapter="cross_ffn_r2"),
        rtol=1e-5,
        atol=1e-5,
    )


def test_engine_translations_and_beams_with_mixed_adapters_equal_their_solo_results(lora_setup):
    """``sj.Engine`` on NLLB, greedy and beam requests over 3 adapters + base in one loop."""
    _, model, _ = lora_setup
    sources = helpers.random_sources(seed=41, count=6)
    batcher = sj.Engine(model, max_num_seqs=8, max_model_len=32, max_num_beams=4)
    greedy = [sj.SamplingParams(temperature=0.0, max_tokens=10, adapter=a) for a in MIXED]
    beams = [
        BeamRequest(s, num_beams=2, max_new=8, adapter=a)
        for s, a in zip(sources, MIXED, strict=True)
    ]
    ids = [batcher.add_request(s, p) for s, p in zip(sources, greedy, strict=True)]
    ids += [batcher.add_beam_request(b) for b in beams]
    results = {o.request_id: o.result for o in batcher.run() if o.finished}
    solo = [sj.generate(model, s, p).output_tokens for s, p in zip(sources, greedy, strict=True)]
    assert [results[i].output_tokens for i in ids[:6]] == solo
    alone = [generate_beam(model, [b])[0].sequences for b in beams]
    assert [results[i].sequences for i in ids[6:]] == alone
    assert batcher.slots_in_use == 0 and not batcher.beams.busy
