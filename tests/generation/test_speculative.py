"""Speculative decoding: exact greedy output, the target's sampling distribution, KV rollback."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import HF_BUILDERS, TINY, model_from_hf, random_prompt
from scipy import stats

import spark_jax as sj
from spark_jax.generation import step
from spark_jax.generation.speculative import (
    Draft,
    DraftModelDrafter,
    HeadDrafter,
    LayerSkipDrafter,
    PromptLookupDrafter,
    generate_speculative,
    rejection_sample,
    skip_layers,
    target_logits,
)
from spark_jax.models import draft_head
from spark_jax.ops.sampling import SamplerBatch, sample

GREEDY = sj.SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [random_prompt(21, 9), random_prompt(22, 31), [5, 6, 7, 5, 6, 7, 5, 6]]
P_MIN = 1e-3  # chi-square p-values below this fail a distribution test


class OracleDrafter:
    """Proposes the target's own continuation (``reference``, the full expected output)."""

    def __init__(self, reference: list[int], corrupt_at: int | None = None, idle_every: int = 0):
        self.reference = reference
        self.corrupt_at = corrupt_at  # this draft index is made wrong (partial acceptance)
        self.idle_every = idle_every  # every n-th call proposes nothing (the decode path)
        self.calls = 0

    def start(self, prompt, params, max_context):
        self.prompt_len = len(prompt)
        self.calls = 0

    def propose(self, context, k):
        self.calls += 1
        if self.idle_every and self.calls % self.idle_every == 0:
            return Draft([])
        done = len(context) - self.prompt_len
        tokens = list(self.reference[done : done + k])
        if self.corrupt_at is not None and self.corrupt_at < len(tokens):
            tokens[self.corrupt_at] = (tokens[self.corrupt_at] + 1) % 128
        return Draft(tokens)

    def finish(self):
        pass


class WrongDrafter(OracleDrafter):
    """Always wrong: every proposal differs from the target's next token."""

    def propose(self, context, k):
        done = len(context) - self.prompt_len
        return Draft([(t + 1) % 128 for t in self.reference[done : done + k]])


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama[1]


@pytest.fixture(scope="module")
def references(model):
    return [sj.generate(model, p, GREEDY).output_tokens for p in PROMPTS]


@pytest.fixture(scope="module")
def draft_model():
    torch.manual_seed(1)
    return model_from_hf(HF_BUILDERS["llama_tied"]().eval())


@pytest.fixture(scope="module")
def device_drafters(model, draft_model):
    """The device drafters, built once: each compiles its own speculative chunk."""
    config = draft_head.head_config(model.config, intermediate_size=32, num_heads=2)
    head = draft_head.init_params(config, jax.random.PRNGKey(3))
    return {
        "draft_model": DraftModelDrafter(draft_model),
        "layer_skip": LayerSkipDrafter(model, skip=[1]),
        "self_draft": DraftModelDrafter(model),
        "head": HeadDrafter(model, (head, config)),
    }


DRAFTERS = ["ngram", "draft_model", "layer_skip", "self_draft", "head", "oracle", "wrong"]


def make_drafter(name, device_drafters, reference):
    if name in device_drafters:
        return device_drafters[name]
    return {
        "ngram": lambda: PromptLookupDrafter(max_ngram=3, min_ngram=1),
        "oracle": lambda: OracleDrafter(reference),
        "wrong": lambda: WrongDrafter(reference),
    }[name]()


# ---------------------------------------------------------------------------------------------
# Greedy: exactly the tokens of sj.generate.


# Every drafter a user can name at every K; the test drafters (a model drafting for itself,
# an oracle, one always wrong: acceptance 1, 1 and 0) at one K, each K compiling a chunk.
GRID = [(name, k) for name in DRAFTERS[:5] if name != "self_draft" for k in (1, 2, 4, 8)]
GRID += [("self_draft", 4), ("oracle", 4), ("wrong", 4), ("oracle", 8)]


@pytest.mark.parametrize("name, num_drafts", GRID)
def test_greedy_output_is_token_identical_to_generate(
    model, device_drafters, references, name, num_drafts
):
    for prompt, reference in zip(PROMPTS, references, strict=True):
        drafter = make_drafter(name, device_drafters, reference)
        result = generate_speculative(model, prompt, GREEDY, num_drafts, drafter)
        assert result.output_tokens == reference
        assert result.finish_reason == "length"
        s = result.spec_stats
        assert s["num_accepted"] <= s["num_drafted"] and s["verify_steps"] >= 1
        if name in ("oracle", "self_draft"):
            assert s["acceptance_rate"] == 1.0
        if name == "wrong":
            assert s["acceptance_rate"] == 0.0 and s["tokens_per_step"] == 1.0


def test_drafters_are_chosen_by_name_and_unknown_names_are_refused(model, references):
    result = generate_speculative(model, PROMPTS[2], GREEDY, 4, drafter="ngram")
    assert result.output_tokens == references[2]
    assert result.spec_stats["num_accepted"] > 0  # the prompt repeats itself
    skipped = generate_speculative(model, PROMPTS[0], GREEDY, 2, "layer-skip", skip=[0])
    assert skipped.output_tokens == references[0]
    with pytest.raises(ValueError, match="ngram, draft, layer-skip, head"):
        generate_speculative(model, PROMPTS[0], GREEDY, 4, drafter="nope")
    with pytest.raises(ValueError, match="draft_model"):
        generate_speculative(model, PROMPTS[0], GREEDY, 4, drafter="draft")
    assert model.slot_pool.in_use == 0


def test_device_drafters_run_several_steps_per_host_sync(model, device_drafters, references):
    """The chunk's record holds every step: a finished request needs a few syncs, and the
    output does not depend on how many steps a chunk runs."""
    drafter = device_drafters["self_draft"]
    for steps in (1, 3, 16):
        loop = sj.LoopOptions(steps_per_sync=steps)
        result = generate_speculative(model, PROMPTS[1], GREEDY, 2, drafter, loop=loop)
        assert result.output_tokens == references[1]
        assert result.spec_stats["acceptance_rate"] == 1.0  # the target drafting for itself


def test_prompt_lookup_proposes_the_continuation_of_the_most_recent_match():
    drafter = PromptLookupDrafter(max_ngram=2, min_ngram=1)
    assert drafter.propose([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 3).tokens == [4, 8, 1]
    assert drafter.propose([7, 5, 6, 9, 5], 2).tokens == [6, 9]  # falls back to one token
    assert drafter.propose([1, 2, 3], 4).tokens == []
    # A continuation that reaches the end copies on from what it proposed (period 1, then 3).
    assert drafter.propose([4, 4], 3).tokens == [4, 4, 4]
    assert drafter.propose([1, 2, 3, 1, 2], 5).tokens == [3, 1, 2, 3, 1]


def test_penalties_stops_and_logprobs_match_generate(model):
    prompt = PROMPTS[1]
    params = sj.SamplingParams(
        temperature=0.0,
        max_tokens=18,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        logit_bias={5: 2.0, 17: -1.0},
        min_tokens=3,
        logprobs=3,
        ignore_eos=True,
    )
    expected = sj.generate(model, prompt, params)
    stop_at = expected.output_tokens[9]
    stopped = dataclasses.replace(params, stop_token_ids=(stop_at,))
    expected_stop = sj.generate(model, prompt, stopped)
    for p, want in ((params, expected), (stopped, expected_stop)):
        for drafter in (OracleDrafter(want.output_tokens), PromptLookupDrafter()):
            got = generate_speculative(model, prompt, p, 4, drafter)
            assert got.output_tokens == want.output_tokens
            assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
            for a, b in zip(got.logprobs, want.logprobs, strict=True):
                assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
                np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-4)
    assert expected_stop.finish_reason == "stop"


def test_one_verify_compile_per_num_drafts(model, references):
    step.pick.clear_cache()
    step.one_step.clear_cache()
    for prompt, reference in zip(PROMPTS, references, strict=True):
        generate_speculative(model, prompt, GREEDY, 4, OracleDrafter(reference, corrupt_at=2))
    assert step.pick._cache_size() == 1  # the first token, after the prefill
    # The verify step (every step pads to K = 4 drafts), and the decode step taken where no
    # draft fits before max_tokens.
    assert step.one_step._cache_size() == 2


def test_a_batch_is_refused_and_slots_are_given_back(model):
    with pytest.raises(ValueError, match="one sequence"):
        generate_speculative(model, [[1, 2], [3, 4]], GREEDY)

    class Exploding(PromptLookupDrafter):
        def propose(self, context, k):
            raise RuntimeError("drafter broke")

    with pytest.raises(RuntimeError, match="drafter broke"):
        generate_speculative(model, PROMPTS[0], GREEDY, 4, Exploding())
    assert model.slot_pool.in_use == 0


def test_layer_skip_model_is_the_target_without_those_layers(model):
    skipped = skip_layers(model, [0])
    assert skipped.config.num_layers == 1
    assert skipped.params["layers_0"] is model.params["layers_1"]
    with pytest.raises(ValueError, match="every layer"):
        skip_layers(model, [0, 1])
    with pytest.raises(ValueError, match="outside"):
        skip_layers(model, [2])


# ---------------------------------------------------------------------------------------------
# KV rollback: after rejected drafts the cache holds exactly the accepted sequence.


class RecordingRunner:
    """The target's runner, recording the start position, tokens and logits of every step
    (its verify and decode steps run inside the generation core's jitted chunk, so the
    record is taken on the device, by a callback)."""

    def __init__(self, runner):
        self.runner = runner
        self.steps: list[tuple[int, np.ndarray, int, np.ndarray]] = []
        self.verify_fn = self._recorded(runner.verify_fn, verify=True)
        self.decode_fn = self._recorded(runner.decode_fn, verify=False)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _recorded(self, fn, verify: bool):
        def step(params, tokens, lengths_or_active, state, lora):
            start = state.lengths[0]
            logits, state = fn(params, tokens, lengths_or_active, state, lora)
            real = lengths_or_active[0] if verify else jnp.int32(1)
            jax.debug.callback(self._append, start, tokens, real, logits, verify)
            return logits, state

        return step

    def _append(self, start, tokens, real, logits, verify) -> None:
        if verify:
            tokens, logits = tokens[0], logits[0]
        self.steps.append((int(start), np.asarray(tokens), int(real), np.asarray(logits)))


def test_after_rejections_every_step_sees_a_fresh_prefill_of_the_accepted_sequence(
    model, references
):
    recording = RecordingRunner(model.runner)
    spy = sj.Model(model.config, model.params, runner=recording)
    prompt, reference = PROMPTS[1], references[1]
    drafter = OracleDrafter(reference, corrupt_at=2, idle_every=3)  # 2 of 4 kept, some decodes
    result = generate_speculative(spy, prompt, GREEDY, 4, drafter)
    assert result.output_tokens == reference
    assert 0 < result.spec_stats["acceptance_rate"] < 1
    sequence = prompt + reference
    fresh = model.logits(sequence)
    assert len(recording.steps) > 5
    for start, tokens, real, logits in recording.steps:
        # Step tokens sit right after the accepted sequence: the first is its last token...
        assert tokens[0] == sequence[start]
        kept = 1
        while kept < real and tokens[kept] == sequence[start + kept]:
            kept += 1
        # ...and the logits of it and of the accepted drafts are those of one fresh prefill.
        np.testing.assert_allclose(logits[:kept], fresh[start : start + kept], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Sampling: the output follows the target's distribution whatever the draft distribution.


def chi_square_p(samples: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(samples, minlength=len(probs))
    probs = np.asarray(probs, np.float64)
    expected = probs / probs.sum() * len(samples)
    return stats.chisquare(observed, expected).pvalue


def skewed_draft_probs(p: np.ndarray) -> np.ndarray:
    """A bad q: 0.6 on each row's least likely token, nothing on its most likely one."""
    k, vocab = p.shape
    q = np.full((k, vocab), 0.4 / (vocab - 2))
    q[np.arange(k), p.argmin(-1)] = 0.6
    q[np.arange(k), p.argmax(-1)] = 0.0
    return q


def test_rejection_rule_gives_the_target_distribution_with_a_bad_draft():
    vocab, k, n = 16, 3, 40_000
    rng = np.random.RandomState(0)
    p = np.asarray(jax.nn.softmax(jnp.asarray(rng.normal(size=(k + 1, vocab)) * 1.2)))
    q = skewed_draft_probs(p[:k])
    draft_keys, accept_keys = jnp.split(jax.random.split(jax.random.PRNGKey(0), 2 * n), 2)
    drafts = jax.vmap(lambda key: jax.random.categorical(key, jnp.log(q)))(draft_keys)
    verify_all = jax.jit(jax.vmap(rejection_sample, in_axes=(None, 0, None, None, 0)))
    accepted, following = verify_all(jnp.asarray(p), drafts, jnp.asarray(q), k, accept_keys)
    accepted, following, drafts = map(np.asarray, (accepted, following, drafts))
    tokens = np.where(np.arange(k + 1) < accepted[:, None], np.pad(drafts, ((0, 0), (0, 1))), -1)
    tokens[np.arange(n), accepted] = following
    for position in range(k):
        reached = tokens[accepted >= position, position]  # rows whose output got this far
        assert len(reached) > 2000
        assert chi_square_p(reached, p[position]) > P_MIN
        assert chi_square_p(drafts[:, position], p[position]) < 1e-12  # q really is bad
    assert 0 < accepted.mean() < 1


def test_target_distribution_is_the_one_sample_draws_from():
    vocab = 64
    params = [
        dict(temperature=0.7, top_k=10, repetition_penalty=1.2),
        dict(temperature=1.3, top_p=0.8, presence_penalty=0.5, seed=1),
        dict(temperature=0.0, frequency_penalty=0.3, logit_bias={3: 5.0}),
        dict(temperature=1.0, min_p=0.05, min_tokens=4, stop_token_ids=[7, 9]),
    ]
    params = [sj.SamplingParams(**p, logprobs=20) for p in params]
    rng = np.random.RandomState(3)
    batch = SamplerBatch.from_params(params, vocab, eos_ids=[1])
    logits = jnp.asarray(rng.normal(size=(4, vocab)) * 2, jnp.float32)
    counts = jnp.asarray(rng.poisson(0.3, size=(4, vocab)), jnp.int32)
    prompt_mask = jnp.asarray(rng.rand(4, vocab) < 0.2)
    num_generated = jnp.asarray([0, 2, 5, 3], jnp.int32)
    out = sample(logits, batch, counts, prompt_mask, num_generated)
    processed, greedy = target_logits(logits, batch, counts, prompt_mask, num_generated)
    top = jax.lax.top_k(jax.nn.log_softmax(processed, axis=-1), 20)[0]
    np.testing.assert_allclose(np.asarray(top), np.asarray(out.top_logprobs), atol=1e-5)
    assert int(greedy[2]) == int(out.tokens[2])


class SkewedDrafter:
    """Drafts i.i.d. from a fixed skewed q, with its own seeded stream."""

    def __init__(self, q: np.ndarray, seed: int):
        self.q = q
        self.rng = np.random.RandomState(seed)

    def start(self, prompt, params, max_context):
        pass

    def propose(self, context, k):
        tokens = self.rng.choice(len(self.q), size=k, p=self.q).tolist()
        return Draft(tokens, jnp.asarray(np.tile(self.q, (k, 1)), jnp.float32))

    def finish(self):
        pass


def exact_marginals(model, prompt: list[int], vocab: int) -> list[np.ndarray]:
    """P(token at output position 0, 1, 2) under plain sampling at temperature 1."""
    pairs = np.array([(a, b) for a in range(vocab) for b in range(vocab)], np.int32)
    tokens = np.concatenate([np.tile(prompt, (len(pairs), 1)), pairs], axis=1)
    state = model.runner.init_state(len(pairs), 16)
    lengths = jnp.full((len(pairs),), tokens.shape[1], jnp.int32)
    logits, _ = model.runner.verify(state, jnp.asarray(tokens), lengths)
    probs = np.asarray(jax.nn.softmax(logits[:, len(prompt) - 1 :], axis=-1), np.float64)
    p0 = probs[0, 0]  # [V]
    p1 = probs[::vocab, 1]  # [a, V]: after first token a
    p2 = probs[:, 2].reshape(vocab, vocab, vocab)  # [a, b, V]
    m1 = p0 @ p1
    m2 = np.einsum("a,ab,abv->v", p0, p1, p2)
    return [p0, m1, m2]


def test_sampled_output_follows_the_target_distribution_end_to_end():
    vocab, runs = 16, 800
    torch.manual_seed(5)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**TINY, "vocab_size": vocab, "num_hidden_layers": 1})
    config.initializer_range = 0.3  # peaked distributions, so the skewed draft matters
    model = model_from_hf(LlamaForCausalLM(config).eval())
    prompt = [3, 1, 4, 1, 5]
    marginals = exact_marginals(model, prompt, vocab)
    q = np.full(vocab, 0.1 / (vocab - 1))
    q[marginals[1].argmin()] = 0.9
    outputs, accepted, drafted = [], 0, 0
    for seed in range(runs):
        params = sj.SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)
        result = generate_speculative(model, prompt, params, 2, SkewedDrafter(q, seed))
        outputs.append(result.output_tokens)
        accepted += result.spec_stats["num_accepted"]
        drafted += result.spec_stats["num_drafted"]
    outputs = np.asarray(outputs)
    for position in (1, 2):  # the drafted positions
        assert chi_square_p(outputs[:, position], marginals[position]) > P_MIN
    assert 0 < accepted / drafted < 0.5


def test_seeded_sampling_is_reproducible(model, device_drafters):
    params = sj.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7)
    for name in ("draft_model", "head"):
        drafter = device_drafters[name]
        runs = [generate_speculative(model, PROMPTS[0], params, 3, drafter) for _ in range(2)]
        assert runs[0].output_tokens == runs[1].output_tokens


# ---------------------------------------------------------------------------------------------
# A real model: SmolLM2-135M-Instruct quoting a passage, with prompt lookup.

PASSAGE = (
    "The lighthouse stood on a narrow spit of rock at the mouth of the harbour. Every night "
    "its keeper climbed the one hundred and twelve steps to the lamp room, trimmed the wick, "
    "polished the great lens and wound the clockwork that turned it. Ships passing in the dark "
    "counted the flashes to know which coast they had reached."
)


@pytest.mark.slow
def test_smollm2_quoting_a_passage_accepts_most_prompt_lookup_drafts(smollm2):
    ask = "Repeat the following passage word for word, without any changes:\n\n" + PASSAGE
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": ask}])
    params = sj.SamplingParams(temperature=0.0, max_tokens=64)
    plain = sj.generate(smollm2, prompt, params)
    spec = generate_speculative(smollm2, prompt, params, 8)
    assert spec.output_tokens == plain.output_tokens
    assert "lighthouse" in spec.text
    s = spec.spec_stats
    print(
        f"\nSmolLM2 prompt lookup K=8: acceptance {s['acceptance_rate']:.2f}, "
        f"{s['tokens_per_step']:.2f} tokens per target step"
    )
    assert s["acceptance_rate"] > 0.5 and s["tokens_per_step"] > 3
    stop = sj.SamplingParams(temperature=0.0, max_tokens=64, stop=("great lens",))
    want = sj.generate(smollm2, prompt, stop)
    got = generate_speculative(smollm2, prompt, stop, num_drafts=8)
    assert (got.output_tokens, got.text, got.stop_reason) == (
        want.output_tokens,
        want.text,
        want.stop_reason,
    )
    assert want.stop_reason == "great lens"


# ---------------------------------------------------------------------------------------------
# LoRA: the request's adapter applies when the target verifies.


def test_the_requests_adapter_applies_when_verifying(tiny_llama, tmp_path_factory):
    from helpers import add_peft_adapters

    hf, _ = tiny_llama
    adapted = model_from_hf(hf)
    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    add_peft_adapters(adapted, hf, {"a": lora}, tmp_path_factory)
    params = dataclasses.replace(GREEDY, adapter="a")
    want = sj.generate(adapted, PROMPTS[1], params).output_tokens
    assert want != sj.generate(adapted, PROMPTS[1], GREEDY).output_tokens  # the adapter matters
    for drafter in (OracleDrafter(want), DraftModelDrafter(adapted)):
        got = generate_speculative(adapted, PROMPTS[1], params, 4, drafter)
        assert got.output_tokens == want
    with pytest.raises(ValueError, match="nope"):
        generate_speculative(adapted, PROMPTS[1], dataclasses.replace(GREEDY, adapter="nope"))
