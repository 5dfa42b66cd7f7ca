"""Sampling, stop strings, logprobs and streaming through the engine (issue 3's contracts)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_prompt

import spark_jax as sj


def _sampled(seed: int | None, **kw) -> sj.SamplingParams:
    return sj.SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=seed, **kw)


def test_same_seed_same_tokens_alone_and_inside_a_mixed_batch(tiny_llama):
    _, model = tiny_llama
    target_prompt = random_prompt(20, 7)
    target = _sampled(1234)
    alone = sj.generate(model, target_prompt, target).output_tokens
    others = [
        sj.SamplingParams(temperature=0.0, max_tokens=4),
        _sampled(1, top_k=5),
        sj.SamplingParams(temperature=1.3, min_p=0.1, max_tokens=12, seed=9),
        _sampled(2, repetition_penalty=1.3),
        sj.SamplingParams(temperature=0.7, presence_penalty=0.5, max_tokens=3, seed=5),
        _sampled(3, frequency_penalty=1.0),
        sj.SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
    ]
    for position in (0, 4, 7):
        params = others[:position] + [target] + others[position:]
        prompts = [random_prompt(30 + i, 3 + 5 * i) for i in range(8)]
        prompts[position] = target_prompt
        batch = sj.generate_batch(model, prompts, params)
        assert batch[position].output_tokens == alone
    other_seed = sj.generate(model, target_prompt, _sampled(4321)).output_tokens
    assert other_seed != alone


def test_unseeded_requests_differ(tiny_llama):
    _, model = tiny_llama
    prompt = random_prompt(21, 5)
    runs = {tuple(sj.generate(model, prompt, _sampled(None)).output_tokens) for _ in range(3)}
    assert len(runs) > 1


def test_returned_logprobs_are_the_log_softmax_of_the_processed_logits(tiny_llama):
    _, model = tiny_llama
    prompt = random_prompt(22, 6)
    params = sj.SamplingParams(temperature=0.0, max_tokens=3, logprobs=5)
    result = sj.generate(model, prompt, params)
    logits = model.logits(prompt + result.output_tokens)
    for i, lp in enumerate(result.logprobs):
        row = logits[len(prompt) - 1 + i].astype(np.float64)
        ref = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert lp.token_id == result.output_tokens[i]
        np.testing.assert_allclose(lp.logprob, ref[lp.token_id], atol=1e-4)
        top = np.argsort(-ref)[:5]
        assert list(lp.top) == top.tolist()
        np.testing.assert_allclose(list(lp.top.values()), ref[top], atol=1e-4)


def test_min_tokens_holds_off_the_stop_token(tiny_llama):
    _, model = tiny_llama
    prompt = random_prompt(23, 6)
    free = sj.generate(
        model, prompt, sj.SamplingParams(temperature=0.0, max_tokens=8)
    ).output_tokens
    stop = free[0]
    early = sj.SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop])
    assert sj.generate(model, prompt, early).output_tokens == [stop]
    held = sj.SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop], min_tokens=3)
    out = sj.generate(model, prompt, held).output_tokens
    assert stop not in out[:3] and len(out) >= 3


@pytest.mark.parametrize(
    "bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": 0}, {"max_tokens": 0}, {"logprobs": 21}]
)
def test_invalid_parameters_fail_before_device_work(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        sj.SamplingParams(**bad)


def test_stop_string_spanning_three_tokens_stops_with_the_right_text(smollm2):
    tok = smollm2.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    free = sj.generate(smollm2, prompt, sj.SamplingParams(temperature=0.0, max_tokens=24))
    text = free.text
    # Pick a stop string covering at least three whole tokens of the greedy answer.
    pieces = [tok.decode([t]) for t in free.output_tokens]
    start = 2
    stop = "".join(pieces[start : start + 3])
    assert len(stop.strip()) >= 3 and stop in text
    params = sj.SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    result = sj.generate(smollm2, prompt, params)
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.text == text[: text.index(stop)]
    assert result.output_tokens == free.output_tokens[: start + 3]
    deltas = [e for e in sj.stream(smollm2, prompt, params)]
    assert "".join(e.text_delta for e in deltas[:-1]) == result.text
