"""The decoder's steps take cuBLAS's GEMMs where their matmuls have many rows, XLA's default
(Triton's fusions) elsewhere (``spark_jax.models.wide_gemm``): on the GPU each is the faster
there. The CPU compiles both alike; what is checked here is which options a step's program
carries, and that the two programs count as the step's compiles."""

import jax.numpy as jnp
import numpy as np

from spark_jax.models import decoder
from spark_jax.models.wide_gemm import WIDE_GEMM_OPTIONS, WIDE_ROWS, argument, jit_by_rows


def _options(lowered) -> dict:
    return dict(lowered._lowering._compiler_options_kvs)


def test_decode_and_prefill_steps_take_cublas_gemms_from_wide_rows(tiny_llama):
    _, model = tiny_llama
    runner = model.runner
    for rows in (1, WIDE_ROWS - 1, WIDE_ROWS, 2 * WIDE_ROWS):
        state = runner.init_state(rows, 32)
        tokens = jnp.arange(rows, dtype=jnp.int32) % model.config.vocab_size
        lowered = runner.lower_decode(state, tokens, jnp.ones((rows,), bool))
        assert _options(lowered) == (WIDE_GEMM_OPTIONS if rows >= WIDE_ROWS else {}), rows
    state = runner.init_state(4, 64)
    for total in (32, WIDE_ROWS):  # a ragged prefill: its rows are its stream's positions
        prompts = [[1, 2, 3], [4] * 20]
        lowered = runner.lower_prefill(state, [0, 1], prompts, min_len=total, ragged=True)
        assert _options(lowered) == (WIDE_GEMM_OPTIONS if total >= WIDE_ROWS else {}), total


def test_both_programs_are_the_steps_compiles_and_agree():
    @jit_by_rows(argument(0, "x"), static_argnames=("scale",))
    def gram(x, scale=1.0):
        return scale * x @ x.T

    before = gram._cache_size()
    narrow = np.asarray(gram(jnp.ones((WIDE_ROWS - 1, 8)), scale=2.0))
    wide = np.asarray(gram(x=jnp.ones((WIDE_ROWS, 8)), scale=2.0))
    assert gram._cache_size() == before + 2
    np.testing.assert_array_equal(narrow, wide[:-1, :-1])
    assert gram.__name__ == "gram"
    assert decoder.decode.__doc__.startswith("One token per cache row")
