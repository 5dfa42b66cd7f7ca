"""Shared Flax building blocks: linear layers, norms, rotary embeddings, MLPs.

Numerics: weights and activations in the parameter dtype (bf16 on GPU), with fp32
accumulation in matmuls and fp32 norms and rotary arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.ops.lora import LoraBatch, scope
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.quant import quantized_matmul
from spark_jax.ops.sharding import split_fused

Dtype = jnp.dtype


class Linear(nn.Module):
    """y = x @ kernel (+ bias); kernel [in, out] so the converter transposes HF's [out, in].

    A quantized kernel (fp8 / int8, spark_jax.ops.quant) comes with a ``kernel_scale`` param
    beside it and is read through ``quantized_matmul``; its adapters stay in the pool (never
    fused into the narrow kernel).
    """

    features: int
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    out_dtype: Dtype | None = None  # fp32 for logits; default: the parameter dtype
    options: KernelOptions = KernelOptions()  # the quantized matmul's kernel choice

    @nn.compact
    def __call__(self, x: jax.Array, lora: LoraBatch | None = None) -> jax.Array:
        # Once adapters were fused (LoraPool.fused_params) the kernel is [W | a]: one GEMM
        # gives x W and x a. Its width is read from the params, never declared (Flax would
        # refuse the shape), and the output is sliced, not the kernel (no copy of W per step).
        if self.has_variable("params", "kernel"):
            kernel = self.get_variable("params", "kernel")
        else:
            kernel = self.param(
                "kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features), self.dtype
            )
        out_dtype = self.out_dtype or self.dtype
        # The GEMM accumulates in fp32 and rounds once to the output dtype. Asking it for fp32
        # and converting after costs a kernel per projection: measured on the H200 (Llama-3-8B
        # shapes, bs=1) 4.87 -> 4.45 ms per decode step.
        if self.has_variable("params", "kernel_scale"):
            scale = self.get_variable("params", "kernel_scale")
            y = quantized_matmul(x, kernel, scale, out_dtype, self.options)
        else:
            y = jnp.einsum("...d,df->...f", x, kernel, preferred_element_type=out_dtype)
        h = None  # x a, from a fused kernel's A columns
        if kernel.shape[-1] > self.features:
            y, h = y[..., : self.features], y[..., self.features :]
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        if lora is not None:  # per-row adapters: y += ((x a) * row_mask) b
            y = y + _lora_delta(lora, x, h).astype(out_dtype)
        return y.astype(out_dtype)


def _lora_delta(lora: LoraBatch, x: jax.Array, h: jax.Array | None) -> jax.Array:
    """The adapters' update: x a from the pool, or h, the A columns of a fused kernel's GEMM."""
    if not lora.kernel_columns:
        return lora.delta(x)
    columns = 0 if h is None else h.shape[-1]
    if columns != lora.kernel_columns:
        raise ValueError(
            f"a fused adapter batch needs a kernel with {lora.kernel_columns} A columns beside "
            f"W, this one has {columns}: fuse the params first (LoraPool.fused_params)."
        )
    return lora.project(h)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as HF Llama/Qwen do)."""

    eps: float = 1e-6
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed.astype(self.dtype) * scale).astype(self.dtype)


def layer_norm(
    x: jax.Array,
    scale: jax.Array,
    bias: jax.Array,
    eps: float,
    dtype: Dtype,
    options: KernelOptions = KernelOptions(),
) -> jax.Array:
    """LayerNorm over the last axis with fp32 statistics, in ``dtype``: our one-kernel
    LayerNorm (``pallas_kernels/layer_norm.py``) on a GPU (bf16/f16, where it applies and
    ``options.pallas_layer_norm``), else ``layer_norm_reference``."""
    from pallas_kernels.layer_norm import layer_norm as kernel
    from pallas_kernels.layer_norm import layer_norm_applies

    if (
        options.pallas_layer_norm
        and options.mesh is None
        and jax.default_backend() == "gpu"
        and x.dtype in (jnp.bfloat16, jnp.float16)
        and layer_norm_applies(x)
    ):
        return kernel(x, scale, bias, eps, dtype)
    return layer_norm_reference(x, scale, bias, eps, dtype)


def layer_norm_reference(
    x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, dtype: Dtype
) -> jax.Array:
    """LayerNorm in jnp: statistics in fp32, one pass."""
    x32 = x.astype(jnp.float32)
    # One pass: E[x] and E[x^2] are sibling reductions of one input, which XLA's GPU
    # multi-output fusion can run as one kernel; the two-pass E[(x - E[x])^2] waits for
    # the mean, a second reduction kernel. In fp32 the cancellation costs precision only
    # when |mean| > ~256 std, past a bf16 input's own rounding; outlier channels raise the
    # variance, not the mean.
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    mean_square = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    var = jnp.maximum(mean_square - mean * mean, 0.0)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)


class LayerNorm(nn.Module):
    """LayerNorm with bias, statistics in fp32 (M2M100 / NLLB); see ``layer_norm``."""

    eps: float = 1e-5
    dtype: Dtype = jnp.float32
    options: KernelOptions = KernelOptions()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype)
        return layer_norm(x, scale, bias, self.eps, self.dtype, self.options)


def rotary_angles(positions: jax.Array, inv_freq: Sequence[float]) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, 1, H/2] of positions [B, T]: computed once a step for all layers."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]


def apply_rotary(x: jax.Array, angles: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates x [B, T, heads, H] by ``rotary_angles`` (HF's half-split layout), in fp32."""
    cos, sin = angles
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [D, 2F] matmul (held
    shard-major over ``shards`` devices under tensor parallelism)."""

    hidden_size: int
    intermediate_size: int
    dtype: Dtype = jnp.float32
    shards: int = 1
    options: KernelOptions = KernelOptions()

    @nn.compact
    def __call__(self, x: jax.Array, lora: LoraBatch | None = None) -> jax.Array:
        linear = functools.partial(Linear, dtype=self.dtype, options=self.options)
        gate_up = linear(2 * self.intermediate_size, name="gate_up_proj")(
            x, scope(lora, "gate_up_proj")
        )
        f = self.intermediate_size
        gate, up = split_fused(gate_up, (f, f), self.shards)
        hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(self.dtype)
        return linear(self.hidden_size, name="down_proj")(hidden, scope(lora, "down_proj"))


def sinusoidal_table(num_positions: int, dim: int, padding_idx: int | None) -> np.ndarray:
    """fairseq/M2M100 sinusoidal position table [num_positions, dim] (sin half, then cos half)."""
    half = dim // 2
    step = np.log(10000.0) / (half - 1)
    freqs = np.exp(np.arange(half, dtype=np.float32) * -step)
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * freqs[None, :]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1)
    if dim % 2 == 1:
        table = np.concatenate([table, np.zeros((num_positions, 1), np.float32)], axis=1)
    if padding_idx is not None:
        table[padding_idx] = 0.0
    return table.astype(np.float32)
