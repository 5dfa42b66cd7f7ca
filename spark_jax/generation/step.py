"""The one decode step and the chunk of steps every driver runs on the device.

A step is ``forward`` (the model: a decode step over every cache row, or a verify step over
drafts) followed by a picking ``Rule`` (sampling, beam search, draft acceptance) that turns
the logits into the next tokens, applies the device form of the stop rule and writes what
the host will read into a ``record``. Every driver carries the same pytree, ``Carry``, from
step to step:

    generate / stream / generate_batch   Sampling        (forward = decode)
    the serving engine's decode          Sampling        (one step per scheduling round)
    the beam lane                        BeamSearch      (spark_jax.generation.beam)
    speculative verification             Verification    (forward = verify; speculative.py)
    the draft model's proposals          Drafting        (speculative.py)

``run_chunk`` runs up to ``num_steps`` steps in one device call (a jitted ``lax.while_loop``,
or the step alone for one); ``pick`` runs a rule alone on logits the caller already has (a
prefill's); ``forward`` runs the model's half of a step alone, for a driver whose host must
act between the two halves (guided rows: their masks need the last tokens, and are filled
while the forward runs). Rules are frozen dataclasses:
static jit arguments, so a rule's settings shape its program and equal rules share one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from spark_jax.generation.compile_options import DEVICE_LOOP_OPTIONS
from spark_jax.generation.request import device_done
from spark_jax.ops.sampling import (
    MAX_LOGPROBS,
    SampleOutput,
    SamplerBatch,
    SamplerPasses,
    apply_token_bitmask,
    count_tokens,
    sample,
)


@dataclass(frozen=True)
class LoopOptions:
    """How a driver runs its device loop; outputs never depend on these.

    steps_per_sync: steps per device call when nobody streams token by token.
    exit_early: a chunk ends as soon as every row is done (True) or always runs its steps
        (False). Ending early makes the loop's exit data-dependent, so on the GPU the host
        reads the loop predicate after every step; a fixed count wastes at most
        ``steps_per_sync - 1`` steps after the last row ends. Which is faster end to end
        depends on the model's step time (``python -m benchmarks nllb`` compares them).
    split_step: run every step of ``generate`` / ``generate_batch`` as a batch with a guided
        row runs it, whether or not a row is guided: one step per sync, as two programs
        (``forward``, then ``pick`` with a mask uploaded between them; all ones on free
        rows). For measuring that shape apart from the grammars' work (``benchmarks
        guided``).
    prefill_tokens_per_call: the most prompt positions (rows x the longest prompt, padded)
        one prefill call computes; a larger batch is prefilled in groups of rows, so its
        activations stay bounded (64 prompts of 4,096 tokens on Llama-3-8B shapes are 262k
        positions: one MLP's intermediate alone would be 15 GB, past an 80 GB card with the
        weights and cache). At least one row goes per call.
    """

    steps_per_sync: int = 8
    exit_early: bool = True
    split_step: bool = False
    prefill_tokens_per_call: int = 32768

    def __post_init__(self) -> None:
        if self.steps_per_sync < 1:
            raise ValueError(f"steps_per_sync must be >= 1, got {self.steps_per_sync}.")
        if self.prefill_tokens_per_call < 1:
            raise ValueError(
                f"prefill_tokens_per_call must be >= 1, got {self.prefill_tokens_per_call}."
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """What one step hands the next, on the device."""

    state: Any  # the runner's cache
    tokens: jax.Array  # int32[B]: each row's last token (the next decode input)
    active: jax.Array  # bool[B]: rows still generating
    num_generated: jax.Array  # int32[B]: tokens generated so far (the sampler's step index)
    picker: Any  # the rule's own state: token counts (sampling), the beam search tensors, ...


class Rule(Protocol):
    """A picking rule: frozen and hashable (a static jit argument)."""

    def forward(self, fn: Callable, params: Any, carry: Carry, rows: Any, lora: Any) -> Any:
        """Runs the model step ``fn``; returns (logits, new cache)."""

    def advance(
        self, logits: jax.Array, carry: Carry, rows: Any, record: Any, i: jax.Array
    ) -> tuple[Carry, Any]:
        """Picks from ``logits``, applies the stop rule, writes step ``i`` of ``record``."""

    def empty_record(self, carry: Carry, rows: Any, num_steps: int) -> Any:
        """The record a chunk of ``num_steps`` steps fills."""

    def go_on(self, carry: Carry, entry: Carry, rows: Any) -> jax.Array:
        """Whether an early-exiting chunk runs another step (``entry``: the chunk's input)."""


def decode_forward(fn: Callable, params: Any, carry: Carry, lora: Any) -> Any:
    """A decode step over every cache row: ``fn(params, tokens[B], active[B], cache, lora)``."""
    return fn(params, carry.tokens, carry.active, carry.state, lora)


# ---------------------------------------------------------------------------------------------
# Sampling: generate, stream, generate_batch and the serving engine.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleRows:
    """Each row's fixed sampling inputs for a run of steps."""

    sampler: SamplerBatch
    prompt_mask: jax.Array  # bool[B, V] (or [B, 1] when every row is plain greedy)
    max_tokens: jax.Array  # int32[B]
    # int32[B, ceil(V/32)]: the tokens each row may pick next (guided decoding), llguidance's
    # packed bitmask, all ones on free rows; None unless the rule is guided. A step's own.
    allowed: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunk:
    """The tokens of a chunk of steps, for the host: [B, steps] (top-n: [B, steps, 20])."""

    tokens: jax.Array
    logprobs: jax.Array | None
    top_logprobs: jax.Array | None
    top_ids: jax.Array | None
    valid: jax.Array  # bool: the row was generating at that step


@dataclass(frozen=True)
class Sampling:
    """Sampling (``ops.sampling.sample``) of the next token of every active row.

    greedy: every row is plain argmax: the sampler is skipped and no token counts are kept.
    want_logprobs: fill the record's logprob fields (each is a kernel more per step, and a
        small model's step is a few hundred kernels at launch latency).
    guided: the rows' ``allowed`` bitmask masks the logits first (vLLM's order), greedy or
        not; a row of all ones is left as it is.
    passes: the sampler's costly passes in the program (``SamplerPasses``; by default each
        is skipped at run time when no row asks for it).
    The picker state is the output token counts int32[B, V] (penalties).
    """

    greedy: bool = False
    want_logprobs: bool = False
    guided: bool = False
    passes: SamplerPasses = SamplerPasses()

    def forward(self, fn: Callable, params: Any, carry: Carry, rows: Any, lora: Any) -> Any:
        return decode_forward(fn, params, carry, lora)

    def empty_record(self, carry: Carry, rows: SampleRows, num_steps: int) -> Chunk:
        b = carry.tokens.shape[0]
        steps = lambda *shape, dtype: jnp.zeros((b, num_steps, *shape), dtype)
        logprob_fields = (None, None, None)
        if self.want_logprobs:
            logprob_fields = (
                steps(dtype=jnp.float32),
                steps(MAX_LOGPROBS, dtype=jnp.float32),
                steps(MAX_LOGPROBS, dtype=jnp.int32),
            )
        return Chunk(steps(dtype=jnp.int32), *logprob_fields, steps(dtype=bool))

    def advance(
        self, logits: jax.Array, carry: Carry, rows: SampleRows, record: Chunk, i: jax.Array
    ) -> tuple[Carry, Chunk]:
        if self.guided:
            logits = apply_token_bitmask(logits, rows.allowed)
        if self.greedy:
            picked = _argmax_output(logits)
            counts = carry.picker
        else:
            picked = sample(
                logits,
                rows.sampler,
                carry.picker,
                rows.prompt_mask,
                carry.num_generated,
                self.passes,
            )
            counts = count_tokens(carry.picker, picked.tokens, carry.active)
        tokens = jnp.where(carry.active, picked.tokens, carry.tokens)
        num_generated = carry.num_generated + carry.active.astype(jnp.int32)
        done = device_done(tokens, num_generated, rows.sampler, rows.max_tokens)
        fields = (record.logprobs, record.top_logprobs, record.top_ids)
        if self.want_logprobs:
            fields = (
                record.logprobs.at[:, i].set(picked.logprobs),
                record.top_logprobs.at[:, i].set(picked.top_logprobs),
                record.top_ids.at[:, i].set(picked.top_ids),
            )
        record = Chunk(
            record.tokens.at[:, i].set(tokens), *fields, record.valid.at[:, i].set(carry.active)
        )
        carry = Carry(carry.state, tokens, carry.active & ~done, num_generated, counts)
        return carry, record

    def go_on(self, carry: Carry, entry: Carry, rows: Any) -> jax.Array:
        return jnp.any(carry.active)


def _argmax_output(logits: jax.Array) -> SampleOutput:
    """Plain greedy picks; the logprob fields are zeros (no plain-greedy row reads them)."""
    tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    zeros = jnp.zeros(tokens.shape + (1,), jnp.float32)
    return SampleOutput(tokens, zeros[:, 0], zeros, zeros.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------
# The step and the chunk.


def step(
    fn: Callable, rule: Rule, params: Any, lora: Any, carry: Carry, rows: Any, record: Any, i: Any
) -> tuple[Carry, Any]:
    """The one step: the model's forward, then the rule's pick, stop rule and record."""
    logits, state = rule.forward(fn, params, carry, rows, lora)
    return rule.advance(logits, dataclasses.replace(carry, state=state), rows, record, i)


def run_chunk(
    fn: Callable,
    rule: Rule,
    params: Any,
    lora: Any,
    carry: Carry,
    rows: Any,
    num_steps: int,
    exit_early: bool = True,
) -> tuple[Carry, Any]:
    """Up to ``num_steps`` steps in one device call (fewer when ``exit_early`` and the rule
    says to stop: every row done). Returns the carry (its input is donated) and the record.

    A chunk of several steps is a device loop (``chunk_loop``, compiled with the loop
    options of ``compile_options``); a chunk of one is the step alone (``one_step``).
    """
    if num_steps == 1:
        return one_step(fn, rule, params, lora, carry, rows)
    return chunk_loop(fn, rule, params, lora, carry, rows, num_steps, exit_early)


@partial(
    jax.jit,
    static_argnames=("fn", "rule", "num_steps", "exit_early"),
    donate_argnames=("carry",),
    compiler_options=DEVICE_LOOP_OPTIONS,
)
def chunk_loop(
    fn: Callable,
    rule: Rule,
    params: Any,
    lora: Any,
    carry: Carry,
    rows: Any,
    num_steps: int,
    exit_early: bool = True,
) -> tuple[Carry, Any]:
    """``num_steps`` steps in a ``lax.while_loop`` (see ``run_chunk``)."""
    entry = carry

    def cond(loop: tuple[Any, Carry, Any]) -> jax.Array:
        i, c, _ = loop
        if not exit_early:  # a trip count XLA can see: no predicate read back per step
            return i < num_steps
        return (i < num_steps) & rule.go_on(c, entry, rows)

    def body(loop: tuple[Any, Carry, Any]) -> tuple[Any, Carry, Any]:
        i, c, record = loop
        c, record = step(fn, rule, params, lora, c, rows, record, i)
        return i + 1, c, record

    record = rule.empty_record(carry, rows, num_steps)
    _, carry, record = jax.lax.while_loop(cond, body, (0, carry, record))
    return carry, record


@partial(jax.jit, static_argnames=("fn", "rule"), donate_argnames=("carry",))
def one_step(
    fn: Callable, rule: Rule, params: Any, lora: Any, carry: Carry, rows: Any
) -> tuple[Carry, Any]:
    """One step, no loop around it (see ``run_chunk``): the rows ``go_on`` would stop are
    inactive, so the step leaves them as they are."""
    return step(fn, rule, params, lora, carry, rows, rule.empty_record(carry, rows, 1), 0)


# keep_unused: ``spent`` is never read, and an argument jit drops is donated to nothing.
@partial(
    jax.jit,
    static_argnames=("fn", "rule"),
    donate_argnames=("carry", "spent"),
    keep_unused=True,
)
def forward(
    fn: Callable,
    rule: Rule,
    params: Any,
    lora: Any,
    carry: Carry,
    rows: Any,
    spent: jax.Array | None = None,
) -> tuple[jax.Array, Carry]:
    """The model's half of a step alone: (logits, the carry with the new cache); ``pick`` on
    them is the other half.

    ``spent``: logits of an earlier step that nothing reads any more (their pick dispatched),
    donated so that the new logits take their buffer. With the cache and the carry donated
    too, every buffer of the program keeps its address from step to step, so on the GPU its
    command buffer (CUDA graph) is launched as recorded instead of re-recorded for new
    addresses on every call, which costs host time for each of its kernels.
    """
    del spent
    logits, state = rule.forward(fn, params, carry, rows, lora)
    return logits, dataclasses.replace(carry, state=state)


@partial(jax.jit, static_argnames=("rule",), donate_argnames=("carry",))
def pick(rule: Rule, logits: jax.Array, carry: Carry, rows: Any) -> tuple[Carry, Any]:
    """The rule alone on logits already computed (a prefill's): a one-step record."""
    return rule.advance(logits, carry, rows, rule.empty_record(carry, rows, 1), 0)
