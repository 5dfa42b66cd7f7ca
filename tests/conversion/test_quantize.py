"""Quantized checkpoints: ``--quantize fp8|int8`` and compressed-tensors fp8 sources.

The oracle of the numbers is torch: its float8_e4m3fn conversion and rounding quantize the HF
weights, and an HF ``LlamaForCausalLM`` holding the dequantized weights (``q * scale``, exact
in fp32) gives the logits a quantized model must reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import TINY_LLAMA, random_prompt, save_tiny_llama
from safetensors.torch import save_file

import spark_jax as sj
from conversion.hf_to_orbax import ConversionError, convert, main
from spark_jax import checkpoint

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEARS += ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LARGEST = {"fp8": 448.0, "int8": 127.0}


def torch_quantize(w: torch.Tensor, kind: str, group: int | None = None):
    """HF-layout w [out, in] -> (q [out, in], scale [out, in / group]) with torch's own casts."""
    out_dim, in_dim = w.shape
    g = in_dim if group is None else group
    wg = w.float().reshape(out_dim, in_dim // g, g)
    scale = wg.abs().amax(-1, keepdim=True) / LARGEST[kind]
    scaled = (wg / scale).clamp(-LARGEST[kind], LARGEST[kind])
    q = scaled.to(torch.float8_e4m3fn) if kind == "fp8" else scaled.round().to(torch.int8)
    return q.reshape(out_dim, in_dim), scale[..., 0]


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = q.shape
    groups = scale.shape[1]
    w = q.float().reshape(out_dim, groups, in_dim // groups) * scale.float()[..., None]
    return w.reshape(out_dim, in_dim)


def hf_twin(src: Path, weights: dict[str, torch.Tensor]):
    """The HF model of ``src`` with the given (dequantized) weights in place of its own."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    state = model.state_dict()
    state.update(weights)
    model.load_state_dict(state)
    return model


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def float_source(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    src = tmp_path_factory.mktemp("hf") / "llama"
    return src, save_tiny_llama(src)


def layer_names():
    for i in range(TINY_LLAMA["num_hidden_layers"]):
        for module in LINEARS:
            yield f"model.layers.{i}.{module}.weight"


@pytest.mark.parametrize(("kind", "group"), [("fp8", None), ("int8", None), ("int8", 16)])
def test_quantize_stores_torchs_narrow_weights_and_matches_the_dequantized_hf_model(
    float_source, tmp_path, kind, group
):
    src, state = float_source
    dst = convert(src, tmp_path / "q", "float32", False, quantize=kind, group_size=group)
    config = checkpoint.read_config(dst)["quantization_config"]
    assert (config["weights"], config["group_size"], config["lm_head"]) == (kind, group, False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR, dtype=jnp.bfloat16)
    down = params["layers_1"]["mlp"]["down_proj"]
    q, scale = torch_quantize(torch.from_numpy(state["model.layers.1.mlp.down_proj.weight"]), kind)
    if group is None:  # narrow kernels keep their type when the rest is cast on read
        assert down["kernel"].dtype == (jnp.float8_e4m3fn if kind == "fp8" else jnp.int8)
        np.testing.assert_array_equal(np.asarray(down["kernel"], np.float32), q.float().numpy().T)
    assert params["lm_head"]["kernel"].dtype == jnp.bfloat16  # the LM head stays float

    twin_weights = {}
    for name in layer_names():
        q, scale = torch_quantize(torch.from_numpy(state[name]), kind, group)
        twin_weights[name] = dequantized(q, scale)
    ids = random_prompt(3, 12, vocab=TINY_LLAMA["vocab_size"])
    ours = sj.load(dst).logits(ids)
    reference = hf_logits(hf_twin(src, twin_weights), ids)
    assert relative_error(ours, reference) < 1e-3


def save_compressed_tensors(src: Path, dst: Path, drop_scales: bool = False) -> dict:
    """``src``'s weights quantized to fp8 per channel with torch, saved the way llm-compressor
    does (``weight`` float8_e4m3fn + ``weight_scale [out, 1]`` bf16, lm_head ignored); returns
    the dequantized weights."""
    from safetensors.torch import load_file

    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    twin = {}
    for name in layer_names():
        q, scale = torch_quantize(tensors[name], "fp8")
        scale = scale.to(torch.bfloat16)
        tensors[name] = q
        if not drop_scales:
            tensors[name + "_scale"] = scale
        twin[name] = dequantized(q, scale)
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    (dst / "config.json").write_text(json.dumps(config))
    return twin


def test_a_compressed_tensors_fp8_checkpoint_loads_and_matches_its_dequantized_twin(
    float_source, tmp_path
):
    src, _ = float_source
    twin = save_compressed_tensors(src, tmp_path / "fp8")
    dst = convert(tmp_path / "fp8", tmp_path / "out", "float32", progress=False)
    model = sj.load(dst)
    assert model.config.quantization.weights == "fp8"
    qkv = model.params["layers_0"]["attn"]["qkv_proj"]
    assert qkv["kernel"].dtype == jnp.float8_e4m3fn and qkv["kernel_scale"].shape == (64,)
    ids = random_prompt(4, 12, vocab=TINY_LLAMA["vocab_size"])
    assert relative_error(model.logits(ids), hf_logits(hf_twin(src, twin), ids)) < 1e-3


# ---------------------------------------------------------------------------------------------
# Bad input: one line each.


def test_an_unknown_quantize_value_is_one_line(float_source, tmp_path, capsys):
    src, _ = float_source
    with pytest.raises(ConversionError, match="--quantize 'int4' is not supported"):
        convert(src, tmp_path / "a", quantize="int4", progress=False)
    assert main([str(src), str(tmp_path / "b"), "--quantize", "int4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --quantize 'int4'") and "\n" not in err
    assert not (tmp_path / "b").exists()


def test_a_compressed_tensors_checkpoint_without_scales_is_one_line(float_source, tmp_path):
    src, _ = float_source
    save_compressed_tensors(src, tmp_path / "fp8", drop_scales=True)
    with pytest.raises(ConversionError, match="weight_scale tensors are missing") as error:
        convert(tmp_path / "fp8", tmp_path / "out", progress=False)
    assert "\n" not in str(error.value)


def test_a_converted_checkpoint_without_its_scales_is_refused_on_load(float_source, tmp_path):
    src, _ = float_source
    dst = convert(src, tmp_path / "plain", progress=False)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = sj.config.QuantizationConfig("int8").to_hf()
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kernel scales are missing") as error:
        sj.load(dst)
    assert "\n" not in str(error.value)


def test_a_quantized_model_asked_to_save_unquantized_is_one_line(float_source, tmp_path):
    src, _ = float_source
    save_compressed_tensors(src, tmp_path / "fp8")
    with pytest.raises(ConversionError, match="would save them unquantized") as error:
        convert(tmp_path / "fp8", tmp_path / "out", progress=False, quantize="none")
    assert "\n" not in str(error.value)
    with pytest.raises(ConversionError, match="never quantized again"):
        convert(tmp_path / "fp8", tmp_path / "out", progress=False, quantize="int8")
    assert not (tmp_path / "out").exists()


def test_a_group_size_that_does_not_divide_the_layers_is_one_line(float_source, tmp_path):
    src, _ = float_source
    with pytest.raises(ConversionError, match="--group-size 24 does not divide") as error:
        convert(src, tmp_path / "out", quantize="int8", group_size=24, progress=False)
    assert "\n" not in str(error.value)
