"""Speculative decoding: a cheap drafter proposes K tokens, the target checks them in one step.

The target scores its last token plus the K drafts with one jitted ``verify`` call (padded to
K + 1 positions, so one compile per K). Greedy requests keep the longest draft prefix equal to
the target's argmax plus one token from the target (the correction, or a bonus when every draft
is right), so the output is token-identical to ``engine.generate`` (up to argmax near-ties that
the verify step's different rounding can break: never seen in fp32, possible in bf16).
Sampled requests use the rejection rule of Leviathan et al. / Chen et al.: draft x is kept with
probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
normalize(max(0, p - q)); when all are kept a bonus token is drawn from p. p is the target's
distribution after the same processors as ``sampling.sample`` (penalties, temperature,
top-k/top-p/min-p), evaluated at each draft position with the token counts that position
would have, so the output distribution is exactly that of non-speculative sampling. Rejected
drafts leave KV behind that is rolled back by lowering the cache length.

Drafters (the ``Drafter`` protocol):
  ``PromptLookupDrafter``: continues the most recent n-gram match in the context (no model).
  ``DraftModelDrafter``: a smaller model sharing the tokenizer, with its own one-row KV cache.
  ``LayerSkipDrafter``: self-speculation, the target with some layers skipped (shared weights).

One sequence per call: rows of a batch would accept different numbers of drafts, and the
continuous-batching scheduler is the place to interleave them.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.generation.generate import cache_len, check_prompts
from spark_jax.generation.request import GenerationResult, RequestState, token_logprobs
from spark_jax.generation.step import Carry, decode_forward, pick, run_chunk
from spark_jax.model import Model
from spark_jax.ops.sampling import MAX_LOGPROBS, SamplerBatch, SamplingParams, process_logits

# Folded into a seed's key for the drafter's own draws: they must be independent of the
# target's acceptance draws, or the rejection rule no longer yields the target's distribution.
_DRAFT_STREAM = 0x6472_6166


# ---------------------------------------------------------------------------------------------
# Drafters.


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, the distributions they were drawn from."""

    tokens: list[int]  # at most the k asked for; fewer (or none) when the drafter has no guess
    probs: jax.Array | None = None  # f32[len(tokens), V] q; None: deterministic (q one-hot)


class Drafter(Protocol):
    """What ``generate_speculative`` asks of a drafter.

    ``propose`` receives the whole context (prompt + accepted output) every step rather than
    accept/reject notifications: a stateful drafter rolls its own cache back to the longest
    prefix it shares with the context, so it cannot drift out of sync with the target.
    """

    def start(self, prompt: Sequence[int], params: SamplingParams, max_context: int) -> None:
        """Begins a request whose context will never exceed ``max_context`` tokens."""

    def propose(self, context: Sequence[int], k: int) -> Draft:
        """Up to ``k`` tokens that might follow ``context``."""

    def finish(self) -> None:
        """Ends the request (frees any cache)."""


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier occurrence of the context's tail.

    Tries the last ``max_ngram`` tokens first, then shorter tails down to ``min_ngram``. No
    model and no state: cheap, and strong on extractive tasks (quoting, editing, code).
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
                return Draft(ids[start : start + k].tolist())
        return Draft([])

    def finish(self) -> None:
        pass


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _DraftRows:
    temperature: jax.Array  # f32[]: the request's temperature (1 when greedy)
    key: jax.Array  # the drafter's key stream for this request


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class _Drafts:
    tokens: jax.Array  # int32[1, k]
    probs: jax.Array  # f32[1, k, V]: q of each draft (zeros when greedy)


@dataclass(frozen=True)
class Drafting:
    """The draft model's rule (``step.Rule``): each step's token from the draft's logits [1, V],
    greedy or drawn at the request's temperature; the picker state counts the draws."""

    sampled: bool

    def forward(self, fn: Any, params: Any, carry: Carry, rows: Any, lora: Any) -> Any:
        return decode_forward(fn, params, carry, lora)

    def empty_record(self, carry: Carry, rows: Any, num_steps: int) -> _Drafts:
        vocab = 1 if not self.sampled else carry.picker.shape[-1]
        return _Drafts(
            jnp.zeros((1, num_steps), jnp.int32), jnp.zeros((1, num_steps, vocab), jnp.float32)
        )

    def advance(
        self, logits: jax.Array, carry: Carry, rows: _DraftRows, record: _Drafts, i: Any
    ) -> tuple[Carry, _Drafts]:
        logits = logits[0].astype(jnp.float32)
        if self.sampled:
            scaled = logits / rows.temperature
            key = jax.random.fold_in(rows.key, carry.num_generated[0])
            token = jax.random.categorical(key, scaled).astype(jnp.int32)
            record = _Drafts(
                record.tokens.at[0, i].set(token),
                record.probs.at[0, i].set(jax.nn.softmax(scaled)),
            )
        else:
            token = jnp.argmax(logits).astype(jnp.int32)
            record = dataclasses.replace(record, tokens=record.tokens.at[0, i].set(token))
        carry = dataclasses.replace(
            carry, tokens=token[None], num_generated=carry.num_generated + 1
        )
        return carry, record

    def go_on(self, carry: Carry, entry: Carry, rows: Any) -> jax.Array:
        return jnp.bool_(True)


class DraftModelDrafter:
    """A smaller model sharing the target's tokenizer drafts k tokens, one decode step each.

    Greedy requests draft greedily (q is then one-hot); sampled requests draw drafts from the
    draft model's softmax at the request's temperature (its other processors are not applied:
    any q is exact under the rejection rule, this one is merely close to p).
    """

    def __init__(self, draft_model: Model):
        if draft_model.config.is_encoder_decoder:
            raise ValueError("a draft model must be decoder-only.")
        self.model = draft_model
        self._runner = draft_model.runner
        self._state: Any = None
        self._cached: list[int] = []  # the tokens whose keys the draft cache holds, in order
        self._active = jnp.ones((1,), bool)
        self._rule = Drafting(sampled=False)
        self._rows = _DraftRows(jnp.float32(1.0), jax.random.PRNGKey(0))
        self._draws = 0

    def start(self, prompt: Sequence[int], params: SamplingParams, max_context: int) -> None:
        del prompt
        self._state = self._runner.init_state(1, cache_len(max_context + 1))
        self._cached = []
        self._rule = Drafting(sampled=not params.greedy)
        temperature = jnp.float32(params.temperature if self._rule.sampled else 1.0)
        seed = secrets.randbits(32) if params.seed is None else params.seed & 0xFFFFFFFF
        self._rows = _DraftRows(
            temperature, jax.random.fold_in(jax.random.PRNGKey(seed), _DRAFT_STREAM)
        )
        self._draws = 0

    def propose(self, context: Sequence[int], k: int) -> Draft:
        if k < 1:
            return Draft([])
        logits = self._catch_up(context)
        vocab = logits.shape[-1] if self._rule.sampled else 1
        carry = Carry(
            self._state,
            jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), bool),  # its own array: the carry is donated
            jnp.asarray([self._draws], jnp.int32),
            jnp.zeros((vocab,), jnp.float32),  # the picker state only carries q's width
        )
        carry, first = pick(self._rule, logits, carry, self._rows)
        records = [first]
        if k > 1:  # the last draft is never fed: the target scores it
            carry, rest = run_chunk(
                self._runner.decode_fn, self._rule, self._runner.params, None, carry,
                self._rows, num_steps=k - 1, exit_early=False,
            )  # fmt: skip
            records.append(rest)
        self._state, self._draws = carry.state, self._draws + k
        tokens = jnp.concatenate([r.tokens for r in records], axis=1)[0]
        drafted = np.asarray(tokens).tolist()
        self._cached = list(context) + drafted[:-1]
        if not self._rule.sampled:
            return Draft(drafted)
        return Draft(drafted, jnp.concatenate([r.probs for r in records], axis=1)[0])

    def _catch_up(self, context: Sequence[int]) -> jax.Array:
        """Rolls the draft cache back to what it shares with ``context``, feeds the rest."""
        # Keep at least the last token unfed: its logits are the first draft's distribution.
        common = _common_prefix(self._cached, context, len(context) - 1)
        state = self._state.with_lengths(jnp.asarray([common], jnp.int32))
        feed = [int(t) for t in context[common:]]
        if common == 0:
            logits, state = self._runner.prefill(state, [0], [feed])
        elif len(feed) <= 2:  # the usual case: the target's correction, maybe one last draft
            for token in feed:
                logits, state = self._runner.decode(
                    state, jnp.asarray([token], jnp.int32), self._active
                )
        else:
            logits, state = self._runner.prefill(state, [0], [feed], continuing=True)
        self._state = state
        self._cached = list(context)
        return logits

    def finish(self) -> None:
        self._state = None
        self._cached = []


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    same = np.asarray(a[:n]) == np.asarray(b[:n])
    return n if same.all() else int(np.argmin(same))


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
# Verification: one jitted function turns the target's verify logits into accepted tokens.


def target_logits(
    logits: jax.Array,
    batch: SamplerBatch,
    token_counts: jax.Array,
    prompt_mask: jax.Array,
    num_generated: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``sampling.sample``'s processor chain: (processed logits [B, V], greedy tokens [B])."""
    return process_logits(logits, batch, token_counts, prompt_mask, num_generated)


def _accepted_prefix(ok: jax.Array) -> jax.Array:
    """How many leading entries of ok [K] are True."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32)))


def greedy_accept(
    greedy_tokens: jax.Array, drafts: jax.Array, num_drafts: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(accepted drafts n, next token): the longest prefix equal to the target's argmax.

    greedy_tokens: i32[K + 1], the target's pick after the last token and after each draft.
    drafts: i32[K], the first ``num_drafts`` real.
    """
    k = drafts.shape[0]
    ok = (drafts == greedy_tokens[:k]) & (jnp.arange(k) < num_drafts)
    n = _accepted_prefix(ok)
    return n, greedy_tokens[n]


def rejection_sample(
    probs: jax.Array,
    drafts: jax.Array,
    draft_probs: jax.Array,
    num_drafts: jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """(accepted drafts n, next token) by the speculative rejection rule.

    probs: f32[K + 1, V], the target's p after the last token and after each draft.
    drafts: i32[K], drawn from draft_probs (f32[K, V], q); the first ``num_drafts`` real.
    Draft i is kept with probability min(1, p_i(x) / q_i(x)); the first rejected one is
    replaced by a draw from normalize(max(0, p_n - q_n)); with all kept, the next token is a
    bonus draw from p_n. The tokens then follow p exactly, whatever q is.
    """
    k = drafts.shape[0]
    accept_key, draw_key = jax.random.split(key)
    rows = jnp.arange(k)
    p_draft = probs[rows, drafts]
    q_draft = draft_probs[rows, drafts]
    u = jax.random.uniform(accept_key, (k,))
    ok = (u * q_draft < p_draft) & (rows < num_drafts)  # u < p/q without dividing by q
    n = _accepted_prefix(ok)
    q_ext = jnp.concatenate([draft_probs, jnp.zeros_like(probs[:1])])
    q_n = jnp.where(n < num_drafts, q_ext[n], 0.0)
    residual = jnp.maximum(probs[n] - q_n, 0.0)
    # A zero residual means p_n == q_n, where rejection has probability zero; guard rounding.
    residual = jnp.where(jnp.sum(residual) > 0, residual, probs[n])
    return n, jax.random.categorical(draw_key, jnp.log(residual)).astype(jnp.int32)


class Verdict(NamedTuple):
    """The outcome of one verify step (device arrays)."""

    num_accepted: jax.Array  # i32[]
    tokens: jax.Array  # i32[T]: the accepted drafts, then the target's token; -1 after
    logprobs: jax.Array  # f32[T]: log p of each token under the processed distribution
    top_logprobs: jax.Array  # f32[T, MAX_LOGPROBS]
    top_ids: jax.Array  # i32[T, MAX_LOGPROBS]
    token_counts: jax.Array  # i32[V]: output-token counts after this step's tokens
    cache_lengths: jax.Array  # i32[1]: the cache length with the rejected drafts rolled back


def judge(
    logits: jax.Array,
    step_tokens: jax.Array,
    draft_probs: jax.Array,
    num_drafts: jax.Array,
    batch: SamplerBatch,
    token_counts: jax.Array,
    prompt_mask: jax.Array,
    num_generated: jax.Array,
    cache_lengths: jax.Array,
    with_top: bool = False,
) -> Verdict:
    """Accepts the drafts of one sequence against the target's logits of a step.

    logits: [1, T, V] from verify ([1, V] from prefill or decode: T = 1, no drafts).
    step_tokens: i32[1, T], the step's input: the last token, then the drafts (first
    ``num_drafts`` real). draft_probs: f32[T - 1, V], q. batch: the request's one-row
    SamplerBatch. token_counts i32[V] and prompt_mask bool[V] before the step; num_generated:
    tokens output before it; cache_lengths: i32[1] after it. Position t is processed as
    ``sample`` would process it after t drafts. ``with_top`` fills the top logprobs (a top-k
    over [T, V]; -inf / -1 otherwise). Everything stays on the device: the host reads only
    the accepted tokens.
    """
    vocab = logits.shape[-1]
    logits = logits.reshape(-1, vocab)
    steps = logits.shape[0]
    drafts = step_tokens[0, 1:]
    is_draft = (jnp.arange(drafts.shape[0]) < num_drafts)[:, None]
    draft_counts = jax.nn.one_hot(drafts, vocab, dtype=jnp.int32) * is_draft
    counts = token_counts + jnp.cumsum(
        jnp.concatenate([jnp.zeros((1, vocab), jnp.int32), draft_counts]), axis=0
    )
    rows = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x[:1], (steps, *x.shape[1:])), batch)
    mask = jnp.broadcast_to(prompt_mask, (steps, vocab))
    processed, greedy_tokens = target_logits(
        logits, rows, counts, mask, num_generated + jnp.arange(steps)
    )
    probs = jax.nn.softmax(processed, axis=-1)
    key = jax.random.fold_in(batch.keys[0], num_generated)
    sampled = rejection_sample(probs, drafts, draft_probs, num_drafts, key)
    greedy = greedy_accept(greedy_tokens, drafts, num_drafts)
    is_sampled = batch.temperature[0] > 0
    n = jnp.where(is_sampled, sampled[0], greedy[0])
    next_token = jnp.where(is_sampled, sampled[1], greedy[1])

    at = jnp.arange(steps)
    padded = jnp.concatenate([drafts, jnp.zeros((1,), jnp.int32)])
    tokens = jnp.where(at < n, padded, jnp.where(at == n, next_token, -1))
    logprobs = jax.nn.log_softmax(processed, axis=-1)
    chosen = jnp.take_along_axis(logprobs, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    width = min(MAX_LOGPROBS, vocab) if with_top else 0
    top_values, top_ids = jax.lax.top_k(logprobs, width)
    pad = ((0, 0), (0, MAX_LOGPROBS - width))
    new_counts = counts[n] + jax.nn.one_hot(next_token, vocab, dtype=jnp.int32)
    return Verdict(
        n,
        tokens,
        chosen,
        jnp.pad(top_values, pad, constant_values=-jnp.inf),
        jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
        new_counts,
        cache_lengths - num_drafts + n,  # verify kept the last token and every draft
    )


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class VerifyRows:
    """One verify step's inputs beside the carry: the request's sampler and the drafts."""

    sampler: SamplerBatch  # the request's one row
    prompt_mask: jax.Array  # bool[V]
    drafts: jax.Array  # int32[K]: the first ``num_drafts`` real
    draft_probs: jax.Array  # f32[K, V]: q of each draft
    num_drafts: jax.Array  # int32[]


@dataclass(frozen=True)
class Verification:
    """Speculative verification (``step.Rule``) of one sequence: the target scores its last
    token and ``num_drafts`` drafts (``fn``: the runner's verify step; with ``num_drafts`` 0,
    its decode step), ``judge`` accepts a prefix, and the cache rolls back the rest.

    The carry's picker state is the output token counts i32[V]; its tokens[1] the last token.
    """

    num_drafts: int
    with_top: bool = False

    def forward(self, fn: Any, params: Any, carry: Carry, rows: VerifyRows, lora: Any) -> Any:
        if self.num_drafts == 0:
            return decode_forward(fn, params, carry, lora)
        tokens = jnp.concatenate([carry.tokens, rows.drafts])[None, :]
        return fn(params, tokens, (rows.num_drafts + 1)[None], carry.state, lora)

    def empty_record(self, carry: Carry, rows: Any, num_steps: int) -> Verdict:
        """A zero verdict (the loop's record has the shapes ``advance`` returns)."""
        del rows
        if num_steps != 1:
            raise ValueError("a verification chunk is one step: drafts come from the host.")
        t = self.num_drafts + 1
        return Verdict(
            jnp.int32(0),
            jnp.zeros((t,), jnp.int32),
            jnp.zeros((t,), jnp.float32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.float32),
            jnp.zeros((t, MAX_LOGPROBS), jnp.int32),
            jnp.zeros_like(carry.picker),
            jnp.zeros_like(carry.state.lengths),
        )

    def advance(
        self, logits: jax.Array, carry: Carry, rows: VerifyRows, record: Any, i: Any
    ) -> tuple[Carry, Verdict]:
        del record, i
        step_tokens = jnp.concatenate([carry.tokens, rows.drafts])[None, :]
        verdict = judge(
            logits,
            step_tokens[:, : self.num_drafts + 1],
            rows.draft_probs[: self.num_drafts],
            rows.num_drafts,
            rows.sampler,
            carry.picker,
            rows.prompt_mask,
            carry.num_generated[0],
            carry.state.lengths,
            with_top=self.with_top,
        )
        n = verdict.num_accepted
        carry = Carry(
            carry.state.with_lengths(verdict.cache_lengths),
            verdict.tokens[n][None],
            carry.active,
            carry.num_generated + n + 1,
            verdict.token_counts,
        )
        return carry, verdict

    def go_on(self, carry: Carry, entry: Carry, rows: Any) -> jax.Array:
        return jnp.bool_(True)


# ---------------------------------------------------------------------------------------------
# The loop.


@dataclass
class SpeculativeResult(GenerationResult):
    """A GenerationResult with the drafting statistics.

    spec_stats: num_drafted, num_accepted (drafts the target verified, before any truncation
    at a stop), verify_steps, acceptance_rate = accepted / drafted, mean_accepted_length =
    accepted drafts per verify step, tokens_per_step = output tokens per target step after
    the prefill (decode steps, taken when the drafter had no guess, included).
    """

    spec_stats: dict[str, float] = field(default_factory=dict)


def generate_speculative(
    model: Model,
    prompt_ids: Sequence[int],
    params: SamplingParams | None = None,
    num_drafts: int = 4,
    drafter: Drafter | None = None,
) -> SpeculativeResult:
    """Generates one completion with drafts checked by the target (greedy when params is None).

    ``drafter`` defaults to ``PromptLookupDrafter()``. One sequence per call: a batch is
    refused. Greedy output is token-identical to ``engine.generate``; sampled output has the
    same distribution. Stops (ids, strings, max_tokens), penalties and logprobs behave as in
    the engine. The result's ``spec_stats`` holds the drafting statistics.
    """
    if model.config.is_encoder_decoder:
        raise ValueError("speculative decoding supports decoder-only models.")
    if len(prompt_ids) and np.ndim(prompt_ids[0]) > 0:
        raise ValueError(
            "generate_speculative runs one sequence (rows of a batch accept different numbers "
            "of drafts); call it once per prompt, or use generate_batch without speculation."
        )
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}.")
    params = SamplingParams(temperature=0.0) if params is None else params
    if params.adapter is not None:
        raise ValueError("speculative decoding does not apply LoRA adapters; use generate.")
    if params.guided is not None:
        raise ValueError("speculative decoding does not apply guided decoding; use generate.")
    (prompt,) = check_prompts(model, [prompt_ids], [params])
    drafter = PromptLookupDrafter() if drafter is None else drafter
    slots = model.slot_pool.acquire(1)
    try:
        drafter.start(prompt, params, len(prompt) + params.max_tokens + num_drafts)
        return _speculate(model, prompt, params, num_drafts, drafter)
    finally:
        drafter.finish()
        model.slot_pool.release(slots)


class _Speculation:
    """One request in flight: its state, the target's carry, the statistics."""

    def __init__(self, model: Model, prompt: list[int], params: SamplingParams, k: int):
        self.model = model
        self.runner = model.runner
        self.prompt = prompt
        self.params = params
        self.num_drafts = k
        self.request = RequestState(0, prompt, params, model.eos_token_ids, model.tokenizer)
        self.stats = dict.fromkeys(("drafted", "accepted", "verify_steps", "decode_steps"), 0)
        self.with_top = params.logprobs is not None

    def prefill(self) -> None:
        """Runs the prompt and picks the first token (no drafts yet)."""
        max_len = cache_len(len(self.prompt) + self.params.max_tokens + self.num_drafts + 1)
        state = self.runner.init_state(1, max_len)
        logits, state = self.runner.prefill(state, [0], [self.prompt], [self.params])
        vocab = self.vocab = logits.shape[-1]
        prompt_mask = np.zeros((vocab,), bool)
        prompt_mask[self.prompt] = True
        sampler = SamplerBatch.from_params([self.params], vocab, self.model.eos_token_ids)
        self.rows = VerifyRows(
            sampler,
            jnp.asarray(prompt_mask),
            jnp.zeros((self.num_drafts,), jnp.int32),
            jnp.zeros((self.num_drafts, vocab), jnp.float32),  # greedy: no q is read
            jnp.int32(0),
        )
        self.carry = Carry(
            state,
            jnp.asarray([self.prompt[-1]], jnp.int32),
            jnp.ones((1,), bool),
            jnp.zeros((1,), jnp.int32),
            jnp.zeros((vocab,), jnp.int32),
        )
        rule = Verification(0, self.with_top)
        self.carry, verdict = pick(rule, logits, self.carry, self.rows)
        self._emit(verdict)

    def step(self, draft: Draft) -> None:
        """Verifies one draft (a plain decode step when it is empty) and emits the tokens."""
        m, k, vocab = len(draft.tokens), self.num_drafts, self.vocab
        if m > k or any(not 0 <= t < vocab for t in draft.tokens):
            raise ValueError(
                f"the drafter proposed {draft.tokens}: more than {k} tokens or ids outside "
                f"[0, {vocab})."
            )
        if m == 0:  # no guess: a decode step is cheaper than verifying padding
            rule, fn = Verification(0, self.with_top), self.runner.decode_fn
            self.rows = dataclasses.replace(self.rows, num_drafts=jnp.int32(0))
            self.stats["decode_steps"] += 1
        else:  # padded to K drafts: one verify compile per K
            rule, fn = Verification(k, self.with_top), self.runner.verify_fn
            drafts = np.zeros((k,), np.int32)
            drafts[:m] = draft.tokens
            probs = self.rows.draft_probs
            if not self.params.greedy:
                probs = _pad_draft_probs(draft, drafts, vocab)
            self.rows = dataclasses.replace(
                self.rows, drafts=jnp.asarray(drafts), draft_probs=probs, num_drafts=jnp.int32(m)
            )
        self.carry, verdict = run_chunk(
            fn, rule, self.runner.params, None, self.carry, self.rows, num_steps=1
        )
        n = self._emit(verdict)
        if m:
            self.stats["drafted"] += m
            self.stats["accepted"] += n
            self.stats["verify_steps"] += 1

    def _emit(self, verdict: Verdict) -> int:
        """Feeds the accepted tokens to the request; returns how many drafts were accepted."""
        want = ["num_accepted", "tokens"]
        if self.with_top:
            want += ["logprobs", "top_logprobs", "top_ids"]
        host = jax.device_get({name: getattr(verdict, name) for name in want})
        n = int(host["num_accepted"])
        rows = _VerdictRows(
            **{k: host.get(k) for k in ("tokens", "logprobs", "top_logprobs", "top_ids")}
        )
        for i in range(n + 1):
            lp = None if not self.with_top else token_logprobs(rows, i, None, self.params.logprobs)
            self.request.add(int(host["tokens"][i]), lp)
            if self.request.finished:
                break
        return n

    def result(self, timings: dict[str, float]) -> SpeculativeResult:
        result = self.request.result(timings)
        s = self.stats
        steps = s["verify_steps"] + s["decode_steps"]
        spec_stats = {
            "acceptance_rate": s["accepted"] / s["drafted"] if s["drafted"] else 0.0,
            "mean_accepted_length": s["accepted"] / s["verify_steps"] if s["verify_steps"] else 0.0,
            "num_drafted": s["drafted"],
            "num_accepted": s["accepted"],
            "verify_steps": s["verify_steps"],
            "tokens_per_step": (len(result.output_tokens) - 1) / steps if steps else 0.0,
        }
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        return SpeculativeResult(**fields, spec_stats=spec_stats)


class _VerdictRows(NamedTuple):
    """A verdict's host arrays under the field names ``token_logprobs`` reads."""

    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_logprobs: np.ndarray | None
    top_ids: np.ndarray | None


def _speculate(
    model: Model, prompt: list[int], params: SamplingParams, num_drafts: int, drafter: Drafter
) -> SpeculativeResult:
    t0 = time.perf_counter()
    run = _Speculation(model, prompt, params, num_drafts)
    run.prefill()
    timings = {"ttft_s": time.perf_counter() - t0}
    while run.request.finish_reason is None:
        remaining = params.max_tokens - len(run.request.tokens)
        # Drafts past max_tokens would be cut anyway: ask only for what can still be used.
        run.step(drafter.propose(prompt + run.request.tokens, min(num_drafts, remaining - 1)))
    timings["total_s"] = time.perf_counter() - t0
    timings["decode_steps"] = run.stats["verify_steps"] + run.stats["decode_steps"]
    return run.result(timings)


def _pad_draft_probs(draft: Draft, padded_tokens: np.ndarray, vocab: int) -> jax.Array:
    """q as f32[K, V]: the drafter's rows (one-hot when it gave none), zero rows after."""
    k = padded_tokens.shape[0]
    if draft.probs is None:
        return jax.nn.one_hot(jnp.asarray(padded_tokens), vocab, dtype=jnp.float32)
    probs = jnp.asarray(draft.probs, jnp.float32)
    m, width = probs.shape
    if width > vocab:
        raise ValueError(f"the drafter's distributions have {width} entries, the target {vocab}.")
    return jnp.pad(probs, ((0, k - m), (0, vocab - width)))
