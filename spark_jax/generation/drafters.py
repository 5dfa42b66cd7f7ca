"""Drafters of speculative decoding: who proposes the K tokens the target then verifies.

Two kinds, by where the drafts are made:

  host drafters (the ``Drafter`` protocol): given the context, return a ``Draft``; the
      speculative loop runs one verify step per proposal. ``PromptLookupDrafter`` (``"ngram"``)
      continues the most recent n-gram match in the context, with no model.
  device drafters (the ``DeviceDrafter`` protocol): make their drafts inside the jitted
      speculative step, so several steps run per host sync. Each holds a frozen, hashable
      ``program`` (a static argument of the chunk) and gives its arrays (``params``) and its
      per-row state to the chunk: ``DraftModelDrafter`` (``"draft"``: a smaller model with its
      own KV cache), ``LayerSkipDrafter`` (``"layer-skip"``: the target less some layers) and
      ``HeadDrafter`` (``"head"``: a draft head over the target's hidden states,
      spark_jax.models.draft_head).

A device program's state has one row per cache row and follows the target's: each program
``propose``s K drafts from the rows' last tokens, and ``accept``s the verdict (each row's
accepted count, its new target length), rolling its own cache back as the target's is.
Sampled rows draw their drafts at the row's temperature from the drafter's softmax, which
is the q the rejection rule reads; greedy rows take the argmax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import ModelConfig
from spark_jax.generation.step import Carry
from spark_jax.model import Model
from spark_jax.models import draft_head
from spark_jax.ops.sampling import SamplingParams

# Folded into a row's key for the drafter's own draws: they must be independent of the
# target's acceptance draws, or the rejection rule no longer yields the target's distribution.
DRAFT_STREAM = 0x6472_6166


# ---------------------------------------------------------------------------------------------
# Host drafters.


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distributions they were drawn from."""

    tokens: list[int]  # at most the k asked for; fewer (or none) when the drafter has no guess
    probs: jax.Array | None = None  # f32[len(tokens), V] q; None: deterministic (q one-hot)


class Drafter(Protocol):
    """A host drafter: ``propose`` receives the whole context (prompt + accepted output)."""

    def start(self, prompt: Sequence[int], params: SamplingParams, max_context: int) -> None:
        """Begins a request whose context will never exceed ``max_context`` tokens."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens that might follow ``context``."""

    def finish(self) -> None:
        """Ends the request (frees any state)."""


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the context's tail.

    Tries the last ``max_ngram`` tokens first, then shorter tails down to ``min_ngram``. No
    model and no state: cheap, and strong on extractive tasks (quoting, editing, code).
    A continuation that runs into the context's end goes on copying what it has proposed (an
    overlapping copy, as LZ77 decodes one): a tail repeating with period p proposes the
    period again, ``k`` tokens, where the plain continuation would stop after p - 1.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(
                f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, "
                f"max_ngram={max_ngram}."
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, prompt: Sequence[int], params: SamplingParams, max_context: int) -> None:
        del prompt, params, max_context

    def propose(self, context: Sequence[int], k: int) -> Draft:
        ids = np.asarray(context, np.int64)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if k < 1 or len(ids) <= n:
                continue
            # Windows of ids[:-1] end before the last token: each match has a continuation,
            # and the tail never matches itself.
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                period = len(ids) - start  # the copy's distance back
                return Draft(ids[start + np.arange(k) % period].tolist())
        return Draft([])

    def finish(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Device drafters: what the speculative step hands them, and their protocol.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Outcome:
    """A verify step's result, as a device drafter's ``accept`` reads it (B rows)."""

    active: jax.Array  # bool[B]: rows that took part in the step
    num_accepted: jax.Array  # int32[B]: drafts kept (n)
    tokens: jax.Array  # int32[B, T]: the kept drafts, then the target's token (n + 1 real)
    target_lengths: jax.Array  # int32[B]: the target cache's lengths after the rollback
    hidden: jax.Array | None  # f32[B, T, D]: the target's states at the step's positions


class DeviceProgram(Protocol):
    """A device drafter's program: frozen and hashable (a static argument of the chunk)."""

    needs_hidden: bool  # the verify step must return the target's hidden states

    def propose(
        self,
        target_params: Any,
        params: Any,
        state: Any,
        carry: Carry,
        keys: jax.Array,
        temperature: jax.Array,
        k: int,
        sampled: bool,
    ) -> tuple[jax.Array, jax.Array | None, Any]:
        """(drafts int32[B, k], q f32[B, k, V] when ``sampled`` else None, new state) after
        each row's last token ``carry.tokens``. ``keys``: the rows' draft keys u32[B, 2]."""

    def accept(self, state: Any, outcome: Outcome) -> Any:
        """The state after the verdict: caches rolled back to what the target kept."""


@runtime_checkable
class DeviceDrafter(Protocol):
    """What ``generate_speculative`` asks of a device drafter."""

    program: Any  # a DeviceProgram

    def params(self, target: Model) -> Any:
        """The arrays the program reads (a pytree)."""

    def start(
        self, target: Model, prompts: Sequence[Sequence[int]], max_len: int, k: int, prefill: Any
    ) -> Any:
        """The state of rows for ``prompts`` (cache rows 0..B-1) of up to ``max_len`` tokens,
        drafting ``k`` per step; ``prefill``: the target's prefill (``TargetPrefill``)."""


@dataclass(frozen=True)
class TargetPrefill:
    """The target's prefill as a drafter may read it: hidden states when asked for."""

    hidden: jax.Array | None  # f32[B, T, D]: the prompt positions' final states


def _pick(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, sampled: bool
) -> tuple[jax.Array, jax.Array | None]:
    """Each row's draft from its logits [B, V]: argmax, or (``sampled``) a draw with the row's
    key u32[B, 2] at its temperature (argmax where it is 0), with the q it was drawn from."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sampled:
        return greedy, None
    hot = temperature > 0
    scaled = logits / jnp.where(hot, temperature, 1.0)[:, None]
    drawn = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
    one_hot = jax.nn.one_hot(greedy, logits.shape[-1], dtype=jnp.float32)
    q = jnp.where(hot[:, None], jax.nn.softmax(scaled, axis=-1), one_hot)
    return jnp.where(hot, drawn, greedy), q


def _draft_keys(keys: jax.Array, carry: Carry, k: int) -> jax.Array:
    """u32[k, B, 2]: the key of each draft of each row, unique over the row's request."""
    fold = jax.vmap(jax.random.fold_in)
    step_keys = fold(keys, carry.num_generated)
    return jnp.stack([fold(step_keys, jnp.full_like(carry.num_generated, j)) for j in range(k)])


# ---------------------------------------------------------------------------------------------
# A draft model (and layer skip, the target less some layers).


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ModelDraftState:
    """The draft model's cache rows and the token it still owes its cache.

    After a step whose drafts were all kept, the last draft is in the target's cache but was
    never fed to the draft model (``lag`` 1): the next step feeds it with the last token.
    """

    cache: Any  # the draft model's KV cache, one row per target row
    lag: jax.Array  # int32[B]: 0 or 1 tokens behind the target's cache
    lag_token: jax.Array  # int32[B]: that token


@dataclass(frozen=True)
class ModelDrafts:
    """The program of a draft model: its runner's pure decode and verify steps."""

    decode_fn: Callable
    verify_fn: Callable
    needs_hidden = False

    def propose(self, target_params, params, state, carry, keys, temperature, k, sampled):
        del target_params
        last, active = carry.tokens, carry.active
        lagging = state.lag > 0
        first = jnp.stack([jnp.where(lagging, state.lag_token, last), last], axis=1)
        lengths = jnp.where(active, 1 + state.lag, 0)
        logits, cache = self.verify_fn(params, first, lengths, state.cache, None)
        logits = jnp.take_along_axis(logits, jnp.maximum(lengths - 1, 0)[:, None, None], 1)[:, 0]
        steps = _draft_keys(keys, carry, k)
        token, q = _pick(logits, steps[0], temperature, sampled)

        def one(loop, step):
            token, cache = loop
            logits, cache = self.decode_fn(params, token, active, cache, None)
            new, q = _pick(logits, step, temperature, sampled)
            return (new, cache), (new, q)

        # The last draft is never fed here: the target scores it, and ``accept`` notes it.
        (_, cache), (rest, rest_q) = jax.lax.scan(one, (token, cache), steps[1:])
        drafts = jnp.concatenate([token[:, None], rest.T], axis=1)
        if sampled:
            q = jnp.concatenate([q[:, None], jnp.swapaxes(rest_q, 0, 1)], axis=1)
        return drafts, q, dataclasses.replace(state, cache=cache)

    def accept(self, state, outcome):
        fed = state.cache.lengths  # the target's old length + k: the last token and k - 1 drafts
        kept = jnp.minimum(fed, outcome.target_lengths)
        lag = jnp.where(outcome.active, outcome.target_lengths - kept, state.lag)
        n = outcome.num_accepted
        behind = jnp.take_along_axis(outcome.tokens, jnp.maximum(n - 1, 0)[:, None], 1)[:, 0]
        return ModelDraftState(
            state.cache.with_lengths(jnp.where(outcome.active, kept, fed)),
            lag,
            jnp.where(outcome.active, behind, state.lag_token),
        )


class DraftModelDrafter:
    """A smaller model sharing the target's tokenizer drafts k tokens, one decode step each,
    on the device. Sampled rows draw from its softmax at the row's temperature (its other
    processors are not applied: any q is exact under the rejection rule, this one is merely
    close to p)."""

    def __init__(self, draft_model: Model):
        if draft_model.config.is_encoder_decoder:
            raise ValueError("a draft model must be decoder-only.")
        self.model = draft_model
        runner = draft_model.runner
        self.program = ModelDrafts(runner.decode_fn, runner.verify_fn)

    def params(self, target: Model) -> Any:
        del target
        return self.model.runner.params

    def start(self, target, prompts, max_len, k, prefill) -> ModelDraftState:
        del target, k, prefill
        runner = self.model.runner
        state = runner.init_state(len(prompts), max_len)
        _, state = runner.prefill(state, list(range(len(prompts))), prompts)
        b = len(prompts)  # two arrays: the carry is donated, each leaf once
        return ModelDraftState(state, jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32))


def skip_layers(model: Model, skip: Sequence[int]) -> Model:
    """The model without the layers ``skip``: a derived config and the kept layers' weights.

    The weights are shared with ``model`` (no copy); the derived model compiles its own steps.
    """
    num_layers = model.config.num_layers
    skipped = set(skip)
    if not skipped <= set(range(num_layers)):
        raise ValueError(f"skip {sorted(skipped)} names layers outside [0, {num_layers}).")
    kept = [i for i in range(num_layers) if i not in skipped]
    if not kept:
        raise ValueError("skip names every layer; keep at least one.")
    windows = model.config.sliding_windows
    config = dataclasses.replace(
        model.config,
        num_layers=len(kept),
        sliding_windows=tuple(windows[i] for i in kept) if windows else (),
    )
    params = {k: v for k, v in model.params.items() if not k.startswith("layers_")}
    params |= {f"layers_{j}": model.params[f"layers_{i}"] for j, i in enumerate(kept)}
    return Model(config, params, model.tokenizer, model.generation_config)


class LayerSkipDrafter(DraftModelDrafter):
    """Self-speculation: the target itself with the layers ``skip`` left out drafts."""

    def __init__(self, model: Model, skip: Sequence[int]):
        super().__init__(skip_layers(model, skip))
        self.skip = tuple(sorted(set(skip)))


# ---------------------------------------------------------------------------------------------
# A draft head.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HeadState:
    """The head's cache rows and the positions it has yet to read (the last step's kept ones).

    The head's entry at position p reads (h_p, t_{p+1}); after a step, the target's true
    states of the kept positions replace what the chain guessed there, so each step starts
    by running the head over them (``count`` of the ``T`` slots) from the target's length
    before the step.
    """

    cache: Any  # the head's KV cache (spark_jax.models.draft_head.init_cache)
    tokens: jax.Array  # int32[B, T]: t_{p+1} of each pending position p
    hidden: jax.Array  # [B, T, D]: the target's h_p there
    count: jax.Array  # int32[B]


@dataclass(frozen=True)
class HeadDrafts:
    """The program of a draft head: its block config and the target's (shared embedding and
    LM head, read from the target's params)."""

    config: ModelConfig
    target_config: ModelConfig
    needs_hidden = True

    def run(self, target_params, params, tokens, hidden, lengths, cache):
        """The head over entries tokens[B, T] (t_{p+1}) and hidden[B, T, D] (h_p), the first
        ``lengths[b]`` real, at the cache's positions: (logits, h_next, cache)."""
        return draft_head.run_head(
            params, target_params, self.config, self.target_config, tokens, hidden, lengths, cache
        )

    def propose(self, target_params, params, state, carry, keys, temperature, k, sampled):
        active = carry.active
        count = jnp.where(active, state.count, 0)
        logits, h, cache = self.run(
            target_params, params, state.tokens, state.hidden, count, state.cache
        )
        at = jnp.maximum(count - 1, 0)[:, None, None]
        logits = jnp.take_along_axis(logits, at, 1)[:, 0]
        h = jnp.take_along_axis(h, at, 1)
        steps = _draft_keys(keys, carry, k)
        token, q = _pick(logits, steps[0], temperature, sampled)

        def one(loop, step):
            token, h, cache = loop
            lengths = active.astype(jnp.int32)
            logits, h, cache = self.run(target_params, params, token[:, None], h, lengths, cache)
            new, q = _pick(logits[:, 0], step, temperature, sampled)
            return (new, h, cache), (new, q)

        (_, _, cache), (rest, rest_q) = jax.lax.scan(one, (token, h, cache), steps[1:])
        drafts = jnp.concatenate([token[:, None], rest.T], axis=1)
        if sampled:
            q = jnp.concatenate([q[:, None], jnp.swapaxes(rest_q, 0, 1)], axis=1)
        return drafts, q, dataclasses.replace(state, cache=cache)

    def accept(self, state, outcome):
        a = outcome.active
        count = outcome.num_accepted + 1
        start = outcome.target_lengths - count  # the target's length before the step
        width = state.tokens.shape[1]
        tokens = _fit(jnp.maximum(outcome.tokens, 0), width)
        hidden = state.hidden
        if outcome.hidden is not None:
            hidden = _fit(outcome.hidden.astype(hidden.dtype), width)
        return HeadState(
            state.cache.with_lengths(jnp.where(a, start, state.cache.lengths)),
            jnp.where(a[:, None], tokens, state.tokens),
            jnp.where(a[:, None, None], hidden, state.hidden),
            jnp.where(a, count, state.count),
        )


def _fit(x: jax.Array, width: int) -> jax.Array:
    """``x`` [B, T, ...] cut or zero-padded to ``width`` on its second axis."""
    x = x[:, :width]
    pad = [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x, pad)


class HeadDrafter:
    """A draft head (spark_jax.models.draft_head) drafts from the target's hidden states.

    ``head``: a head checkpoint (``save_draft_head``'s safetensors file), or (params, block
    config). K drafts chain the head: each draft's h_next and token feed the next position.
    """

    def __init__(self, target: Model, head: str | Path | tuple[Any, ModelConfig]):
        if target.config.is_encoder_decoder:
            raise ValueError("a draft head drafts for a decoder-only model.")
        if isinstance(head, str | Path):
            head = draft_head.load_draft_head(head, target.config, target.dtype)
        self.head_params, config = head
        self.program = HeadDrafts(config, target.config)

    def params(self, target: Model) -> Any:
        del target
        return self.head_params

    def start(self, target, prompts, max_len, k, prefill) -> HeadState:
        if prefill.hidden is None:
            raise ValueError("a draft head needs the target's prefill hidden states.")
        b = len(prompts)
        lengths = np.array([len(p) for p in prompts], np.int32)
        width = prefill.hidden.shape[1]
        tokens = np.zeros((b, width), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p) - 1] = p[1:]
        cache = draft_head.init_cache(self.program.config, b, max_len, target.dtype)
        last = jnp.asarray(lengths - 1)
        cache = _head_prefill(
            self.program,
            target.runner.params,
            self.head_params,
            jnp.asarray(tokens),
            prefill.hidden,
            jnp.asarray(lengths - 1),
            cache,
        )
        # The last prompt position waits for the first token: the pick after the prefill.
        pending = jnp.take_along_axis(prefill.hidden, last[:, None, None], 1)
        # Pending positions per row: a step keeps at most k + 1.
        zeros = jnp.zeros((b,), jnp.int32)
        return HeadState(cache, jnp.zeros((b, k + 1), jnp.int32), _fit(pending, k + 1), zeros)


@partial(jax.jit, static_argnames=("program",), donate_argnames=("cache",))
def _head_prefill(program, target_params, params, tokens, hidden, lengths, cache):
    """The head over each prompt's positions 0..P-2 (their next tokens are the prompt's)."""
    _, _, cache = program.run(target_params, params, tokens, hidden, lengths, cache)
    return cache


# ---------------------------------------------------------------------------------------------
# Names, as the CLI and vLLM's speculative_config use them.

DRAFTER_NAMES = ("ngram", "draft", "layer-skip", "head")


def make_drafter(
    name: str,
    model: Model,
    draft_model: Model | str | Path | None = None,
    skip: Sequence[int] | None = None,
    head: str | Path | tuple[Any, ModelConfig] | None = None,
) -> Drafter | DeviceDrafter:
    """The drafter called ``name`` for ``model``: ``"ngram"`` (prompt lookup), ``"draft"``
    (``draft_model``: a Model or a converted directory), ``"layer-skip"`` (``skip``: the layers
    left out) or ``"head"`` (``head``: a draft head checkpoint, or (params, block config))."""
    if name == "ngram":
        return PromptLookupDrafter()
    if name == "draft":
        if draft_model is None:
            raise ValueError('drafter "draft" needs draft_model (a Model or a converted dir).')
        if not isinstance(draft_model, Model):
            from spark_jax.model import load

            draft_model = load(draft_model, dtype=model.dtype)
        return DraftModelDrafter(draft_model)
    if name == "layer-skip":
        if not skip:
            raise ValueError('drafter "layer-skip" needs skip_layers, the layers to leave out.')
        return LayerSkipDrafter(model, skip)
    if name == "head":
        if head is None:
            raise ValueError('drafter "head" needs draft_head (a head checkpoint file).')
        return HeadDrafter(model, head)
    raise ValueError(f"unknown drafter {name!r}; the drafters are {', '.join(DRAFTER_NAMES)}.")


def is_device_drafter(drafter: Any) -> bool:
    """Whether ``drafter`` drafts inside the speculative step (``DeviceDrafter``)."""
    return isinstance(drafter, DeviceDrafter)
