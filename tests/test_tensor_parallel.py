"""Tensor parallelism (issue 26, CPU acceptance 1-3): one model over N simulated CPU devices,
LoRA adapters included.

JAX fixes its device count when it starts, so the checks run in child processes
(tests/tensor_parallel_checks.py): one with 8 devices for the parity, loading and engine
checks, then two joined by ``jax.distributed`` on localhost. This process (one device) checks
the refusals.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_LLAMA

from spark_jax.config import config_from_hf
from spark_jax.ops.sharding import make_mesh

CHECKS = Path(__file__).with_name("tensor_parallel_checks.py")
ROOT = Path(__file__).parents[1]
SHARDS = ("2", "4", "8")


def child(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    # The children ask for their own device counts; the suite's other flags pass through.
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    return subprocess.Popen(
        [sys.executable, str(CHECKS), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finished(process: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tensor_parallel")


@pytest.fixture(scope="module")
def report(out) -> dict:
    finished(child("single", str(out)))
    return json.loads((out / "single.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "nllb"])
def test_logits_at_tp_2_4_8_equal_tp_1_within_1e_5(report, family):
    diffs = report["logits"][family]
    assert sorted(diffs) == sorted(SHARDS)
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "nllb"])
def test_greedy_tokens_under_tp_are_those_of_one_device(report, family):
    runs = report["greedy"][family]
    assert len(runs) >= 2
    assert all(tokens == runs["1"] for tokens in runs.values()), runs


@pytest.mark.parametrize("family", ["llama", "nllb"])
def test_adapters_under_tp_2_4_8_give_the_logits_of_one_device(report, family):
    """LoRA on every projection (fused Q/K/V and gate/up, KV heads copied at TP = 4, 8): the
    adapter's logits equal TP = 1's, and the adapter moves them (its update is there)."""
    diffs = report["lora"][family]
    assert diffs["effect"] > 0.1
    assert max(diffs[n] for n in SHARDS) <= 1e-5, diffs


def test_a_tp_4_engine_is_batch_invariant_and_never_compiles_after_warmup(report):
    engine = report["engine"]
    assert engine["batch_invariant"]
    assert engine["compiles_after_warmup"] == 0
    assert engine["pages_spec"] == "P(None, None, 'tp')"  # pages split by KV heads
    assert engine["mixed_steps"] > 0  # decode rows rode in prefill batches


def test_speculative_decoding_at_tp_4_gives_the_greedy_tokens_of_one_device(report):
    """A draft model laid out as the target (alone and in the engine), prompt lookup and a
    draft head in the engine, at TP = 4: plain greedy's tokens at TP = 1, with drafts kept."""
    seen = report["speculative"]
    assert seen["alone_draft"] and seen["engine_ngram"] and seen["engine_draft"], seen
    assert seen["engine_head"], seen  # the head reads the sharded target's hidden states
    assert seen["engine_draft_accepted"] > 0  # the draft is the target: most are kept
    assert "load the draft with tensor_parallel=4" in seen["other_layout_refused"]


def test_our_kernels_run_per_shard_at_tp_4(report):
    """The one-query and fp8-cache kernels (interpreted) under shard_map, each device its
    heads: XLA's reference on one device, the output split by heads."""
    seen = report["kernels"]
    assert seen["one_query"] <= 1e-5, seen
    assert seen["one_query_spec"] == "P(None, None, 'tp', None)", seen
    assert seen["fp8_dense"] <= 2e-2 and seen["fp8_paged"] <= 2e-2, seen  # bf16 outputs


@pytest.mark.parametrize("case", ["llama_tp4", "qwen2_tp8", "nllb_tp8"])
def test_no_device_holds_a_full_copy_of_a_sharded_weight_while_loading(report, case):
    seen = report["loading"][case]
    assert seen["sharded_leaves"] > 0
    assert seen["full_copies"] == []
    tp = int(case.rsplit("tp", 1)[1])
    assert seen["largest_device_fraction"] <= 1 / tp + 1e-9
    assert seen["cache_specs"] == ["P(None, None, 'tp', None)"] and not seen["cache_full_copies"]


def test_two_processes_under_jax_distributed_give_the_logits_of_one(report, out):
    port = str(free_port())
    checkpoint = str(out / "llama" / "converted")
    ranks = [child("multi", str(rank), port, checkpoint, str(out)) for rank in (0, 1)]
    for process in ranks:
        finished(process, timeout=240)
    one = np.load(out / "llama_logits.npy")
    for rank in (0, 1):
        np.testing.assert_allclose(np.load(out / f"multi_{rank}.npy"), one, atol=1e-5)


def test_tensor_parallel_refuses_more_devices_than_there_are():
    with pytest.raises(ValueError, match="more devices than the 1 this process sees"):
        make_mesh(2)  # what load(path, tensor_parallel=2) builds first


def test_tensor_parallel_must_divide_the_heads_and_the_kv_heads():
    config = config_from_hf({"model_type": "llama", **TINY_LLAMA})  # 4 heads over 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide the 4 attention heads"):
        config.for_tensor_parallel(3)
    assert config.for_tensor_parallel(4).num_kv_heads == 4  # each shard a copy of one KV head
    with pytest.raises(ValueError, match="KV heads"):
        config_from_hf(
            {
                "model_type": "llama",
                **TINY_LLAMA,
                "num_attention_heads": 6,
                "num_key_value_heads": 3,
                "hidden_size": 48,
            }
        ).for_tensor_parallel(2)
