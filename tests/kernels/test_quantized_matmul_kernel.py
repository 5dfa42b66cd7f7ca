"""The quantized matmul kernel (``pallas_kernels/quantized_matmul.py``) against its jnp
reference, in interpret mode on the CPU (compiled on the GPU), and the dispatch of
``spark_jax.ops.quant``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quantized_matmul as qm
from spark_jax.ops import quant
from spark_jax.ops.layers import Linear
from spark_jax.ops.options import KernelOptions

ON_GPU = jax.default_backend() == "gpu"


def _operands(seed: int, lead: tuple[int, ...], d: int, f: int, weights: str):
    """x in bf16 and a kernel quantized per output channel, with columns of uneven scale."""
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    w = jax.random.normal(kw, (d, f)) * jnp.exp(jax.random.normal(ks, (1, f)))
    q, scale = quant.quantize(w, weights)
    x = jax.random.normal(kx, (*lead, d)).astype(jnp.bfloat16)
    return x, q, scale


@pytest.mark.parametrize("weights", ["fp8", "int8"])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 8)])  # one row, rows padded to 16, [B, T, D]
@pytest.mark.parametrize("d, f", [(512, 256), (576, 192)])  # SmolLM2's sizes: blocks of 64
def test_kernel_matches_the_reference(weights, lead, d, f):
    x, q, scale = _operands(len(lead) + lead[0], lead, d, f, weights)
    assert qm.quantized_matmul_applies(x, q, scale)
    # 8 programs: 2 column blocks x 4 splits of D, each walking 2 blocks of inputs.
    out = jax.jit(
        lambda *a: qm.quantized_matmul(*a, jnp.float32, programs=8, interpret=not ON_GPU)
    )(x, q, scale)
    ref = qm.quantized_matmul_reference(x, q, scale, jnp.float32)
    assert out.shape == (*lead, f) and out.dtype == jnp.float32
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.max(np.abs(out - ref)) <= 1e-5 * np.max(np.abs(ref))
    # and the reference is x @ the dequantized kernel
    dense = np.asarray(x, np.float32) @ np.asarray(quant.dequantize(q, scale))
    assert np.max(np.abs(ref - dense)) <= 1e-5 * np.max(np.abs(dense))


def test_applies_only_where_its_constraints_hold():
    x, q, scale = _operands(0, (4,), 512, 256, "fp8")
    assert qm.quantized_matmul_applies(x, q, scale)
    assert not qm.quantized_matmul_applies(x.astype(jnp.float32), q, scale)  # fp32 rows
    assert not qm.quantized_matmul_applies(jnp.zeros((17, 512), jnp.bfloat16), q, scale)
    group_scale = jnp.ones((4, 256), jnp.float32)  # per group of 128 inputs
    assert not qm.quantized_matmul_applies(x, q, group_scale)
    assert not qm.quantized_matmul_applies(x[:, :480], q[:480], scale)  # D not whole blocks
    assert not qm.quantized_matmul_applies(x, q.astype(jnp.bfloat16), scale)  # not narrow


def test_dispatch_keeps_the_reference_off_the_gpu_and_under_xla():
    x, q, scale = _operands(1, (2,), 512, 256, "int8")
    ref = qm.quantized_matmul_reference(x, q, scale, jnp.bfloat16)
    for options in (KernelOptions(), KernelOptions(implementation="xla")):
        if ON_GPU and options.implementation is None:
            continue  # the kernel's own path, checked above
        got = quant.quantized_matmul(x, q, scale, jnp.bfloat16, options)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    params = {"params": {"kernel": q, "kernel_scale": scale}}
    linear = Linear(256, dtype=jnp.bfloat16, options=KernelOptions(pallas_quantized_matmul=False))
    np.testing.assert_array_equal(
        np.asarray(linear.apply(params, x), np.float32), np.asarray(ref, np.float32)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("weights", ["fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_compiled_kernel_at_llama_shapes(weights, rows):
    x, q, scale = _operands(rows, (rows,), 4096, 14336, weights)
    out = jax.jit(lambda *a: qm.quantized_matmul(*a, jnp.float32))(x, q, scale)
    ref = qm.quantized_matmul_reference(x, q, scale, jnp.float32)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.max(np.abs(out - ref)) <= 1e-4 * np.max(np.abs(ref))
