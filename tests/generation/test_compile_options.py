"""The device loops' XLA options: on by default, off with SPARK_JAX_COMMAND_BUFFERS=0, and
accepted by the compiler (CPU ignores the GPU options; an unknown name would be refused)."""

import jax
import jax.numpy as jnp

from spark_jax.generation import compile_options


def test_command_buffers_on_by_default_and_off_by_environment(monkeypatch):
    monkeypatch.delenv("SPARK_JAX_COMMAND_BUFFERS", raising=False)
    options = compile_options.device_loop_options()
    assert "WHILE" in options["xla_gpu_enable_command_buffer"].split(",")
    assert options["xla_gpu_graph_min_graph_size"] == 1
    monkeypatch.setenv("SPARK_JAX_COMMAND_BUFFERS", "0")
    assert compile_options.device_loop_options() == {}


def test_options_compile(monkeypatch):
    monkeypatch.delenv("SPARK_JAX_COMMAND_BUFFERS", raising=False)
    options = compile_options.device_loop_options()
    loop = jax.jit(
        lambda x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, x)),
        compiler_options=options,
    )
    assert float(loop(jnp.float32(1.5))[1]) == 12.0
