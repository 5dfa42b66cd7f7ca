"""The parameter declarations (spark_jax.models.params) against the Flax modules and HF models.

Each family declares its parameters once; the Flax modules build their own (``init_params``),
so these tests hold the two together, and the checkpoint layout and LoRA targets derived from
the declaration against the HF model's own tensors and linear modules.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import HF_BUILDERS, tiny_hf

import spark_jax as sj
from spark_jax.models import declare, family
from spark_jax.models.params import Declaration, linear

NLLB_SHAPES = {"nllb_2x3": (2, 3), "nllb_1x1": (1, 1)}


@pytest.fixture(scope="module", params=sorted(HF_BUILDERS) + sorted(NLLB_SHAPES))
def hf_model(request) -> torch.nn.Module:
    torch.manual_seed(0)
    if request.param in NLLB_SHAPES:
        return tiny_hf(*NLLB_SHAPES[request.param])
    return HF_BUILDERS[request.param]().eval()


def test_the_flax_modules_build_the_declared_tree(hf_model):
    """``init_params`` (the Flax param calls) gives exactly the declared paths and shapes."""
    config = sj.config_from_hf(hf_model.config.to_dict())
    built = jax.eval_shape(partial(family(config).init_params, config), jax.random.key(0))
    assert jax.tree.map(lambda leaf: tuple(leaf.shape), built) == declare(config).shapes()


def test_the_declaration_reads_the_hf_checkpoint_and_names_every_hf_linear(hf_model):
    """The weight spec accepts the HF state dict; the read tree has the declared shapes; every
    HF linear layer but the LM head is a LoRA target of its own in and out size."""
    config = sj.config_from_hf(hf_model.config.to_dict())
    declaration = declare(config)
    tensors = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    assert declaration.weight_spec().check({k: v.shape for k, v in tensors.items()}) == []
    params = declaration.from_hf(tensors)
    assert jax.tree.map(lambda leaf: tuple(leaf.shape), params) == declaration.shapes()

    linears = {
        name: module
        for name, module in hf_model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    }
    targets = declaration.lora_targets()
    assert set(targets) == set(linears)
    for name, target in targets.items():
        assert (target.in_dim, target.out_dim) == (
            linears[name].in_features,
            linears[name].out_features,
        ), name
        kernel = params
        for key in target.path:
            kernel = kernel[key]
        assert kernel["kernel"].shape == (target.in_dim, target.total_out), name


def test_fused_parts_tile_the_kernel_in_order():
    """A fused Linear's parts follow each other in the kernel's columns, as declared."""
    (kernel, bias) = linear(("qkv",), ["q", "k", "v"], 8, [6, 2, 2], bias=True)
    assert kernel.shape == (8, 10) and bias.shape == (10,)
    targets = Declaration.of([kernel, bias]).lora_targets()
    assert [(t.part, t.out_start, t.out_dim, t.total_out) for t in targets.values()] == [
        (0, 0, 6, 10),
        (1, 6, 2, 10),
        (2, 8, 2, 10),
    ]
    tensors = {
        "q.weight": jnp.ones((6, 8)),
        "k.weight": 2 * jnp.ones((2, 8)),
        "v.weight": 3 * jnp.ones((2, 8)),
    }
    fused = kernel.from_hf(tensors)
    assert fused.shape == (8, 10)
    assert (fused[:, :6] == 1).all() and (fused[:, 6:8] == 2).all() and (fused[:, 8:] == 3).all()
    with pytest.raises(ValueError, match="declared twice"):
        Declaration.of([kernel], [kernel])
