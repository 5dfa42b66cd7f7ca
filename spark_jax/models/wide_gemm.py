"""Model steps jitted by their rows: cuBLAS's GEMMs for programs of many rows, XLA's
default (Triton's fusions) for the rest.

XLA fuses a GEMM with the elementwise work around it into a Triton kernel; cuBLAS's GEMM,
with that work left in kernels of its own, is the faster at many rows and the slower at few.
Measured on an H100 (``benchmarks/decode_step_probe.py``, Llama-3-8B shapes, 300 keys a row):
a decode step of 1 row 5.68 ms with Triton's GEMMs against 7.44 with cuBLAS's, 8 rows 5.84 /
6.02, 32 rows 6.46 / 6.40, 64 rows 7.90 / 7.45, 256 rows 13.13 / 12.93; a ragged prefill of
1 024 positions (4 prompts, 64 decode rows riding) 28.18 / 25.82 ms, of 576 (a cached wave)
18.77 / 18.46. Backends other than the GPU ignore the option.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

try:
    from jax.core import Tracer
except ImportError:  # a jax that no longer exports it
    from jax._src.core import Tracer

WIDE_ROWS = 64  # programs whose matmuls have at least this many rows take cuBLAS's GEMMs
WIDE_GEMM_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


class JitByRows:
    """A function jitted twice, with XLA's default GEMMs and with ``WIDE_GEMM_OPTIONS``;
    each call (or ``lower``) takes the second where ``rows_arg(args, kwargs)``, an array
    with a row of the program's matmuls per element, has at least ``WIDE_ROWS``. Called
    inside another jitted function (that array a tracer) it is traced into that one, whose
    own options then hold (JAX takes compiler options only at the top)."""

    def __init__(
        self,
        fun: Callable,
        rows_arg: Callable[[tuple, dict], Any],
        compiler_options: dict[str, Any] | None = None,
        **jit_kwargs: Any,
    ):
        options = dict(compiler_options or {})
        self._narrow = jax.jit(fun, compiler_options=options or None, **jit_kwargs)
        self._wide = jax.jit(fun, compiler_options=options | WIDE_GEMM_OPTIONS, **jit_kwargs)
        # Inside another jit, options of its own are refused: the plain jit where it has none.
        self._nested = jax.jit(fun, **jit_kwargs) if options else self._narrow
        self._rows_arg = rows_arg
        functools.update_wrapper(self, fun)

    def _pick(self, args: tuple, kwargs: dict) -> Any:
        x = self._rows_arg(args, kwargs)
        if isinstance(x, Tracer):
            return self._nested
        return self._wide if math.prod(np.shape(x)) >= WIDE_ROWS else self._narrow

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._pick(args, kwargs)(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        return self._pick(args, kwargs).lower(*args, **kwargs)

    def _jits(self) -> list[Any]:
        return list({id(f): f for f in (self._narrow, self._wide, self._nested)}.values())

    def _cache_size(self) -> int:
        """Programs compiled, every jit together (as ``jax.jit``'s own ``_cache_size``)."""
        return sum(f._cache_size() for f in self._jits())

    def clear_cache(self) -> None:
        for f in self._jits():
            f.clear_cache()


def jit_by_rows(
    rows_arg: Callable[[tuple, dict], Any], **jit_kwargs: Any
) -> Callable[[Callable], JitByRows]:
    """``JitByRows`` as a decorator, as ``partial(jax.jit, ...)`` is one."""
    return lambda fun: JitByRows(fun, rows_arg, **jit_kwargs)


def argument(position: int, name: str, field: str | None = None) -> Callable[[tuple, dict], Any]:
    """``rows_arg`` for ``jit_by_rows``: the argument at ``position`` (or passed as ``name``;
    its ``field`` where given), e.g. a step's token ids ([B], [B, T] or a ragged batch's
    [N]: a row of the matmuls each)."""

    def rows_arg(args: tuple, kwargs: dict) -> Any:
        x = args[position] if len(args) > position else kwargs[name]
        return x if field is None else getattr(x, field)

    return rows_arg
