"""The HF → spark_jax converter: what it writes, that weights round-trip, and how it refuses.

Sources are tiny random ``LlamaForCausalLM`` checkpoints saved by transformers itself, so the
safetensors layout (single file, shards, bf16) is exactly what real models ship.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import TINY_LLAMA, save_tiny_llama
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from conversion.hf_to_orbax import ConversionError, convert, main
from spark_jax import checkpoint

LAYERS = TINY_LLAMA["num_hidden_layers"]
Q_SIZE = TINY_LLAMA["hidden_size"]
KV_SIZE = Q_SIZE // TINY_LLAMA["num_attention_heads"] * TINY_LLAMA["num_key_value_heads"]


@pytest.fixture
def tiny_llama(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """An HF directory with a tiny fp32 llama, a generation config and tokenizer files."""
    src = tmp_path / "hf"
    state = save_tiny_llama(src)
    (src / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (src / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return src, state


def as_np(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def assert_params_match_hf(params: dict, state: dict[str, np.ndarray]) -> None:
    """Every converted leaf equals the HF tensor(s) it was built from."""
    np.testing.assert_array_equal(
        as_np(params["embed_tokens"]["embedding"]), state["model.embed_tokens.weight"]
    )
    np.testing.assert_array_equal(as_np(params["final_norm"]["scale"]), state["model.norm.weight"])
    np.testing.assert_array_equal(as_np(params["lm_head"]["kernel"]), state["lm_head.weight"].T)
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        layer = params[f"layers_{i}"]
        qkv = as_np(layer["attn"]["qkv_proj"]["kernel"])
        np.testing.assert_array_equal(qkv[:, :Q_SIZE], state[hf + "self_attn.q_proj.weight"].T)
        np.testing.assert_array_equal(
            qkv[:, Q_SIZE : Q_SIZE + KV_SIZE], state[hf + "self_attn.k_proj.weight"].T
        )
        np.testing.assert_array_equal(
            qkv[:, Q_SIZE + KV_SIZE :], state[hf + "self_attn.v_proj.weight"].T
        )
        np.testing.assert_array_equal(
            as_np(layer["attn"]["o_proj"]["kernel"]), state[hf + "self_attn.o_proj.weight"].T
        )
        gate_up = as_np(layer["mlp"]["gate_up_proj"]["kernel"])
        ffn = TINY_LLAMA["intermediate_size"]
        np.testing.assert_array_equal(gate_up[:, :ffn], state[hf + "mlp.gate_proj.weight"].T)
        np.testing.assert_array_equal(gate_up[:, ffn:], state[hf + "mlp.up_proj.weight"].T)
        np.testing.assert_array_equal(
            as_np(layer["mlp"]["down_proj"]["kernel"]), state[hf + "mlp.down_proj.weight"].T
        )
        np.testing.assert_array_equal(
            as_np(layer["input_norm"]["scale"]), state[hf + "input_layernorm.weight"]
        )
        np.testing.assert_array_equal(
            as_np(layer["post_attn_norm"]["scale"]), state[hf + "post_attention_layernorm.weight"]
        )


# ---------------------------------------------------------------------------------------------
# What a conversion writes.


def test_float32_conversion_round_trips_every_tensor(tiny_llama, tmp_path):
    src, state = tiny_llama
    dst = convert(src, tmp_path / "out", dtype="float32", progress=False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR)
    assert_params_match_hf(params, state)
    assert params["embed_tokens"]["embedding"].dtype == jnp.float32


def test_bfloat16_conversion_rounds_each_weight_once(tiny_llama, tmp_path):
    src, state = tiny_llama
    dst = convert(src, tmp_path / "out", progress=False)  # bfloat16 is the default
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR)
    qkv = params["layers_1"]["attn"]["qkv_proj"]["kernel"]
    assert qkv.dtype == jnp.bfloat16
    expected = state["model.layers.1.self_attn.q_proj.weight"].T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(qkv)[:, :Q_SIZE], expected)


def test_restore_can_cast_on_read(tiny_llama, tmp_path):
    src, state = tiny_llama
    dst = convert(src, tmp_path / "out", dtype="float32", progress=False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR, dtype=jnp.bfloat16)
    embedding = params["embed_tokens"]["embedding"]
    assert embedding.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(embedding), state["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16)
    )


def test_config_generation_config_and_tokenizer_files_are_copied_verbatim(tiny_llama, tmp_path):
    src, _ = tiny_llama
    dst = convert(src, tmp_path / "out", progress=False)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert not (dst / "model.safetensors").exists()
    assert checkpoint.is_converted_dir(dst)
    assert not checkpoint.is_converted_dir(src)
    assert checkpoint.read_config(dst)["model_type"] == "llama"


def test_sharded_safetensors_convert_like_one_file(tmp_path):
    sharded = tmp_path / "sharded"
    state = save_tiny_llama(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()

    dst = convert(sharded, tmp_path / "out", dtype="float32", progress=False)
    assert_params_match_hf(checkpoint.restore_params(dst / checkpoint.PARAMS_DIR), state)


def test_bfloat16_safetensors_are_read_exactly(tmp_path):
    src = tmp_path / "hf_bf16"
    state = save_tiny_llama(src, dtype="bfloat16")  # fp32 copies of the bf16 values
    with safe_open(src / "model.safetensors", framework="numpy") as f:
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    dst = convert(src, tmp_path / "out", dtype="float32", progress=False)
    assert_params_match_hf(checkpoint.restore_params(dst / checkpoint.PARAMS_DIR), state)


def test_tied_embeddings_need_no_lm_head(tmp_path):
    src = tmp_path / "tied"
    state = save_tiny_llama(src, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(src / "model.safetensors")
    dst = convert(src, tmp_path / "out", dtype="float32", progress=False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR)
    assert "lm_head" not in params
    np.testing.assert_array_equal(
        as_np(params["embed_tokens"]["embedding"]), state["model.embed_tokens.weight"]
    )


def test_command_line_converts_and_reports_errors(tiny_llama, tmp_path, capsys):
    src, _ = tiny_llama
    assert main([str(src), str(tmp_path / "out"), "--dtype", "float32"]) == 0
    assert checkpoint.is_converted_dir(tmp_path / "out")
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out2")]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# How a conversion refuses.


def test_wrong_tensors_are_all_listed(tiny_llama, tmp_path):
    src, _ = tiny_llama
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    del tensors["model.norm.weight"]
    tensors["model.layers.0.self_attn.rotary.weight"] = np.zeros(3, np.float32)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((KV_SIZE + 1, 32), np.float32)
    save_file(tensors, src / "model.safetensors")

    with pytest.raises(ConversionError) as error:
        convert(src, tmp_path / "out", progress=False)
    message = str(error.value)
    assert "model.layers.0.mlp.up_proj.weight" in message
    assert "model.norm.weight" in message
    assert "model.layers.0.self_attn.rotary.weight" in message
    assert f"model.layers.1.self_attn.k_proj.weight has shape ({KV_SIZE + 1}, 32)" in message
    assert f"expected ({KV_SIZE}, 32)" in message
    assert not (tmp_path / "out").exists()


def test_pickle_weights_are_refused_without_unpickling(tmp_path):
    src = tmp_path / "pickled"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(TINY_LLAMA | {"model_type": "llama"}))
    # Not a valid pickle: were it ever unpickled, the error would be an UnpicklingError.
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle")
    with pytest.raises(ConversionError, match=r"pytorch_model\.bin.*arbitrary code"):
        convert(src, tmp_path / "out", progress=False)
    with pytest.raises(ConversionError, match=r"pickle.*safetensors"):
        convert(src / "pytorch_model.bin", tmp_path / "out", progress=False)


def test_directory_without_weights_is_refused(tmp_path):
    src = tmp_path / "empty"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(TINY_LLAMA | {"model_type": "llama"}))
    with pytest.raises(ConversionError, match=r"no model weights.*model\.safetensors"):
        convert(src, tmp_path / "out", progress=False)


def test_truncated_safetensors_is_named(tiny_llama, tmp_path):
    src, _ = tiny_llama
    weights = src / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConversionError, match=r"model\.safetensors.*truncated"):
        convert(src, tmp_path / "out", progress=False)


def test_missing_shard_is_named(tmp_path):
    src = tmp_path / "sharded"
    save_tiny_llama(src)
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=r"model-00002-of-00002\.safetensors"):
        convert(src, tmp_path / "out", progress=False)


def test_unknown_model_type_is_refused(tiny_llama, tmp_path):
    src, _ = tiny_llama
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"model_type": "gpt_neox"}))
    with pytest.raises(ConversionError, match=r"'gpt_neox'.*llama"):
        convert(src, tmp_path / "out", progress=False)


def test_existing_destination_is_not_overwritten(tiny_llama, tmp_path):
    src, _ = tiny_llama
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="already exists"):
        convert(src, dst, progress=False)
    assert (dst / "keep.txt").read_text() == "mine"


def test_unsupported_dtype_is_refused(tiny_llama, tmp_path):
    src, _ = tiny_llama
    with pytest.raises(ConversionError, match="float16.*bfloat16"):
        convert(src, tmp_path / "out", dtype="float16", progress=False)
