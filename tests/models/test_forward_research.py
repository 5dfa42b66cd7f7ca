"""The research API of the model handle against HF transformers (fp32): ``Model.forward``'s
hidden states and attention probabilities (HF's ``output_hidden_states`` /
``output_attentions``, eager attention), the cache of a prompt, continuation log-probs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import LANGUAGE_IDS, ours, random_prompt, tiny_hf

import spark_jax as sj
from spark_jax.ops.kv_cache import KVCache

TOLERANCE = 1e-4


def _eager(hf):
    """A copy of an HF model whose attention returns its probabilities (sdpa returns none)."""
    hf = copy.deepcopy(hf)
    hf.config._attn_implementation = "eager"
    return hf


def _relative(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref = ref.numpy()
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def _absolute(ours: np.ndarray, ref: torch.Tensor) -> float:
    ref = ref.numpy()
    assert ours.shape == ref.shape
    return float(np.abs(ours - ref).max())


@pytest.fixture(scope="module")
def nllb_pair():
    hf = tiny_hf(seed=3)
    runner = ours(hf)
    return _eager(hf), sj.Model(runner.config, runner.params, LANGUAGE_IDS, runner=runner)


def test_hidden_states_and_attentions_equal_hf_for_every_decoder_family(hf_and_model):
    name, hf, model = hf_and_model
    hf = _eager(hf)
    for seed, length in [(1, 1), (2, 21)]:  # 21 > the sliding window of 7 (mistral)
        ids = random_prompt(seed, length)
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        out = model.forward(ids, output_hidden_states=True, output_attentions=True)
        assert len(out.hidden_states) == len(ref.hidden_states) == model.config.num_layers + 1
        assert len(out.attentions) == len(ref.attentions) == model.config.num_layers
        for i, (h, r) in enumerate(zip(out.hidden_states, ref.hidden_states, strict=True)):
            assert _relative(h, r[0]) <= TOLERANCE, f"{name}: hidden state {i}"
        for i, (a, r) in enumerate(zip(out.attentions, ref.attentions, strict=True)):
            assert a.shape == (model.config.num_heads, length, length)
            assert _absolute(a, r[0]) <= TOLERANCE, f"{name}: attentions of layer {i}"
        assert _relative(out.logits, ref.logits[0]) <= TOLERANCE
        assert out.cross_attentions is None


def test_forward_without_flags_gives_the_serving_logits_and_nothing_else(tiny_llama):
    _, model = tiny_llama
    ids = random_prompt(7, 19)
    out = model.forward(ids)
    assert out.hidden_states is None and out.attentions is None
    np.testing.assert_allclose(out.logits, model.logits(ids), rtol=0, atol=1e-5)


def test_nllb_decoder_side_equals_hf_with_the_source_given(nllb_pair):
    hf, model = nllb_pair
    src = [LANGUAGE_IDS["eng_Latn"], *range(5, 16), 2]
    dec = [2, LANGUAGE_IDS["fra_Latn"], 9, 10, 11, 12, 13]
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor([src]),
            decoder_input_ids=torch.tensor([dec]),
            output_hidden_states=True,
            output_attentions=True,
        )
    out = model.forward(src, dec, output_hidden_states=True, output_attentions=True)
    layers = model.config.decoder_layers
    assert len(out.hidden_states) == len(ref.decoder_hidden_states) == layers + 1
    for i, (h, r) in enumerate(zip(out.hidden_states, ref.decoder_hidden_states, strict=True)):
        assert _relative(h, r[0]) <= TOLERANCE, f"decoder hidden state {i}"
    pairs = [(out.attentions, ref.decoder_attentions), (out.cross_attentions, ref.cross_attentions)]
    for ours_all, ref_all in pairs:
        assert len(ours_all) == len(ref_all) == layers
        for i, (a, r) in enumerate(zip(ours_all, ref_all, strict=True)):
            assert _absolute(a, r[0]) <= TOLERANCE, f"attentions of decoder layer {i}"
    assert out.cross_attentions[0].shape == (4, len(dec), len(src))
    assert _relative(out.logits, ref.logits[0]) <= TOLERANCE


def test_continuation_logprobs_equal_hf_log_softmax(tiny_llama, nllb_pair):
    hf, model = tiny_llama
    prompt, continuation = random_prompt(8, 9), random_prompt(9, 6)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + continuation])).logits[0]
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    ref = ref[torch.arange(len(continuation)), torch.tensor(continuation)].numpy()
    np.testing.assert_allclose(model.continuation_logprobs(prompt, continuation), ref, atol=1e-4)

    hf, model = nllb_pair
    src, target = [LANGUAGE_IDS["eng_Latn"], 7, 8, 9, 2], [20, 21, 22, 2]
    seed = [2, LANGUAGE_IDS["deu_Latn"]]
    with torch.no_grad():
        logits = hf(
            input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([seed + target])
        ).logits[0]
    ref = torch.log_softmax(logits, -1)[1:-1]
    ref = ref[torch.arange(len(target)), torch.tensor(target)].numpy()
    ours_ = model.continuation_logprobs(src, target, tgt_lang="deu_Latn")
    np.testing.assert_allclose(ours_, ref, atol=1e-4)


def test_kv_cache_of_a_prompt_holds_hf_past_key_values(tiny_llama):
    hf, model = tiny_llama
    ids = random_prompt(10, 13)
    with torch.no_grad():
        past = hf(torch.tensor([ids]), use_cache=True).cache
    cache = model.kv_cache(ids)
    assert isinstance(cache, KVCache)
    assert cache.lengths.tolist() == [len(ids)]
    for i, layer in enumerate(past.layers):
        # HF: [B, K, T, H]; ours: [slots, S, K, H], the first len(ids) positions valid.
        for ours_, ref in [(cache.k[i], layer.keys), (cache.v[i], layer.values)]:
            got = np.asarray(ours_[0, : len(ids)]).transpose(1, 0, 2)
            assert _relative(got, ref[0]) <= TOLERANCE, f"layer {i}"


def test_smollm2_hidden_states_and_attentions_equal_transformers(smollm2, hf_smollm2):
    hf = _eager(hf_smollm2)
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Name a red fruit."}])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True, output_attentions=True)
    out = smollm2.forward(prompt, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == 31
    # Every layer, not only the first: the errors stay near 1e-6 through all 30.
    for i, (h, r) in enumerate(zip(out.hidden_states, ref.hidden_states, strict=True)):
        assert _relative(h, r[0]) <= TOLERANCE, f"hidden state {i}"
    for i, (a, r) in enumerate(zip(out.attentions, ref.attentions, strict=True)):
        assert _absolute(a, r[0]) <= TOLERANCE, f"attentions of layer {i}"
