"""GGUF sources: tensors, config and tokenizer rebuilt from a llama.cpp file.

Two kinds of evidence: tiny F32 GGUFs written here with llama.cpp's Q/K permutation (exact
round trip to the HF weights they came from), and the real SmolLM2-135M-Instruct Q4_1 file
checked against transformers' own GGUF loader (dequantized weights, token ids, chat template).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    TINY_LLAMA,
    save_tiny_llama,
    smollm2_gguf_path,
    tiny_bpe_vocab,
    write_tiny_gguf,
)
from tokenizers import Tokenizer

from conversion.gguf_reader import read_gguf
from conversion.hf_to_orbax import ConversionError, convert
from spark_jax import checkpoint

SMOLLM2 = smollm2_gguf_path()

TEXTS = [
    "Hello world! The year 2024 has 366 days; pi is 3.14159.",
    "<|im_start|>user\nWhat's 你好 in English? 🤗🚀<|im_end|>\n",
    "def add(x, y):\n    return x + y  # ok\n\n\tindented\r\n",
    "  leading  spaces, naïve café, Ünïcödé, ǅ, ﬁ ligature, ‘quotes’ — dash",
    "日本語のテキストと한국어 텍스트 and العربية",
    "<|endoftext|><|im_end|>trailing",
]


# ---------------------------------------------------------------------------------------------
# Tiny synthetic GGUFs.


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    state = save_tiny_llama(tmp_path / "hf")
    return write_tiny_gguf(tmp_path / "tiny.gguf", state), state


def test_tiny_gguf_tensors_equal_the_hf_weights_after_unpermuting(tiny_gguf):
    path, state = tiny_gguf
    tensors = read_gguf(path).tensors
    assert set(tensors) == set(state)
    for name, expected in state.items():
        assert tensors.shape(name) == expected.shape, name
        np.testing.assert_array_equal(tensors[name], expected, err_msg=name)


def test_tiny_gguf_config_describes_the_model(tiny_gguf):
    path, _ = tiny_gguf
    config = read_gguf(path).config
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert config[key] == TINY_LLAMA[key], key
    assert config["num_key_value_heads"] == TINY_LLAMA["num_key_value_heads"]
    assert config["vocab_size"] == TINY_LLAMA["vocab_size"]
    assert config["rms_norm_eps"] == TINY_LLAMA["rms_norm_eps"]
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False  # the file has output.weight


def test_tiny_gguf_converts_to_params(tiny_gguf, tmp_path):
    path, state = tiny_gguf
    dst = convert(path, tmp_path / "out", dtype="float32", progress=False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR)
    q_size = TINY_LLAMA["hidden_size"]
    qkv = np.asarray(params["layers_0"]["attn"]["qkv_proj"]["kernel"])
    np.testing.assert_array_equal(
        qkv[:, :q_size], state["model.layers.0.self_attn.q_proj.weight"].T
    )
    assert json.loads((dst / "generation_config.json").read_text())["eos_token_id"] == 2
    assert checkpoint.read_config(dst)["num_hidden_layers"] == TINY_LLAMA["num_hidden_layers"]


def test_tiny_gguf_tokenizer_keeps_control_tokens_whole_and_applies_merges(tiny_gguf):
    path, _ = tiny_gguf
    files = read_gguf(path).tokenizer_files
    tokenizer = Tokenizer.from_str(files["tokenizer.json"])
    tokens, _, _ = tiny_bpe_vocab()
    ids = tokenizer.encode("<|im_start|> the").ids
    assert [tokens[i] for i in ids] == ["<|im_start|>", "Ġthe"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|> the"
    config = json.loads(files["tokenizer_config.json"])
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["chat_template"] == "{{ messages[0]['content'] }}"


def test_qwen2_gguf_keeps_rows_in_place_and_biases(tmp_path):
    # llama.cpp permutes Q/K only for the llama architecture; Qwen2 files are stored as is.
    state = save_tiny_llama(tmp_path / "hf", family="qwen2")
    assert "model.layers.0.self_attn.q_proj.bias" in state
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", state, arch="qwen2")
    tensors = read_gguf(path).tensors
    assert set(tensors) == set(state)
    for name, expected in state.items():
        np.testing.assert_array_equal(tensors[name], expected, err_msg=name)
    dst = convert(path, tmp_path / "out", dtype="float32", progress=False)
    params = checkpoint.restore_params(dst / checkpoint.PARAMS_DIR)
    bias = np.asarray(params["layers_1"]["attn"]["qkv_proj"]["bias"])
    np.testing.assert_array_equal(
        bias[: TINY_LLAMA["hidden_size"]], state["model.layers.1.self_attn.q_proj.bias"]
    )
    assert checkpoint.read_config(dst)["model_type"] == "qwen2"


def test_unsupported_architecture_is_refused(tmp_path):
    state = save_tiny_llama(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "falcon.gguf", state, arch="falcon")
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        read_gguf(path)
    with pytest.raises(ConversionError, match="'falcon'"):
        convert(path, tmp_path / "out", progress=False)


def test_unsupported_tokenizer_model_is_refused(tmp_path):
    state = save_tiny_llama(tmp_path / "hf")
    path = write_tiny_gguf(tmp_path / "spm.gguf", state, tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        read_gguf(path)


# ---------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 file, against transformers' GGUF loader.


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """A directory holding (a link to) the GGUF, as transformers' ``gguf_file=`` wants."""
    directory = tmp_path_factory.mktemp("smollm2_gguf")
    (directory / SMOLLM2.name).symlink_to(SMOLLM2)
    return directory


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    return read_gguf(SMOLLM2)


@pytest.fixture(scope="session")
def hf_smollm2_state(hf_smollm2) -> dict[str, np.ndarray]:
    return {name: value.float().numpy() for name, value in hf_smollm2.state_dict().items()}


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, gguf_file=SMOLLM2.name)


def test_smollm2_config(smollm2_converted):
    config = checkpoint.read_config(smollm2_converted)
    expected = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected


def test_smollm2_tensors_equal_transformers_dequantization(smollm2_checkpoint, hf_smollm2_state):
    tensors = smollm2_checkpoint.tensors
    # transformers keeps a tied lm_head in its state dict; the GGUF has no separate one.
    assert set(tensors) == set(hf_smollm2_state) - {"lm_head.weight"}
    for name in tensors:
        np.testing.assert_array_equal(tensors[name], hf_smollm2_state[name], err_msg=name)


def test_smollm2_params_hold_the_unpermuted_projections(smollm2_converted, hf_smollm2_state):
    params = checkpoint.restore_params(smollm2_converted / checkpoint.PARAMS_DIR)
    layer = "model.layers.29.self_attn."
    expected = np.concatenate([hf_smollm2_state[layer + f"{n}_proj.weight"] for n in "qkv"]).T
    np.testing.assert_array_equal(
        np.asarray(params["layers_29"]["attn"]["qkv_proj"]["kernel"]), expected
    )


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_tokenizer_matches_transformers(smollm2_converted, hf_smollm2_tokenizer, text):
    tokenizer = Tokenizer.from_file(str(smollm2_converted / "tokenizer.json"))
    ids = tokenizer.encode(text).ids
    assert ids == hf_smollm2_tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_smollm2_digits_are_split_one_by_one(smollm2_converted):
    # SmolLM2's own tokenizer and llama.cpp ("smollm" pre-tokenizer) both isolate each digit
    # before BPE; GPT-2's split alone would keep " 12" together.
    tokenizer = Tokenizer.from_file(str(smollm2_converted / "tokenizer.json"))
    pieces = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("x 12")]
    assert pieces == ["x", "Ġ", "1", "2"]


def test_smollm2_chat_template_renders_like_transformers(smollm2_converted, hf_smollm2_tokenizer):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(smollm2_converted)
    messages = [{"role": "user", "content": "Say hi 👋"}]
    expected = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert expected.startswith("<|im_start|>system\n")
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        expected
    )
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
