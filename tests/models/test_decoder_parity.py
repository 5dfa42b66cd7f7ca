"""Decoder families against HF transformers (fp32, tiny random models): logits and greedy."""

from __future__ import annotations

import dataclasses

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


def test_ragged_prefill_gives_each_rows_logits_in_one_and_two_chunks(hf_and_model):
    """A ragged prefill (rows' tokens flat, one matmul row each) against HF: each row's last
    logits, in one call and as chunks of two calls (the second continuing the rows), with a
    row that has no token in the second."""
    name, hf, model = hf_and_model
    runner = model.runner
    prompts = [random_prompt(10 + i, n) for i, n in enumerate((5, 13, 1, 9))]
    refs = np.stack([_hf_logits(hf, p)[-1] for p in prompts])
    state = runner.init_state(6, 32)
    logits, state = runner.prefill(state, [4, 0, 2, 5], prompts, min_len=32, ragged=True)
    rel = np.abs(np.asarray(logits) - refs).max() / np.abs(refs).max()
    assert rel <= 1e-4, f"{name}: one call, relative error {rel:.2e}"
    cut = [3, 8, 1, 9]  # the last row is whole in the first call
    state = runner.init_state(6, 32)
    first = [p[:c] for p, c in zip(prompts, cut, strict=True)]
    _, state = runner.prefill(state, [4, 0, 2, 5], first, min_len=32, ragged=True)
    rest = [p[c:] for p, c in zip(prompts, cut, strict=True)]
    logits, state = runner.prefill(
        state, [4, 0, 2, 5], rest, continuing=True, min_len=16, ragged=True
    )
    got = np.asarray(logits)[:2]  # the rows whose prompts end in this call
    rel = np.abs(got - refs[:2]).max() / np.abs(refs[:2]).max()
    assert rel <= 1e-4, f"{name}: two chunks, relative error {rel:.2e}"
    np.testing.assert_array_equal(np.asarray(state.lengths)[[4, 0, 2, 5]], [5, 13, 1, 9])


def test_mixed_step_decodes_rows_beside_a_ragged_prefill(hf_and_model):
    """A mixed step (decode rows riding in a ragged prefill's stream) against HF: the prefill
    rows' last logits, then each decode row's logits for its last token after its prompt,
    with an empty decode row (a slot out of range) and the cache lengths after."""
    name, hf, model = hf_and_model
    runner = model.runner
    decoded = [random_prompt(20 + i, n) for i, n in enumerate((7, 4))]
    prefilled = [random_prompt(30 + i, n) for i, n in enumerate((6, 11))]
    state = runner.init_state(6, 32)
    _, state = runner.prefill(state, [2, 5], [p[:-1] for p in decoded], min_len=16, ragged=True)
    last_tokens = np.zeros((6,), np.int32)
    last_tokens[[2, 5]] = [p[-1] for p in decoded]
    logits, state = runner.prefill(
        state,
        [4, 0, 6],
        [*prefilled, []],
        continuing=True,
        min_len=24,
        ragged=True,
        decode_slots=[2, 5, 6],
        last_tokens=np.asarray(last_tokens),
    )
    refs = np.stack([_hf_logits(hf, p)[-1] for p in (*prefilled, *decoded)])
    assert [x.shape for x in logits] == [(3, 128), (3, 128)]
    got = np.concatenate([np.asarray(x) for x in logits])
    got = got[[0, 1, 3, 4]]  # the prefill rows' (the third is padding), the decode rows'
    rel = np.abs(got - refs).max() / np.abs(refs).max()
    assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"
    np.testing.assert_array_equal(np.asarray(state.lengths)[[4, 0, 2, 5]], [6, 11, 7, 4])


def test_continuing_chunks_in_query_blocks_give_hfs_logits(hf_and_model):
    """A ragged prefill continuing its rows, its queries laid out for attention in rows of
    three (``KernelOptions.ragged_query_blocks``: a chunk of 11 takes four rows, an empty
    chunk none, the layout's spare rows nothing) with decode rows riding, against HF: the
    same logits as one row per chunk gives, and the cache lengths after."""
    name, hf, base = hf_and_model
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((5, 13, 1, 9))]
    decoded = [random_prompt(50 + i, n) for i, n in enumerate((7, 4))]
    refs = np.stack([_hf_logits(hf, p)[-1] for p in (*prompts, *decoded)])
    cut = [1, 2, 1, 0]  # second chunks of 4, 11, 0 and 9 queries
    got = {}
    for blocks in (0, 3):
        options = dataclasses.replace(base.options, ragged_query_blocks=blocks)
        runner = sj.Model(base.config, base.params, options=options).runner
        state = runner.init_state(8, 32)
        first = [p[:c] for p, c in zip(prompts, cut, strict=True)]
        first += [p[:-1] for p in decoded]
        _, state = runner.prefill(state, [4, 0, 2, 5, 6, 7], first, min_len=32, ragged=True)
        last_tokens = np.zeros((8,), np.int32)
        last_tokens[[6, 7]] = [p[-1] for p in decoded]
        logits, state = runner.prefill(
            state,
            [4, 0, 2, 5],
            [p[c:] for p, c in zip(prompts, cut, strict=True)],
            continuing=True,
            min_len=32,
            ragged=True,
            decode_slots=[6, 7, 8],
            last_tokens=np.asarray(last_tokens),
        )
        rows = np.concatenate([np.asarray(x) for x in logits])[[0, 1, 3, 4, 5]]
        rel = np.abs(rows - refs[[0, 1, 3, 4, 5]]).max() / np.abs(refs).max()
        assert rel <= 1e-4, f"{name}, blocks of {blocks}: relative error {rel:.2e}"
        lengths = np.asarray(state.lengths)[[4, 0, 2, 5, 6, 7]]
        np.testing.assert_array_equal(lengths, [5, 13, 1, 9, 7, 4])
        got[blocks] = rows
    np.testing.assert_allclose(got[3], got[0], rtol=0, atol=1e-5 * np.abs(refs).max())
