"""Kernel options belong to a model: two models over the same params with different
``KernelOptions`` compile their own programs side by side in one process (no cache is
cleared), and give the same logits as HF."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import TINY, model_from_hf, random_prompt

import spark_jax as sj
from spark_jax.models import decoder


@pytest.fixture(scope="module")
def hf_llama_head_dim_64():
    """A tiny Llama whose heads (64 wide, MHA) our Pallas kernels take, interpreted on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(
        **{**TINY, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2}
    )
    return LlamaForCausalLM(config).eval()


def _verify_args(model: sj.Model, ids: list[int]) -> tuple:
    """``decoder.verify``'s arguments for one sequence, as ``Runner.logits`` builds them."""
    length = len(ids)
    width = decoder.bucket(length)
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :length] = ids
    state = model.runner.init_state(1, width)
    return model.params, model.config, jnp.asarray(tokens), jnp.asarray([length]), state


def test_two_models_with_different_options_get_their_own_programs(hf_llama_head_dim_64):
    hf = hf_llama_head_dim_64
    base = model_from_hf(hf)
    xla = sj.Model(base.config, base.params, options=sj.KernelOptions(implementation="xla"))
    pallas = sj.Model(base.config, base.params, options=sj.KernelOptions(implementation="pallas"))
    assert xla.runner.options.implementation == "xla"
    assert pallas.runner.decode_fn.keywords["options"] is pallas.options
    ids = random_prompt(5, 40)  # one 64-position bucket: the kernels' 64-key blocks

    texts = {
        name: decoder.verify.lower(*_verify_args(m, ids), options=m.options).as_text()
        for name, m in (("xla", xla), ("pallas", pallas))
    }
    assert texts["xla"] != texts["pallas"]  # the kernel's (interpreted) program is not XLA's

    before = decoder.verify._cache_size()
    ours = {}
    for name, model in (("xla", xla), ("pallas", pallas)):
        ours[name] = model.logits(ids)
    assert decoder.verify._cache_size() == before + 2  # one program per options value
    xla.logits(ids), pallas.logits(ids)  # both compiled already: nothing is traced again
    assert decoder.verify._cache_size() == before + 2

    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    for name, logits in ours.items():
        np.testing.assert_allclose(logits, ref, rtol=2e-4, atol=2e-4, err_msg=name)
    np.testing.assert_allclose(ours["pallas"], ours["xla"], rtol=1e-4, atol=1e-4)


def test_nllb_runners_with_different_options_lower_different_decode_steps():
    """The NLLB decode step with the one-query kernel (``implementation="pallas"``,
    interpreted) and with XLA's attention: two programs from one params tree, each runner
    passing its own options to its steps and to ``decode_fn``."""
    from helpers import ours, random_sources, tiny_hf

    from spark_jax.models import nllb

    plain = ours(tiny_hf(decoder_layers=1))
    options = sj.KernelOptions(implementation="pallas")
    kernel = nllb.NllbRunner(plain.config, plain.params, plain.tokenizer, "fra_Latn", options)
    assert kernel.decode_fn.keywords["options"] == options
    assert plain.decode_fn.keywords["options"] == sj.KernelOptions()
    sources = random_sources(3, 2, max_len=10)
    texts, logits = {}, {}
    for name, runner in (("plain", plain), ("kernel", kernel)):
        state = runner.init_state(2, 16, 16)
        first, state = plain.prefill(state, range(2), sources)  # the same prefill for both
        tokens = jnp.argmax(first, axis=-1).astype(jnp.int32)
        active = jnp.ones(2, bool)
        texts[name] = runner.lower_decode(state, tokens, active).as_text()
        logits[name] = np.asarray(runner.decode(state, tokens, active)[0])
    assert texts["plain"] != texts["kernel"]
    np.testing.assert_allclose(logits["kernel"], logits["plain"], rtol=1e-5, atol=1e-5)
