"""Draft heads: the declaration is the module's tree, checkpoints round-trip, training learns,
and the head shipped for SmolLM2 drafts well on prompts it never saw."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_prompt

import spark_jax as sj
from spark_jax.generation.draft_training import HeadTraining, train_draft_head
from spark_jax.generation.drafters import HeadDrafter
from spark_jax.models import draft_head


@pytest.fixture(scope="module")
def model(tiny_llama):
    return tiny_llama[1]


@pytest.fixture(scope="module")
def config(model):
    return draft_head.head_config(model.config, intermediate_size=32, num_heads=2)


def test_the_declaration_is_the_modules_tree_under_deepseek_mtp_names(config):
    params = draft_head.init_params(config, jax.random.PRNGKey(0))
    shapes = jax.tree_util.tree_map(lambda x: tuple(x.shape), params)
    assert shapes == draft_head.declare(config).shapes()
    names = set(draft_head.declare(config).weight_spec().required)
    assert {"eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"} <= names
    assert "self_attn.q_proj.weight" in names and "mlp.down_proj.weight" in names


def test_a_saved_head_loads_back_with_its_block_shape(model, config, tmp_path):
    params = draft_head.init_params(config, jax.random.PRNGKey(1))
    path = tmp_path / "head.safetensors"
    draft_head.save_draft_head(path, params, config, dtype=jnp.float32)
    loaded, loaded_config = draft_head.load_draft_head(path, model.config)
    assert loaded_config == config
    leaves = jax.tree_util.tree_leaves
    for a, b in zip(leaves(params), leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = draft_head.head_config(model.config, intermediate_size=48, num_heads=2)
    with pytest.raises(ValueError, match="not a draft head for this model"):
        bad = tmp_path / "bad.safetensors"
        draft_head.save_draft_head(bad, draft_head.init_params(other, jax.random.PRNGKey(2)), other)
        with open(bad, "rb") as f:  # a file whose metadata says one shape, tensors another
            raw = f.read()
        bad.write_bytes(raw.replace(b'"intermediate_size":"48"', b'"intermediate_size":"32"'))
        draft_head.load_draft_head(bad, model.config)


def test_training_on_the_targets_greedy_outputs_lowers_the_loss(model, config):
    prompts = [random_prompt(100 + i, 6) for i in range(16)]
    params = sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = sj.generate_batch(model, prompts, params)
    sequences = [p + o.output_tokens for p, o in zip(prompts, outputs, strict=True)]
    training = HeadTraining(steps=60, batch_size=8, token_positions=64, learning_rate=5e-3)
    head = train_draft_head(model, sequences, [6] * 16, config, training)
    first, last = np.mean(head.losses[:5]), np.mean(head.losses[-5:])
    assert last < 0.8 * first


# ---------------------------------------------------------------------------------------------
# The head shipped for SmolLM2 (made by scripts/train_smollm2_draft_head.py).

SHIPPED_HEAD = Path(__file__).parent.parent / "data" / "smollm2_draft_head.safetensors"
# The script's held-out prompts (its HELD_OUT_TEMPLATES x HELD_OUT_TOPICS): no template or
# topic among them was trained on.
HELD_OUT_TEMPLATES = [
    "Tell me about {}.",
    "Describe how {} works.",
    "What do people often get wrong about {}?",
]
HELD_OUT_TOPICS = ["glaciers", "the printing press", "octopuses", "tea", "bicycles", "snow"]
ANSWER_TOKENS = 96  # as the script measures


@pytest.fixture(scope="module")
def shipped_head_at_k1(smollm2):
    """(acceptance of the shipped head at K=1 over the held-out prompts, whether every
    speculative output equalled plain greedy)."""
    drafter = HeadDrafter(smollm2, SHIPPED_HEAD)
    params = sj.SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    asks = [t.format(topic) for topic in HELD_OUT_TOPICS for t in HELD_OUT_TEMPLATES]
    prompts = [smollm2.tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]
    plain = sj.generate_batch(smollm2, prompts, params)
    drafted = accepted = 0
    same = True
    for prompt, greedy in zip(prompts, plain, strict=True):
        result = sj.generate_speculative(smollm2, prompt, params, num_drafts=1, drafter=drafter)
        same &= result.output_tokens == greedy.output_tokens
        drafted += result.spec_stats["num_drafted"]
        accepted += result.spec_stats["num_accepted"]
    return accepted / drafted, same


def test_the_shipped_smollm2_head_keeps_greedy_output_and_drafts_half_its_tokens_right(
    shipped_head_at_k1,
):
    """The shipped head (a full-width block, 600 steps of 256 over ~16,700 of SmolLM2's
    answers: the script's --vocab-topics 16000 --batch-size 256 --intermediate-size 1536
    --num-heads 9 --num-kv-heads 3) accepts 0.528 of its drafts at K=1 here; issue #25 asks
    0.5. A head that learned nothing drafts near 0."""
    rate, same = shipped_head_at_k1
    assert same
    assert rate >= 0.5
