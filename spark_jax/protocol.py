"""The runner protocols: everything generation and serving use of a model family.

A family's runner (``models.decoder.Runner``, ``models.nllb.NllbRunner``) implements one of
these; drivers read these names directly and never probe for a capability. The pure steps
(``decode_fn``, ``verify_fn``) are what the generation core's jitted chunk calls:
``fn(params, tokens, active_or_lengths, cache, lora) -> (logits, cache)``, one object per
runner, so a jit taking it as a static argument compiles once per model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import numpy as np


class Runner(Protocol):
    """What every family gives the drivers: a cache of rows, prefill, a decode step, LoRA."""

    is_encoder_decoder: bool
    # A step with an adapter row and one without are different programs (the latter passes
    # lora=None), so a serving engine warms both up.
    adapter_rows_change_the_program: bool
    config: Any
    params: Any  # read at every step: adapter changes replace the tree, never edit it
    eos_token_ids: tuple[int, ...]
    lora_pool: Any  # a spark_jax.ops.lora.LoraPool once LoRA is enabled, else None
    decode_fn: Callable[..., tuple[jax.Array, Any]]

    def init_state(self, num_slots: int, max_len: int, max_prompt_len: int = 0) -> Any:
        """An empty cache with ``num_slots`` rows of ``max_len`` decoder positions."""

    def prefill(
        self,
        state: Any,
        slots: Sequence[int],
        prompts: Sequence[Sequence[int]],
        requests: Sequence[Any] = (),
        **kwargs: Any,
    ) -> tuple[jax.Array, Any]:
        """Starts one sequence per slot; returns the logits [len(slots), V] of its next token."""

    def decode(
        self,
        state: Any,
        tokens: jax.Array,
        active: jax.Array,
        adapters: Sequence[int] | None = None,
    ) -> tuple[jax.Array, Any]:
        """One token for every row of the cache; returns logits [num_slots, V]."""

    def lower_prefill(self, state: Any, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """``prefill``'s program for these inputs, traced but not compiled (warm-up)."""

    def lower_decode(self, state: Any, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """``decode``'s program for these inputs, traced but not compiled (warm-up)."""

    def lora_input(self, adapters: Sequence[int]) -> Any:
        """The adapter input of a step whose rows use ``adapters`` (None: base only)."""

    def lora_params(self, params: Any) -> Any:
        """``params`` as this family's steps read them with the current adapter pool."""

    def logits(self, ids: Sequence[int], *args: Any, **kwargs: Any) -> np.ndarray:
        """float32 [T, V]: the logits of every position of one sequence."""


class DecoderRunner(Runner, Protocol):
    """A decoder-only family: adds the verify step of speculative decoding.

    Its ``prefill``, ``decode`` and ``verify`` (and their ``lower_*``) also take
    ``with_hidden=True``, which returns (logits, final hidden states [B, T, D]) in place of
    the logits: the serving engine keeps them for a draft head.
    """

    verify_fn: Callable[..., tuple[jax.Array, Any]]
    # verify_fn that also returns the final hidden states: ((logits, hidden[B, T, D]), cache)
    verify_hidden_fn: Callable[..., tuple[tuple[jax.Array, jax.Array], Any]]

    def verify(
        self,
        state: Any,
        tokens: jax.Array,
        lengths: jax.Array,
        adapters: Sequence[int] | None = None,
        with_hidden: bool = False,
    ) -> tuple[Any, Any]:
        """Scores tokens [B, T] (first ``lengths[b]`` real); logits at every position."""

    def lower_verify(self, state: Any, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """``verify``'s program for these inputs, traced, not compiled (the engine's warm-up)."""


class EncoderDecoderRunner(Runner, Protocol):
    """An encoder-decoder family (NLLB): sources, target languages, beams' row reorders."""

    max_source_len: int
    default_tgt_lang: str | None

    def language_id(self, code: str) -> int:
        """The token id of a language code; unknown codes are refused."""

    def target_language_id(self, request: Any) -> int:
        """The forced first token of a request (its ``tgt_lang``, else the default)."""

    def source_tokens(self, prompt: Sequence[int], request: Any = None) -> list[int]:
        """The source as the encoder reads it (a raw source with ``src_lang`` gets its
        language token and ``</s>``); refuses one this model cannot encode."""

    def check_source(self, prompt: Sequence[int], request: Any = None) -> None:
        """Refuses a source this model cannot encode (length, language tokens)."""
