"""Decoder families against HF transformers (fp32, tiny random models): logits and greedy."""

from __future__ import annotations

import numpy as np
import torch
from helpers import random_prompt

import spark_jax as sj

GREEDY = sj.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_logits_match_hf_on_prompts_of_several_lengths(hf_and_model):
    name, hf, model = hf_and_model
    for seed, length in [(1, 1), (2, 13), (3, 40)]:
        ids = random_prompt(seed, length)
        ours = model.logits(ids)
        ref = _hf_logits(hf, ids)
        assert ours.shape == ref.shape == (length, 128)
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, f"{name}: relative error {rel:.2e} at length {length}"


def test_greedy_generate_is_token_identical_to_hf_generate(hf_and_model):
    name, hf, model = hf_and_model
    for seed, length in [(4, 5), (5, 21)]:
        ids = random_prompt(seed, length)
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False
            )[0, length:].tolist()
        result = sj.generate(model, ids, GREEDY)
        assert result.output_tokens == ref, name
        assert result.finish_reason == "length"
