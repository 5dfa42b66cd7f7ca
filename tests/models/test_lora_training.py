"""A LoRA adapter trained in JAX (optax, ``merge_lora`` over the research forward), saved with
``save_peft_adapter``: PEFT loads it and gives our logits and greedy tokens."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from helpers import model_from_hf, random_prompt

import spark_jax as sj
from spark_jax.models import decoder
from spark_jax.ops.lora import (
    LoraAdapter,
    init_lora_weights,
    merge_lora,
    read_peft_adapter,
    save_peft_adapter,
)

RANK, SCALE = 4, 2.0
PROMPT, TARGET = random_prompt(20, 6), random_prompt(21, 10)
# Every projection kind of both layers: fused parts (q/k/v, gate/up) and plain kernels.
MODULES = [
    f"model.layers.{i}.{m}"
    for i in range(2)
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    """(HF base, losses, adapter directory): 20 adam steps teaching PROMPT -> TARGET."""
    hf, model = tiny_llama
    targets = decoder.lora_targets(model.config)
    weights = init_lora_weights(targets, MODULES, RANK, jax.random.key(0))
    tokens = jnp.asarray([PROMPT + TARGET], jnp.int32)
    lengths = jnp.asarray([tokens.shape[1]], jnp.int32)

    def loss_fn(w):
        params = merge_lora(model.params, targets, w, SCALE)
        logits = decoder.forward_outputs(params, model.config, tokens, lengths).logits
        logp = jax.nn.log_softmax(logits[0, len(PROMPT) - 1 : -1])
        return -jnp.take_along_axis(logp, tokens[0, len(PROMPT) :, None], axis=1).mean()

    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(w, state):
        loss, grads = jax.value_and_grad(loss_fn)(w)
        updates, state = optimizer.update(grads, state, w)
        return optax.apply_updates(w, updates), state, loss

    state, losses = optimizer.init(weights), []
    for _ in range(20):
        weights, state, loss = step(weights, state)
        losses.append(float(loss))
    adapter = LoraAdapter(
        "taught", RANK, SCALE, {m: (np.asarray(a), np.asarray(b)) for m, (a, b) in weights.items()}
    )
    path = save_peft_adapter(tmp_path_factory.mktemp("taught"), adapter)
    return hf, losses, path


def test_the_loss_falls_and_the_adapter_round_trips(trained):
    _, losses, path = trained
    # HF's tiny init (weights N(0, 0.02)) bounds how far a rank-4 adapter moves the logits in
    # 20 steps; a real model learns far more (notebooks/03_lora_training.ipynb).
    assert losses[-1] < losses[0] - 0.5, losses
    adapter = read_peft_adapter(path)
    assert adapter.rank == RANK and adapter.scale == SCALE
    assert sorted(adapter.weights) == sorted(MODULES)


def test_peft_loads_the_adapter_to_our_logits_and_greedy_tokens(trained):
    from peft import PeftModel

    hf, _, path = trained
    peft = PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()
    model = model_from_hf(hf)  # a fresh handle: the session fixture stays adapter-free
    model.add_adapter("taught", path)
    ids = PROMPT + TARGET[:3]
    with torch.no_grad():
        ref_logits = peft(torch.tensor([ids])).logits[0].numpy()
        ref = peft.generate(
            torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=10, do_sample=False
        )[0, len(PROMPT) :].tolist()
    ours = model.logits(ids, adapter="taught")
    assert np.abs(ours - ref_logits).max() / np.abs(ref_logits).max() <= 1e-4
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = sj.generate(model, PROMPT, sj.SamplingParams(**{**vars(greedy), "adapter": "taught"}))
    assert tokens.output_tokens == ref  # PEFT's greedy tokens
    assert sj.generate(model, PROMPT, greedy).output_tokens != ref  # and not the base model's
