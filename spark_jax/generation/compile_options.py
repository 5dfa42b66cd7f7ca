"""XLA options for the jitted device loops (a chunk of decode steps, a chunk of beam steps).

A decode step of a small model is many short kernels: NLLB-600M's decoder step is ~270
kernels in ~0.75 ms on the H200, so the gaps between launches are a large part of it. XLA's
command buffers record a program's kernels (and, with WHILE / CONDITIONAL, the loop itself)
as one CUDA graph, launched at once, and a data-dependent loop no longer reads its predicate
back to the host every step. Measured on the H200 with these per-jit options (the NLLB
benchmark): greedy 0.0813 -> 0.0696 s per call, beam 0.187 -> 0.161 s, outputs
unchanged. Given per jitted function (``jax.jit(compiler_options=...)``) rather
than through ``XLA_FLAGS``, they reach only these loops and need nothing of the user's
environment. CPU and other backends ignore the options. A fixed-count loop gains nothing from
them (0.68 -> 0.77 ms per NLLB step), so they stay off the single-step programs
(``step.one_step``).

``SPARK_JAX_COMMAND_BUFFERS=0`` in the environment (read at import) turns them off, for
comparisons and as a way out if a driver mishandles graphs.
"""

from __future__ import annotations

import os

# Command types XLA may put in a graph. CUSTOM_CALL and CUDNN cover cuDNN attention and
# kernels that declare themselves graph-safe; others split the graph, they do not fail.
_COMMAND_TYPES = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def device_loop_options() -> dict[str, str | int]:
    """The ``compiler_options`` of a jitted loop of decode steps ({} when turned off)."""
    if os.environ.get("SPARK_JAX_COMMAND_BUFFERS", "1") == "0":
        return {}
    # min_graph_size 1: a loop body is one command, and it should still become a graph.
    return {"xla_gpu_enable_command_buffer": _COMMAND_TYPES, "xla_gpu_graph_min_graph_size": 1}


DEVICE_LOOP_OPTIONS = device_loop_options()
