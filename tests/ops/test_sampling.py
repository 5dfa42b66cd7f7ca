"""Specification of spark_jax.ops.sampling: HF parity of each processor, the sampled distribution,
seed reproducibility across batches, returned logprobs, parameter validation, and that
changing parameter values never recompiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from helpers import CompileCounter, scatters_promise_unique
from transformers.generation import logits_process as hf

from spark_jax.ops.sampling import (
    MAX_LOGPROBS,
    SamplerBatch,
    SamplerPasses,
    SamplingParams,
    _top_n,
    apply_min_p,
    apply_min_tokens,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_k_top_p,
    apply_top_p,
    count_tokens,
    prompt_token_mask,
    sample,
)

VOCAB = 64


def random_logits(num_rows: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((num_rows, vocab)) * 3).astype(np.float32)


def hf_rows(processor_for_row, logits: np.ndarray, input_ids=None) -> np.ndarray:
    """Applies an HF processor row by row, each row with its own parameter."""
    rows = []
    for i, row in enumerate(logits):
        ids = torch.zeros((1, 0), dtype=torch.long) if input_ids is None else input_ids[i]
        processor = processor_for_row(i)
        scores = torch.from_numpy(row[None].copy())
        rows.append(scores if processor is None else processor(ids, scores))
    return torch.cat(rows).numpy()


def assert_same_logits(ours: jax.Array, reference: np.ndarray) -> None:
    ours = np.asarray(ours)
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(reference))
    np.testing.assert_allclose(ours, reference, rtol=1e-6, atol=1e-6)


def inputs(num_rows: int, vocab: int = VOCAB):
    """Zero output counts, empty prompt mask, step 0: no penalty has anything to act on."""
    return (
        jnp.zeros((num_rows, vocab), jnp.int32),
        jnp.zeros((num_rows, vocab), bool),
        jnp.zeros((num_rows,), jnp.int32),
    )


# ---------------------------------------------------------------- 1. processors match HF


def test_temperature_matches_hf_per_row():
    temperatures = [0.3, 0.7, 1.0, 1.5, 2.0, 0.05]
    logits = random_logits(len(temperatures))
    ours = apply_temperature(jnp.asarray(logits), jnp.asarray(temperatures, jnp.float32))
    theirs = hf_rows(lambda i: hf.TemperatureLogitsWarper(temperatures[i]), logits)
    assert_same_logits(ours, theirs)


def test_temperature_zero_leaves_greedy_rows_unscaled():
    logits = random_logits(2)
    ours = apply_temperature(jnp.asarray(logits), jnp.asarray([0.0, 2.0], jnp.float32))
    np.testing.assert_array_equal(np.asarray(ours)[0], logits[0])


def test_top_k_matches_hf_per_row():
    top_ks = [1, 2, 5, 17, 63, 0]  # 0 = off
    logits = random_logits(len(top_ks), seed=1)
    ours = apply_top_k(jnp.asarray(logits), jnp.asarray(top_ks, jnp.int32))
    theirs = hf_rows(lambda i: hf.TopKLogitsWarper(top_ks[i]) if top_ks[i] else None, logits)
    assert_same_logits(ours, theirs)
    assert np.isfinite(np.asarray(ours)).sum(axis=1).tolist() == [1, 2, 5, 17, 63, VOCAB]


def test_top_p_matches_hf_per_row():
    top_ps = [0.05, 0.3, 0.5, 0.8, 0.95, 1.0]
    logits = random_logits(len(top_ps), seed=2)
    ours = apply_top_p(jnp.asarray(logits), jnp.asarray(top_ps, jnp.float32))
    theirs = hf_rows(lambda i: hf.TopPLogitsWarper(top_ps[i]), logits)
    assert_same_logits(ours, theirs)
    kept = np.isfinite(np.asarray(ours)).sum(axis=1)
    assert kept[0] < kept[3] < kept[5] == VOCAB


def test_top_k_then_top_p_matches_hf_chain():
    top_ks, top_ps = [3, 10, 0, 40, 1], [0.5, 0.9, 0.7, 1.0, 0.2]
    logits = random_logits(len(top_ks), seed=3)
    ours = apply_top_k_top_p(
        jnp.asarray(logits), jnp.asarray(top_ks, jnp.int32), jnp.asarray(top_ps, jnp.float32)
    )

    def chain(i):
        warpers = [hf.TopKLogitsWarper(top_ks[i])] if top_ks[i] else []
        warpers.append(hf.TopPLogitsWarper(top_ps[i]))
        return hf.LogitsProcessorList(warpers)

    assert_same_logits(ours, hf_rows(chain, logits))


def test_min_p_matches_hf_per_row():
    min_ps = [0.0, 0.01, 0.1, 0.3, 0.7, 1.0]
    logits = random_logits(len(min_ps), seed=4)
    ours = apply_min_p(jnp.asarray(logits), jnp.asarray(min_ps, jnp.float32))
    theirs = hf_rows(lambda i: hf.MinPLogitsWarper(min_ps[i]), logits)
    assert_same_logits(ours, theirs)
    assert np.isfinite(np.asarray(ours)[0]).all()


def test_repetition_penalty_matches_hf_per_row():
    penalties = [1.0, 1.2, 0.8, 2.0, 1.05]
    logits = random_logits(len(penalties), seed=5)
    rng = np.random.default_rng(5)
    seen_ids = [torch.from_numpy(rng.integers(0, VOCAB, (1, 12))) for _ in penalties]
    seen = np.zeros((len(penalties), VOCAB), bool)
    for i, ids in enumerate(seen_ids):
        seen[i, ids.numpy()[0]] = True
    ours = apply_repetition_penalty(
        jnp.asarray(logits), jnp.asarray(seen), jnp.asarray(penalties, jnp.float32)
    )
    theirs = hf_rows(lambda i: hf.RepetitionPenaltyLogitsProcessor(penalties[i]), logits, seen_ids)
    assert_same_logits(ours, theirs)
    assert not np.allclose(np.asarray(ours)[1], logits[1])


def test_presence_and_frequency_follow_openai_formula():
    presence, frequency = [0.0, 0.5, -1.0, 2.0], [0.0, 0.3, 1.5, -2.0]
    logits = random_logits(len(presence), seed=6)
    counts = np.random.default_rng(6).integers(0, 4, logits.shape).astype(np.int32)
    ours = apply_presence_frequency(
        jnp.asarray(logits),
        jnp.asarray(counts),
        jnp.asarray(presence, jnp.float32),
        jnp.asarray(frequency, jnp.float32),
    )
    expected = (
        logits
        - np.asarray(presence, np.float32)[:, None] * (counts > 0)
        - np.asarray(frequency, np.float32)[:, None] * counts
    )
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(ours)[0], logits[0])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(min_tokens=0, stop_token_ids=[7]),
    ]
    batch = SamplerBatch.from_params(params, VOCAB, eos_ids=(2,))
    logits = jnp.asarray(random_logits(3, seed=7))
    for step, row0_blocked in [(2, True), (3, False)]:
        out = np.asarray(
            apply_min_tokens(logits, batch.stop_ids, batch.min_tokens, jnp.full(3, step))
        )
        blocked = np.isneginf(out)
        assert blocked[0, [2, 7]].tolist() == [row0_blocked] * 2
        assert blocked[1, [2, 7]].tolist() == [False, row0_blocked]  # ignore_eos: EOS free
        assert blocked.sum() == (3 if row0_blocked else 0)


# ------------------------------------------------------------- numpy reference pipeline


def softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_processed(
    logits: np.ndarray,
    p: SamplingParams,
    counts: np.ndarray,
    in_prompt: np.ndarray,
    num_generated: int,
    eos_ids: tuple[int, ...] = (),
) -> np.ndarray:
    """One row through the whole pipeline in float64 numpy, written from the specs."""
    x = logits.astype(np.float64).copy()
    for token, bias in p.logit_bias.items():
        x[token] += bias
    seen = in_prompt | (counts > 0)
    r = p.repetition_penalty
    x = np.where(seen, np.where(x < 0, x * r, x / r), x)
    x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    if num_generated < p.min_tokens:
        x[list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))] = -np.inf
    if p.temperature > 0:
        x = x / p.temperature
    if p.top_k > 0:
        x = np.where(x < np.sort(x)[-p.top_k], -np.inf, x)
    if p.top_p < 1:
        order = np.argsort(x)  # ascending, like HF
        cumulative = np.cumsum(softmax(x)[order])
        drop = cumulative <= 1 - p.top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    if p.min_p > 0:
        probs = softmax(x)
        x = np.where(probs < p.min_p * probs.max(), -np.inf, x)
    return x


def log_softmax(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(softmax(x))


# ------------------------------------------------------------------ 2. distribution test

DISTRIBUTION_CASES = {
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.3, top_k=4),
    "top_p": SamplingParams(top_p=0.8),
    "min_p": SamplingParams(temperature=0.9, min_p=0.2),
    "all_filters": SamplingParams(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_draws_follow_the_processed_distribution(case):
    num_draws, vocab = 20_000, 12
    row_logits = np.linspace(-2.0, 1.5, vocab).astype(np.float32)
    np.random.default_rng(8).shuffle(row_logits)
    template = DISTRIBUTION_CASES[case]
    # One call: every row is an independent request with its own seed.
    params = [
        SamplingParams(**{**template.__dict__, "seed": 1_000_003 * i + 17})
        for i in range(num_draws)
    ]
    batch = SamplerBatch.from_params(params, vocab)
    logits = jnp.asarray(np.broadcast_to(row_logits, (num_draws, vocab)))
    tokens = np.asarray(sample(logits, batch, *inputs(num_draws, vocab)).tokens)

    counts = np.bincount(tokens, minlength=vocab)
    processed = reference_processed(row_logits, template, np.zeros(vocab), np.zeros(vocab, bool), 0)
    expected = softmax(processed) * num_draws
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    assert support.sum() > 1, "the case should leave a real choice"
    _, p_value = scipy.stats.chisquare(counts[support], expected[support])
    assert p_value > 1e-3


# ----------------------------------------------------------- 3. seeds and batch position


def test_greedy_is_bitwise_plain_argmax():
    logits = random_logits(16, seed=9)
    logits[3, [5, 9]] = logits[3].max() + 1  # a tie: argmax takes the first
    batch = SamplerBatch.from_params([SamplingParams(temperature=0.0)] * 16, VOCAB)
    out = sample(jnp.asarray(logits), batch, *inputs(16))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(logits, axis=-1))


def test_top_1_sampling_equals_greedy():
    logits = random_logits(16, seed=10)
    batch = SamplerBatch.from_params([SamplingParams(top_k=1, seed=i) for i in range(16)], VOCAB)
    out = sample(jnp.asarray(logits), batch, *inputs(16))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.argmax(logits, axis=-1))


def test_greedy_rows_still_apply_penalties():
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, 4] = 1.0
    counts = np.zeros((1, VOCAB), np.int32)
    counts[0, 4] = 2
    batch = SamplerBatch.from_params([SamplingParams(temperature=0, frequency_penalty=1)], VOCAB)
    out = sample(
        jnp.asarray(logits),
        batch,
        jnp.asarray(counts),
        jnp.zeros((1, VOCAB), bool),
        jnp.ones(1, jnp.int32),
    )
    assert int(out.tokens[0]) != 4


def run_steps(params_rows, logits_rows, counts_rows, prompt_rows, steps):
    """Samples `steps` consecutive steps of a batch; returns tokens [steps, B]."""
    batch = SamplerBatch.from_params(params_rows, VOCAB, eos_ids=(0,))
    counts = jnp.asarray(counts_rows)
    tokens = []
    for step in range(steps):
        out = sample(
            jnp.asarray(logits_rows[step]),
            batch,
            counts,
            jnp.asarray(prompt_rows),
            jnp.full(len(params_rows), step, jnp.int32),
        )
        counts = count_tokens(counts, out.tokens)
        tokens.append(np.asarray(out.tokens))
    return np.stack(tokens)


def test_same_seed_gives_same_tokens_alone_and_at_any_batch_position():
    steps = 6
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal((steps, 8, VOCAB)) * 2).astype(np.float32)
    counts = rng.integers(0, 2, (8, VOCAB)).astype(np.int32)
    prompt = rng.random((8, VOCAB)) < 0.1
    filtered = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=1234)
    plain = SamplingParams(temperature=1.1, presence_penalty=0.5, min_tokens=2, seed=99)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3, seed=5),
        SamplingParams(min_p=0.2, logit_bias={i: 1.0 for i in range(12)}),  # wider bias table
        None,
        SamplingParams(temperature=0.5, frequency_penalty=1.0, stop_token_ids=list(range(9))),
        SamplingParams(top_k=10, top_p=0.5, seed=7),
    ]
    for probe in (filtered, plain):
        for position in (0, 3, 7):
            mixed = list(others)
            mixed.insert(position, probe)
            mixed.insert(7 - position, SamplingParams(seed=probe.seed + 1))
            batched = run_steps(mixed, logits, counts, prompt, steps)[:, position]

            def row(x, position=position):
                return x[..., position : position + 1, :]

            alone = run_steps([probe], row(logits), row(counts), row(prompt), steps)[:, 0]
            np.testing.assert_array_equal(alone, batched)


def test_different_seeds_draw_different_tokens():
    steps, vocab = 30, VOCAB
    logits = np.zeros((steps, 2, vocab), np.float32)  # uniform: every token equally likely
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    tokens = run_steps(
        params, logits, np.zeros((2, vocab), np.int32), np.zeros((2, vocab), bool), steps
    )
    assert (tokens[:, 0] != tokens[:, 1]).sum() > steps // 2
    assert len(set(tokens[:, 0].tolist())) > 10  # the step index changes the draw too


def test_unseeded_requests_differ_and_a_seeded_rng_reproduces_them():
    params = [SamplingParams()] * 2
    assert not np.array_equal(*np.asarray(SamplerBatch.from_params(params, VOCAB).keys))
    keys_a = SamplerBatch.from_params(params, VOCAB, rng=np.random.default_rng(0)).keys
    keys_b = SamplerBatch.from_params(params, VOCAB, rng=np.random.default_rng(0)).keys
    np.testing.assert_array_equal(np.asarray(keys_a), np.asarray(keys_b))


def test_seed_key_matches_jax_prng_key():
    batch = SamplerBatch.from_params([SamplingParams(seed=12345)], VOCAB)
    np.testing.assert_array_equal(np.asarray(batch.keys[0]), jax.random.PRNGKey(12345))


# --------------------------------------------------------------------------- 4. logprobs


def test_logprobs_are_log_softmax_of_the_processed_logits():
    vocab, eos = 50, (1,)
    params = [
        SamplingParams(temperature=0.7, top_k=8, seed=0, logit_bias={3: 2.0, 4: -5.0}),
        SamplingParams(temperature=0.7, top_k=8, seed=0, logprobs=20),
        SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.3, seed=1),
        SamplingParams(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5),
        SamplingParams(min_p=0.1, min_tokens=4, stop_token_ids=[2], seed=3),
        SamplingParams(seed=4),
        SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.02, seed=5),
    ]
    rows = len(params)
    rng = np.random.default_rng(12)
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    counts = rng.integers(0, 3, (rows, vocab)).astype(np.int32)
    prompt = rng.random((rows, vocab)) < 0.2
    num_generated = np.array([5, 5, 5, 5, 2, 0, 9], np.int32)
    out = sample(
        jnp.asarray(logits),
        SamplerBatch.from_params(params, vocab, eos_ids=eos),
        jnp.asarray(counts),
        jnp.asarray(prompt),
        jnp.asarray(num_generated),
    )
    for i, p in enumerate(params):
        processed = reference_processed(logits[i], p, counts[i], prompt[i], num_generated[i], eos)
        expected = log_softmax(processed)  # greedy rows: temperature 1
        token = int(out.tokens[i])
        assert np.isfinite(expected[token]), "the chosen token must survive the filters"
        np.testing.assert_allclose(float(out.logprobs[i]), expected[token], rtol=1e-5, atol=1e-5)
        top_ids = np.asarray(out.top_ids[i])
        top_values = np.asarray(out.top_logprobs[i])
        np.testing.assert_allclose(
            top_values, np.sort(expected)[::-1][:MAX_LOGPROBS], rtol=1e-5, atol=1e-5
        )
        np.testing.assert_allclose(top_values, expected[top_ids], rtol=1e-5, atol=1e-5)
        assert len(set(top_ids.tolist())) == MAX_LOGPROBS
    assert int(out.tokens[3]) == int(
        np.argmax(reference_processed(logits[3], params[3], counts[3], prompt[3], 5))
    )


def test_top_logprobs_are_skipped_when_no_row_asks():
    out = sample(
        jnp.asarray(random_logits(2)),
        SamplerBatch.from_params([SamplingParams(seed=0), SamplingParams(logprobs=0)], VOCAB),
        *inputs(2),
    )
    assert np.isfinite(np.asarray(out.logprobs)).all()
    assert (np.asarray(out.top_ids) == -1).all()


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(seed=0), SamplingParams()],  # neither pass
        [SamplingParams(temperature=0.8, top_p=0.7, seed=1), SamplingParams()],
        [SamplingParams(top_k=5, seed=2), SamplingParams(logprobs=3)],
        [SamplingParams(top_k=VOCAB, seed=3), SamplingParams(logprobs=0)],  # k >= V is off
    ],
)
def test_static_passes_give_what_the_run_time_choice_gives(params):
    """The passes ``for_params`` decides on the host are the ones the run-time branch takes:
    every output equals the one-program default's, bitwise."""
    passes = SamplerPasses.for_params(params, VOCAB)
    args = (jnp.asarray(random_logits(2, seed=5)), SamplerBatch.from_params(params, VOCAB))
    run_time = sample(*args, *inputs(2))
    static = sample(*args, *inputs(2), passes)
    for field in ("tokens", "logprobs", "top_logprobs", "top_ids"):
        np.testing.assert_array_equal(getattr(static, field), getattr(run_time, field))
    needs_filter = any(p.top_p < 1 or 0 < p.top_k < VOCAB for p in params)
    assert passes == SamplerPasses(needs_filter, any((p.logprobs or 0) > 0 for p in params))


def test_top_n_of_a_large_vocab_equals_lax_top_k():
    logits = jnp.asarray(random_logits(3, vocab=5000, seed=13))
    logits = logits.at[1, 4000].set(logits[1, 17])  # a tie across chunks: lower id first
    values, ids = _top_n(logits, MAX_LOGPROBS)
    expected_values, expected_ids = jax.lax.top_k(logits, MAX_LOGPROBS)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(expected_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(expected_values))


def test_top_logprobs_are_padded_when_vocab_is_small():
    out = sample(
        jnp.asarray(random_logits(1, vocab=5)),
        SamplerBatch.from_params([SamplingParams(seed=0, logprobs=5)], 5),
        *inputs(1, vocab=5),
    )
    assert out.top_ids.shape == (1, MAX_LOGPROBS)
    assert np.asarray(out.top_ids)[0, 5:].tolist() == [-1] * (MAX_LOGPROBS - 5)
    assert np.isneginf(np.asarray(out.top_logprobs)[0, 5:]).all()


# ------------------------------------------------------------------------ 5. validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be in \[0, inf\) .*got -0\.1"),
        ({"temperature": float("nan")}, r"temperature must be in \[0, inf\)"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1\.5"),
        ({"top_k": 0}, r"top_k must be in .*\[1, inf\), got 0"),
        ({"top_k": -2}, r"top_k must be in .*got -2"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\], got -0\.1"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\], got 1\.1"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, inf\), got 0\.0"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2\.5"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\], got -3\.0"),
        ({"max_tokens": 0}, r"max_tokens must be in \[1, inf\), got 0"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, max_tokens=16\], got -1"),
        ({"min_tokens": 17}, r"min_tokens must be in \[0, max_tokens=16\], got 17"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\] or None, got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\] or None, got -1"),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*64 - 1\] or None, got -1"),
        ({"logit_bias": {5: 150.0}}, r"logit_bias\[5\] must be in \[-100, 100\], got 150\.0"),
        ({"logit_bias": {-1: 1.0}}, r"logit_bias token id must be in \[0, vocab_size\)"),
        ({"stop_token_ids": [3, -4]}, r"stop_token_ids entry must be in \[0, vocab_size\)"),
        ({"stop": ["ok", ""]}, r"stop must hold non-empty strings"),
    ],
)
def test_invalid_parameters_raise_naming_parameter_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_wrong_types_are_rejected():
    with pytest.raises(TypeError, match="top_k must be an integer"):
        SamplingParams(top_k=2.5)
    with pytest.raises(TypeError, match="temperature must be a number"):
        SamplingParams(temperature=True)


def test_token_ids_beyond_the_vocab_are_rejected_when_batching():
    with pytest.raises(ValueError, match=r"token id must be in \[0, vocab_size=64\), got 64"):
        SamplerBatch.from_params([SamplingParams(stop_token_ids=[64])], VOCAB)


def test_params_are_canonicalized():
    p = SamplingParams(stop_token_ids=[1, 2], stop="END", top_k=None, temperature=0)
    assert p.stop_token_ids == (1, 2) and p.stop == ("END",) and p.top_k == -1
    assert p.greedy and not SamplingParams().greedy
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 1.0


# ------------------------------------------------------------------------ 6. compilation


def test_changing_parameter_values_never_recompiles():
    rows, vocab = 4, 40
    variants = [
        [SamplingParams(seed=i) for i in range(rows)],
        [SamplingParams(temperature=0.0)] * rows,  # all greedy: the top-k/p branch is skipped
        [
            SamplingParams(temperature=0.3, top_k=5, top_p=0.9, min_p=0.1, seed=1),
            SamplingParams(repetition_penalty=1.5, presence_penalty=1, frequency_penalty=-1),
            SamplingParams(logit_bias={1: 3.0, 2: -3.0}, min_tokens=3, stop_token_ids=[4, 5]),
            None,
        ],
        [SamplingParams(top_p=0.5, ignore_eos=True, logprobs=5, max_tokens=99)] * rows,
    ]
    batches = [SamplerBatch.from_params(v, vocab, eos_ids=(0,)) for v in variants]
    logits = jnp.asarray(random_logits(rows, vocab))
    counts, prompt, _ = inputs(rows, vocab)
    steps = [jnp.full((rows,), s, jnp.int32) for s in range(3)]
    jax.block_until_ready(sample(logits, batches[0], counts, prompt, steps[0]))
    with CompileCounter() as counter:
        for batch in batches:
            for step in steps:
                jax.block_until_ready(sample(logits, batch, counts, prompt, step))
    assert counter.count == 0
    small = SamplerBatch.from_params(variants[0][:2], vocab)
    with CompileCounter() as counter:  # the counter does see a new batch size
        jax.block_until_ready(sample(logits[:2], small, counts[:2], prompt[:2], steps[0][:2]))
    assert counter.count >= 1


# ------------------------------------------------------------------------------ helpers


def test_count_tokens_adds_one_per_active_row():
    counts = jnp.zeros((3, 6), jnp.int32)
    counts = count_tokens(counts, jnp.asarray([2, 2, -1]))
    counts = count_tokens(counts, jnp.asarray([2, 5, 1]), active=jnp.asarray([True, True, False]))
    expected = np.zeros((3, 6), np.int32)
    expected[0, 2], expected[1, 2], expected[1, 5] = 2, 1, 1
    np.testing.assert_array_equal(np.asarray(counts), expected)


def test_count_tokens_promises_unique_indices() -> None:
    """A token a row: no two updates share a place, so the add needs no atomics."""
    counts = jnp.zeros((3, 8), jnp.int32)
    lowered = jax.jit(count_tokens).lower(counts, jnp.asarray([2, 2, -1]))
    assert scatters_promise_unique(lowered)


def test_prompt_token_mask_ignores_padding():
    mask = prompt_token_mask(jnp.asarray([[1, 3, 3, 4], [0, 5, 2, 2]]), jnp.asarray([3, 1]), 6)
    np.testing.assert_array_equal(np.asarray(mask), [[0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
