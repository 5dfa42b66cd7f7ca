"""Shared fixtures: session-scoped models built from ``helpers`` (the HF oracle and the same
weights as spark_jax models, the real SmolLM2)."""

from __future__ import annotations

import gc

import jax
import pytest
import torch
from helpers import HF_BUILDERS, model_from_hf, smollm2_gguf_path

import spark_jax as sj


@pytest.fixture(scope="session", params=sorted(HF_BUILDERS))
def hf_and_model(request):
    """(name, HF model, spark_jax Model) for every decoder family, same random weights."""
    torch.manual_seed(sorted(HF_BUILDERS).index(request.param))
    hf = HF_BUILDERS[request.param]().eval()
    return request.param, hf, model_from_hf(hf)


@pytest.fixture(scope="session")
def tiny_llama():
    torch.manual_seed(0)
    hf = HF_BUILDERS["llama3_untied"]().eval()
    return hf, model_from_hf(hf)


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory):
    """SmolLM2 converted once per session (fp32) by the project's converter."""
    from conversion.hf_to_orbax import convert

    dst = tmp_path_factory.mktemp("smollm2") / "converted"
    return convert(smollm2_gguf_path(), dst, "float32", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_converted) -> sj.Model:
    return sj.load(smollm2_converted)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF (fp32): the oracle for the real model."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each test module's compiled programs when it ends: the whole suite's unrolled
    models would otherwise stay compiled together and outgrow a CI machine's memory."""
    yield
    jax.clear_caches()
    gc.collect()
