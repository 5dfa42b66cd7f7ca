"""Guided decoding: outputs held to a JSON schema, regex, choice or grammar, per row.

The oracles are llguidance's own bitmask (``llguidance.numpy``), ``jsonschema`` and ``re`` on
what the real SmolLM2 writes, and unconstrained generation for the free rows of a batch. The
tiny random model has a byte-level tokenizer of 262 tokens over a vocabulary of 288 (the ids
past the tokenizer's must never be picked).
"""

from __future__ import annotations

import dataclasses
import json
import re

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
from helpers import TINY, CompileCounter, model_from_hf, random_prompt, tiny_bpe_vocab

import spark_jax as sj
from spark_jax.generation.guided import guided_from_request
from spark_jax.ops.sampling import GuidedDecodingParams, apply_token_bitmask
from spark_jax.serving.engine import Engine
from spark_jax.tokenizer import Tokenizer

TOKENIZER_VOCAB, MODEL_VOCAB = 262, 288


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> sj.Model:
    """A tiny random Llama whose tokenizer is a byte-level BPE (EOS: <|im_end|>, id 2)."""
    import torch
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokens, types, merges = tiny_bpe_vocab()
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split()) for m in merges]
    )
    hf_tokenizer = HFTokenizer(bpe)
    hf_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf_tokenizer.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == 3]
    hf_tokenizer.add_special_tokens([AddedToken(t, special=True) for t in specials])
    directory = tmp_path_factory.mktemp("tiny_tokenizer")
    hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tokenizer = Tokenizer.from_dir(directory)
    assert tokenizer.vocab_size == TOKENIZER_VOCAB and tokenizer.eos_token_id == 2
    torch.manual_seed(3)
    config = LlamaConfig(**{**TINY, "vocab_size": MODEL_VOCAB, "eos_token_id": 2})
    return model_from_hf(LlamaForCausalLM(config).eval(), tokenizer)


def guided(**kwargs) -> GuidedDecodingParams:
    return GuidedDecodingParams(**kwargs)


SHORT_OBJECT = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}


def mixed_batch(max_tokens: int) -> tuple[list[list[int]], list[sj.SamplingParams]]:
    """Six rows: guided (JSON, regex, choice; greedy and sampled) between free ones (greedy,
    penalized, sampled)."""
    constraints = [
        guided(json=SHORT_OBJECT, disable_any_whitespace=True),
        None,
        guided(regex=r"[a-z]{1,3}[0-9]"),
        None,
        guided(choice=["alpha", "beta", "gamma"]),
        None,
    ]
    knobs = [
        dict(temperature=0.0),
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.9, seed=5),
        dict(temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        dict(temperature=0.0),
        dict(temperature=1.0, seed=7, ignore_eos=True),
    ]
    prompts = [random_prompt(40 + i, 3 + 4 * i, TOKENIZER_VOCAB) for i in range(len(knobs))]
    params = [
        sj.SamplingParams(max_tokens=max_tokens, guided=g, **k)
        for g, k in zip(constraints, knobs, strict=True)
    ]
    return prompts, params


def holds(params: sj.SamplingParams, result: sj.GenerationResult) -> bool:
    """The finished text keeps its constraint (a cut-off one is only ever a prefix)."""
    g = params.guided
    if g.choice is not None:
        return result.text in g.choice
    if g.regex is not None:
        return re.fullmatch(g.regex, result.text) is not None
    jsonschema.validate(json.loads(result.text), g.json)
    return True


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(json={"type": "nonsense"}), "guided json schema is invalid: .*nonsense"),
        (dict(json='{"type": '), "guided json schema is invalid"),
        (dict(json={"type": "string", "pattern": "("}), "guided json schema is invalid"),
        (dict(regex="a{3"), "guided regex is invalid: .*repetition"),
        (dict(grammar="start: undefined_rule"), "guided grammar is invalid: .*undefined_rule"),
        (dict(choice=[]), "guided choice must be a list of non-empty strings"),
        (dict(choice="yes"), "guided choice must be a list"),
        (dict(regex="a", choice=["a"]), "exactly one of .*; got regex, choice"),
        (dict(), "exactly one of .*; got none"),
    ],
)
def test_an_invalid_constraint_is_refused_at_construction_naming_what_is_wrong(kwargs, message):
    # llguidance's own message follows on more lines (with a pointer into the text).
    with pytest.raises(ValueError, match=f"(?s){message}"):
        GuidedDecodingParams(**kwargs)


def test_guided_must_be_guided_decoding_params():
    with pytest.raises(TypeError, match="guided must be a GuidedDecodingParams"):
        sj.SamplingParams(guided={"json": {}})


def test_the_token_bitmask_masks_what_llguidance_masks():
    from llguidance.numpy import apply_token_bitmask_inplace

    rng = np.random.default_rng(0)
    for rows, vocab in ((3, 77), (2, 64), (1, 5)):
        logits = rng.standard_normal((rows, vocab)).astype(np.float32)
        bitmask = rng.integers(-(2**31), 2**31, (rows, -(-vocab // 32))).astype(np.int32)
        bitmask[0] = -1  # a free row
        expected = logits.copy()
        apply_token_bitmask_inplace(expected, bitmask)
        ours = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
        np.testing.assert_array_equal(ours, expected)
        np.testing.assert_array_equal(ours[0], logits[0])


# ------------------------------------------------------------------------- request fields


def test_openai_and_vllm_request_fields_map_to_their_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert guided_from_request({}) is None
    assert guided_from_request({"response_format": {"type": "text"}}) is None
    assert guided_from_request({"response_format": {"type": "json_object"}}) == guided(
        json_object=True
    )
    body = {
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    }
    assert guided_from_request(body) == guided(json=schema)
    assert guided_from_request({"guided_json": schema}) == guided(json=schema)
    assert guided_from_request({"guided_regex": "[0-9]+"}) == guided(regex="[0-9]+")
    assert guided_from_request({"guided_choice": ["a", "b"]}) == guided(choice=("a", "b"))
    assert guided_from_request({"guided_grammar": 'start: "x"'}) == guided(grammar='start: "x"')
    spaced = guided_from_request({"guided_json": schema, "guided_whitespace_pattern": "[ ]?"})
    assert spaced == guided(json=schema, whitespace_pattern="[ ]?")


@pytest.mark.parametrize(
    "body, message",
    [
        ({"response_format": {"type": "yaml"}}, "response_format must have type"),
        ({"response_format": "json"}, "response_format must have type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "^response_format.json_schema.schema: guided json schema is invalid",
        ),
        ({"guided_json": 3}, "^guided_json: guided json must be"),
        ({"guided_regex": "("}, "^guided_regex: guided regex is invalid"),
        ({"guided_choice": "ab"}, "^guided_choice: guided choice must be a list"),
        ({"guided_grammar": "start: nowhere"}, "^guided_grammar: guided grammar is invalid"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex and guided_choice each"),
        (
            {"response_format": {"type": "json_object"}, "guided_json": {}},
            "response_format and guided_json each",
        ),
    ],
)
def test_a_malformed_request_field_is_a_value_error_naming_it(body, message):
    with pytest.raises(ValueError, match=f"(?s){message}"):
        guided_from_request(body)


# ------------------------------------------------------------------- mixed batches (tiny)


@pytest.fixture(scope="module")
def mixed(tiny):
    """The mixed batch run as one batch and row by row: (prompts, params, batch, alone)."""
    prompts, params = mixed_batch(max_tokens=10)
    batch = sj.generate_batch(tiny, prompts, params)
    alone = [sj.generate(tiny, p, sp) for p, sp in zip(prompts, params, strict=True)]
    return prompts, params, batch, alone


def test_each_row_of_a_mixed_batch_gives_what_it_gives_alone(tiny, mixed):
    prompts, params, batch, alone = mixed
    assert [r.output_tokens for r in batch] == [r.output_tokens for r in alone]
    assert [r.finish_reason for r in batch] == [r.finish_reason for r in alone]
    free = [i for i, p in enumerate(params) if p.guided is None]
    unconstrained = sj.generate_batch(tiny, [prompts[i] for i in free], [params[i] for i in free])
    assert [batch[i].output_tokens for i in free] == [r.output_tokens for r in unconstrained]
    for p, result in zip(params, batch, strict=True):
        if p.guided is not None:
            assert max(result.output_tokens) < TOKENIZER_VOCAB
            assert result.finish_reason == "length" or holds(p, result)
    # Where nothing stops it, the random model does pick ids that no text has.
    assert max(max(batch[i].output_tokens) for i in free) >= TOKENIZER_VOCAB
    assert batch[4].finish_reason == "stop" and batch[4].text in ("alpha", "beta", "gamma")
    free_choice = sj.SamplingParams(temperature=0.0, max_tokens=10)
    assert sj.generate(tiny, prompts[4], free_choice).output_tokens != batch[4].output_tokens


def test_a_guided_row_stops_when_its_grammar_is_complete(tiny):
    params = sj.SamplingParams(temperature=0.0, max_tokens=40, guided=guided(choice=["beta"]))
    result = sj.generate(tiny, random_prompt(1, 6, TOKENIZER_VOCAB), params)
    assert result.text == "beta" and result.finish_reason == "stop"
    assert result.output_tokens == tiny.tokenizer.encode("beta")  # ended without EOS
    assert result.stop_reason is None


def test_streamed_guided_tokens_are_the_generated_ones(tiny, mixed):
    prompts, params, _, alone = mixed
    for i in (0, 2):
        events = list(sj.stream(tiny, prompts[i], params[i]))
        final = events[-1]
        assert [e.token_id for e in events[:-1]] == final.output_tokens == alone[i].output_tokens
        assert "".join(e.text_delta for e in events[:-1]) == final.text == alone[i].text


def test_a_batch_of_the_same_shape_and_another_mix_compiles_nothing(tiny, mixed):
    prompts, params, *_ = mixed
    shifted = params[1:] + params[:1]  # other rows guided, each by another kind
    with CompileCounter() as counter:
        sj.generate_batch(tiny, prompts, shifted)
    assert counter.count == 0


def test_a_guided_step_is_a_forward_and_a_pick_whose_buffers_keep_their_addresses(
    tiny, mixed, monkeypatch
):
    # The matcher overlaps the forward only with the step in two programs; each stays a
    # dispatch: the pick never takes the cache, and each forward takes over the spent logits'
    # buffer (every buffer of the forward keeps its address: its CUDA graph runs as recorded).
    import spark_jax.generation.generate as generate

    calls, logits_buffers = [], []

    def forward(*args, **kwargs):
        logits, carry = real_forward(*args, **kwargs)
        calls.append("forward")
        logits_buffers.append(logits.unsafe_buffer_pointer())
        return logits, carry

    def pick(rule, logits, carry, rows):
        calls.append("pick")
        assert carry.state is None and rows.allowed is not None
        return real_pick(rule, logits, carry, rows)

    real_forward, real_pick = generate.forward, generate.pick
    monkeypatch.setattr(generate, "forward", forward)
    monkeypatch.setattr(generate, "pick", pick)
    prompts, params, batch, _ = mixed
    results = sj.generate_batch(tiny, prompts, params)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in batch]
    steps = max(len(r.output_tokens) for r in results)
    assert calls == ["pick"] + ["forward", "pick"] * (steps - 1)  # the prefill's pick first
    assert len(set(logits_buffers)) == 1
    timings = results[0].timings
    assert timings["host_syncs"] == steps and timings["mask_s"] > 0
    assert 0 < timings["wait_s"] + timings["dispatch_s"] < timings["total_s"]


def test_free_rows_in_split_steps_give_the_fused_loops_tokens(tiny, mixed):
    prompts, params, *_ = mixed
    free = [dataclasses.replace(p, guided=None) for p in params]
    split = sj.LoopOptions(split_step=True)
    fused = sj.generate_batch(tiny, prompts, free)
    assert [r.output_tokens for r in sj.generate_batch(tiny, prompts, free, loop=split)] == [
        r.output_tokens for r in fused
    ]


# -------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine(tiny) -> Engine:
    # Prompts of up to 23 tokens and 10 new ones: max_model_len 64 keeps the warm-up small.
    engine = Engine(tiny, max_num_seqs=8, max_batch_tokens=64, page_size=16, max_model_len=64)
    engine.warmup()
    return engine


def test_a_warmed_engine_gives_solo_results_and_never_compiles_across_mixes(tiny, mixed, engine):
    prompts, params, batch, _ = mixed
    mixes = [
        params,  # guided and free
        [dataclasses.replace(p, guided=None) for p in params],  # all free
        [dataclasses.replace(p, guided=params[4].guided) for p in params],  # all guided
    ]
    with CompileCounter() as counter:
        results = [engine.generate_many(prompts, mix) for mix in mixes]
    assert counter.count == 0
    # generate_batch's rows are their solo results (above): the engine's must be them too.
    expected = [batch] + [sj.generate_batch(tiny, prompts, mix) for mix in mixes[1:]]
    for got, want in zip(results, expected, strict=True):
        assert [r.output_tokens for r in got] == [r.output_tokens for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    assert {r.text for r in results[2] if r.finish_reason == "stop"} <= {"alpha", "beta", "gamma"}
    assert engine.slots_in_use == 0 and engine.pages_in_use == 0


def test_the_engine_reads_a_guided_rows_step_while_the_next_forward_runs(tiny, engine, monkeypatch):
    """With a guided row's token in flight, a step dispatches the decode forward, then reads
    the step before (the matcher advances), then picks with the mask: the matcher's work
    overlaps the forward. The output is the one generate gives."""
    from spark_jax.serving import executor

    events: list[str] = []
    decode, read = engine.executor.runner.decode, executor.Picks.read

    def logged_decode(*args, **kwargs):
        events.append("forward")
        return decode(*args, **kwargs)

    def logged_read(picks):
        events.append("read")
        return read(picks)

    monkeypatch.setattr(engine.executor.runner, "decode", logged_decode)
    monkeypatch.setattr(executor.Picks, "read", logged_read)
    params = sj.SamplingParams(temperature=0.0, max_tokens=8, guided=guided(regex=r"[a-z]{8}"))
    prompt = random_prompt(77, 5, TOKENIZER_VOCAB)
    request = engine.add_request(prompt, params)
    steps, result = [], None
    while result is None:
        events.clear()
        outputs = engine.step()
        steps.append(list(events))
        result = next((o.result for o in outputs if o.request_id == request and o.finished), None)
    both = [e for e in steps if "forward" in e and "read" in e]
    assert len(both) >= 5  # every decode step after the first has a token in flight
    assert all(e.index("forward") < e.index("read") for e in both), steps
    assert result.output_tokens == sj.generate(tiny, prompt, params).output_tokens
    assert re.fullmatch(r"[a-z]{8}", result.text)


def test_guided_rows_preempted_with_a_token_in_flight_give_their_solo_results(tiny, mixed):
    """A page pool too small for the mixed batch: rows are preempted, guided ones while a
    token is in flight (the engine reads it inside the next step), and recomputed; each
    request's output is still its solo result, and every page and slot is given back."""
    prompts, params, _, alone = mixed
    engine = Engine(
        tiny, max_num_seqs=8, max_batch_tokens=64, page_size=16, max_model_len=64, kv_pages=6
    )
    results = engine.generate_many(prompts, params)
    assert engine.num_preemptions > 0
    guided_rows = [r for r, p in zip(results, params, strict=True) if p.guided is not None]
    assert any(r.timings["preemptions"] > 0 for r in guided_rows)
    assert [r.output_tokens for r in results] == [r.output_tokens for r in alone]
    assert [r.finish_reason for r in results] == [r.finish_reason for r in alone]
    assert engine.slots_in_use == 0 and engine.pages_in_use == 0


def test_guided_requests_a_tokenizer_cannot_serve_are_refused_before_any_work(tiny_llama):
    _, no_tokenizer = tiny_llama
    params = sj.SamplingParams(max_tokens=4, guided=guided(regex="[a-z]+"))
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        sj.generate(no_tokenizer, [1, 2, 3], params)
    assert no_tokenizer.slot_pool.in_use == 0
    engine = Engine(no_tokenizer, max_num_seqs=2, max_batch_tokens=32, page_size=16)
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        engine.generate_many([[1, 2], [3, 4]], [sj.SamplingParams(max_tokens=2), params])
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="speculative decoding does not apply guided"):
        sj.generate_speculative(no_tokenizer, [1, 2, 3], params)


# ------------------------------------------------------------------------- SmolLM2 (real)


def _object(properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _integer(low: int, high: int) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high}


def _string(longest: int) -> dict:
    return {"type": "string", "maxLength": longest, "pattern": "^[A-Za-z ]*$"}


# Short strings of letters (an emoji is several tokens) and numbers with a step (multipleOf):
# every answer fits in few tokens.
SCHEMAS = {
    "a person": _object({"name": _string(12), "age": _integer(0, 120)}),
    "a mailing address": _object(
        {
            "address": _object(
                {"city": _string(12), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}
            )
        }
    ),
    "a flag's colors": _object(
        {
            "colors": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue", "white"]},
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),
    "today's weather": _object(
        {
            "temperature": {"type": "number", "minimum": -50, "maximum": 50, "multipleOf": 0.1},
            "unit": {"enum": ["C", "F"]},
        }
    ),
    "a product in a shop": _object({"in_stock": {"type": "boolean"}, "count": _integer(0, 1000)}),
    "a shopping list": _object(
        {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": _object({"id": _integer(1, 99), "tag": _string(8)}),
            }
        }
    ),
    "an HTTP response": _object(
        {"status": {"enum": ["ok", "error", "pending"]}, "code": _integer(100, 599)}
    ),
    "a small matrix": _object(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "maxItems": 2, "items": _integer(0, 9)},
            }
        }
    ),
    "a film": _object(
        {
            "title": _string(16),
            "year": _integer(1900, 2030),
            "rating": {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5},
        },
        required=["title", "year"],
    ),
    "a user account": _object(
        {
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            "verified": {"type": "boolean"},
        }
    ),
}
ASKS = ("Give {} as JSON.", "Describe {} in JSON.", "Write a JSON object for {}.")
REGEXES = (r"[0-9]{3}-[0-9]{4}", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])")
CHOICES = (("Paris", "London", "Berlin"), ("yes", "no"))


def test_smollm2_outputs_validate_against_their_schemas_greedy_and_sampled(smollm2):
    """30 prompts over 10 schemas, greedy and sampled, with regex and choice rows: one batch."""
    chat = lambda text: smollm2.tokenizer.encode_chat([{"role": "user", "content": text}])
    prompts, params = [], []
    for temperature in (0.0, 0.8):
        knobs = lambda t=temperature: dict(temperature=t, seed=len(params), max_tokens=48)
        for what, schema in SCHEMAS.items():
            for ask in ASKS:
                prompts.append(chat(ask.format(what)))
                constraint = guided(json=schema, disable_any_whitespace=True)
                params.append(sj.SamplingParams(guided=constraint, **knobs()))
        for regex in REGEXES:
            prompts.append(chat("Give a phone number or a date."))
            params.append(sj.SamplingParams(guided=guided(regex=regex), **knobs()))
        for choice in CHOICES:
            prompts.append(chat("What is the capital of France?"))
            params.append(sj.SamplingParams(guided=guided(choice=choice), **knobs()))
    results = sj.generate_batch(smollm2, prompts, params)
    assert len(results) == 2 * (30 + len(REGEXES) + len(CHOICES))
    for p, result in zip(params, results, strict=True):
        assert result.finish_reason == "stop", result.text
        assert holds(p, result), result.text
    answers = {
        r.text for p, r in zip(params, results, strict=True) if p.guided.choice == CHOICES[0]
    }
    assert answers <= set(CHOICES[0])
