"""One request's state and the rules every driver applies to it.

Every driver (``generate`` / ``stream``, the serving engine, speculative decoding) keeps one
``RequestState`` per sequence and feeds it the tokens the device picked; the rules live here
once, each beside its other form:

- the stop rule: ``RequestState.add`` on the host (stop ids, stop strings, a guided row's
  complete grammar, max_tokens) and ``device_done`` on the device (stop ids and max_tokens;
  stop strings need text, grammars their matcher). The device's stops are a subset of the
  host's, so a device loop may retire rows early without changing any output;
- the prompt check (``check_prompt``, with the adapter lookup ``ops.lora.adapter_slot``) and
  the logprob record of one position (``token_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.ops.sampling import SamplerBatch, SamplingParams
from spark_jax.tokenizer import IncrementalDetokenizer


@dataclass
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class GenerationResult:
    """What one request produced."""

    output_tokens: list[int]
    finish_reason: str  # "stop" | "length" (the engine adds "abort" | "error")
    text: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)


@dataclass
class StreamOutput:
    """One streamed token: its id, the text it completes (may be empty) and its logprobs."""

    index: int  # which request of the batch
    token_id: int
    text_delta: str
    logprobs: TokenLogprobs | None = None


# ---------------------------------------------------------------------------------------------
# Checks made before any device work.


def check_prompt(
    prompt: Sequence[int],
    vocab_size: int,
    max_len: int | None = None,
    max_tokens: int = 0,
    what: str = "the prompt",
) -> list[int]:
    """The prompt as a list of ints; refuses an empty one, ids outside the vocabulary, and
    (``max_len`` given) a prompt plus ``max_tokens`` longer than ``max_len`` positions."""
    # One pass in numpy: a serving engine checks every prompt on the request's path, and a
    # list comprehension over a 1,000-token prompt costs ~0.1 ms of Python.
    try:
        array = np.fromiter(prompt, np.int64, count=len(prompt))
    except OverflowError:  # ids past int64: out of the vocabulary, said below
        array = None
    ids = [int(t) for t in prompt] if array is None else array.tolist()
    if not ids:
        raise ValueError(f"{what} is empty; give at least one token.")
    if array is None or ((array < 0) | (array >= vocab_size)).any():
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise ValueError(f"{what} has token ids {bad[:5]} outside [0, {vocab_size}).")
    if max_len is not None and len(ids) + max_tokens > max_len:
        raise ValueError(
            f"{what} has {len(ids)} tokens and asks for {max_tokens} more, past the {max_len} "
            "positions available; shorten it or lower max_tokens."
        )
    return ids


def params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt: None is greedy, one is shared, a list must match."""
    if params is None:
        return [SamplingParams(temperature=0.0)] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each.")
    return list(params)


# ---------------------------------------------------------------------------------------------
# The stop rule, device form (the host form is RequestState.add).


def device_done(
    tokens: jax.Array, num_generated: jax.Array, batch: SamplerBatch, max_tokens: jax.Array
) -> jax.Array:
    """bool[B]: a stop id past min_tokens, or max_tokens reached (no stop strings: the host
    checks those), so the device's retirements are a subset of ``RequestState.add``'s."""
    is_stop = jnp.any(tokens[:, None] == batch.stop_ids, axis=-1)
    return (is_stop & (num_generated >= batch.min_tokens)) | (num_generated >= max_tokens)


# ---------------------------------------------------------------------------------------------
# The logprob record of one position.


def token_logprobs(host: Any, row: int, step: int | None, n: int) -> TokenLogprobs:
    """The TokenLogprobs at ``[row, step]`` of host arrays with fields tokens, logprobs,
    top_ids, top_logprobs (``step`` None: arrays with no step axis), keeping the top ``n``."""
    at = (row,) if step is None else (row, step)
    ids, values = host.top_ids[at][:n], host.top_logprobs[at][:n]
    top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return TokenLogprobs(int(host.tokens[at]), float(host.logprobs[at]), top)


# ---------------------------------------------------------------------------------------------
# One request's state.


class RequestState:
    """One sequence's output so far: tokens, text, logprobs, and its end once it is known."""

    def __init__(
        self,
        index: int,
        prompt: Sequence[int],
        params: SamplingParams,
        eos_token_ids: Sequence[int],
        tokenizer: Any = None,
        guide: Any = None,
    ):
        """``guide``: the row's ``guided.GuidedRow`` when ``params.guided`` constrains it."""
        self.index = index
        self.prompt = list(prompt)
        self.params = params
        self.num_prompt_tokens = len(prompt)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.stop_ids = params.stop_token_set(eos_token_ids)
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        self.text = ""  # text decoded so far (before stop-string truncation)
        self.emitted = 0  # characters of text already released
        self.guide = guide
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.stopped_on_host = False  # ended by a rule the device cannot see (see add)
        # Text that might be the start of a stop string is held back from the stream.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, logprobs: TokenLogprobs | None = None) -> str:
        """Records one token and applies the stop rule; returns the text it releases."""
        self.tokens.append(token)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        if self.detok is not None:
            self.text += self.detok.add(token)
        if self.guide is not None:
            self.guide.advance(token)
        counted = len(self.tokens) >= self.params.min_tokens
        if token in self.stop_ids and counted:
            self.finish("stop", token)
        elif self.params.stop and counted and self._match_stop_string():
            self.stopped_on_host = True
        elif self.guide is not None and self.guide.finished:
            # The grammar is complete: nothing but EOS could follow, so end here, a step early.
            self.finish("error" if self.guide.error else "stop")
            self.stopped_on_host = True
        elif len(self.tokens) >= self.params.max_tokens:
            self.finish("length", None)
        return self._release()

    def add_plain(self, tokens: np.ndarray, stops: np.ndarray, ends: np.ndarray) -> None:
        """``add`` for a run of tokens checked as arrays (``RowLimits.check``): no text, stop
        strings or logprobs. ``stops`` / ``ends`` mark each token's stop-id / any end."""
        end = int(ends.argmax()) if ends.any() else -1
        self.tokens.extend(tokens[: len(tokens) if end < 0 else end + 1].tolist())
        if end >= 0:  # a stop id wins over the length limit at the same token, as in add
            self.finish("stop", int(tokens[end])) if stops[end] else self.finish("length", None)

    @property
    def plain(self) -> bool:
        """No text, stop strings, grammar or logprobs: its tokens can be checked as arrays."""
        return (
            self.detok is None
            and not self.params.stop
            and self.guide is None
            and self.logprobs is None
        )

    def finish(self, reason: str, stop: int | str | None = None) -> None:
        """Ends the request ("stop", "length", "abort", "error")."""
        self.finish_reason = reason
        self.stop_reason = stop
        if self.detok is not None and not isinstance(stop, str):
            self.text += self.detok.finish()

    def _match_stop_string(self) -> bool:
        window = self.text[max(0, self.emitted - self.holdback) :]
        offset = len(self.text) - len(window)
        best = None
        for stop in self.params.stop:
            at = window.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        self.text = self.text[: offset + best[0]]
        self.finish("stop", best[1])
        return True

    def _release(self) -> str:
        end = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta

    def result(self, timings: dict[str, float]) -> GenerationResult:
        return GenerationResult(
            output_tokens=self.tokens,
            finish_reason=self.finish_reason or "length",
            text=self.text if self.detok is not None else None,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            num_prompt_tokens=self.num_prompt_tokens,
            timings=timings,
        )


@dataclass(frozen=True)
class RowLimits:
    """The host stop rule of many rows as arrays, for checking a chunk of tokens at once."""

    stop_ids: np.ndarray  # int[B, W]: each row's stop ids, padded with -1
    min_tokens: np.ndarray  # int[B]
    max_tokens: np.ndarray  # int[B]

    @classmethod
    def of(cls, rows: Sequence[RequestState]) -> RowLimits:
        width = max(1, *(len(r.stop_ids) for r in rows))
        stop_ids = np.full((len(rows), width), -1, np.int64)
        for i, r in enumerate(rows):
            stop_ids[i, : len(r.stop_ids)] = sorted(r.stop_ids)
        return cls(
            stop_ids,
            np.array([r.params.min_tokens for r in rows]),
            np.array([r.params.max_tokens for r in rows]),
        )

    def check(
        self, tokens: np.ndarray, valid: np.ndarray, held: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(stops, ends) bool[B, steps] of tokens[B, steps] (``valid`` a prefix of each row),
        ``held`` int[B] the tokens each row had before: the rule of ``RequestState.add``."""
        count = held[:, None] + np.cumsum(valid, axis=1)
        is_stop = (tokens[:, :, None] == self.stop_ids[:, None, :]).any(-1)
        stops = is_stop & (count >= self.min_tokens[:, None])
        ends = valid & (stops | (count >= self.max_tokens[:, None]))
        return stops, ends
