"""Speculative decoding: a cheap drafter proposes K tokens, the target checks them in one step.

The target scores its last token plus the K drafts with one verify step (padded to K + 1
positions, so one compile per K). Greedy requests keep the longest draft prefix equal to the
target's argmax plus one token from the target (the correction, or a bonus when every draft
is right), so the output is token-identical to ``generate`` (up to argmax near-ties that the
verify step's different rounding can break: never seen in fp32, possible in bf16). Sampled
requests use the rejection rule of Leviathan et al. / Chen et al.: draft x is kept with
probability min(1, p(x) / q(x)); the first rejected one is replaced by a draw from
normalize(max(0, p - q)); when all are kept a bonus token is drawn from p. p is the target's
distribution after the same processors as ``sampling.sample`` (penalties, temperature,
top-k/top-p/min-p), evaluated at each draft position with the token counts that position
would have, so the output distribution is exactly that of non-speculative sampling. Rejected
drafts leave KV behind that is rolled back by lowering each row's cache length.

The step is the generation core's (``step.run_chunk``) with the ``Speculation`` rule: draft
(a device drafter's program, or drafts the host put in the rows), verify, accept, roll back,
the stop rule and the record, all on the device. With a device drafter (draft model, layer
skip, draft head; spark_jax.generation.drafters) a chunk runs several such steps per host
sync; a host drafter (prompt lookup, or any ``Drafter``) needs the context, so it runs one.

Every input is per row (B rows): last tokens, cache lengths, accepted counts, drafts per step
(``SpecRows.num_drafts``: 0 makes a row a plain decode row inside a verify step), sampling
parameters and limits. A batching engine can therefore run the rule over its rows, each at
its own length and accepting its own number of drafts; ``generate_speculative`` runs one.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import ModelConfig
from spark_jax.generation.drafters import (
    DRAFT_STREAM,
    DRAFTER_NAMES,
    DeviceDrafter,
    Draft,
    Drafter,
    DraftModelDrafter,
    HeadDrafter,
    LayerSkipDrafter,
    Outcome,
    PromptLookupDrafter,
    TargetPrefill,
    is_device_drafter,
    make_drafter,
    skip_layers,
)
from spark_jax.generation.generate import cache_len, check_prompts
from spark_jax.generation.request import GenerationResult, RequestState, token_logprobs
from spark_jax.generation.step import Carry, LoopOptions, pick, run_chunk
from spark_jax.model import Model
from spark_jax.models.common import bucket
from spark_jax.ops.lora import adapter_slot
from spark_jax.ops.sampling import (
    MAX_LOGPROBS,
    SamplerBatch,
    SamplingParams,
    process_logits,
    row_gumbel,
)

__all__ = [
    "DRAFTER_NAMES",
    "DeviceDrafter",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "HeadDrafter",
    "LayerSkipDrafter",
    "PromptLookupDrafter",
    "Speculation",
    "SpeculativeResult",
    "generate_speculative",
    "greedy_accept",
    "judge",
    "make_drafter",
    "rejection_sample",
    "skip_layers",
    "target_logits",
]


# ---------------------------------------------------------------------------------------------
# Acceptance: pure functions of one row's verify logits.

# Folded into a row's key for the rule's acceptance and replacement draws: a stream apart
# from the sampler's per-index draws, which the bonus token reuses (see ``judge``).
JUDGE_STREAM = 0x6A75_6467


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
    draft_probs: jax.Array | None,
    num_drafts: jax.Array,
    key: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """(accepted drafts n, next token) by the speculative rejection rule.

    probs: f32[K + 1, V], the target's p after the last token and after each draft.
    drafts: i32[K], drawn from draft_probs (f32[K, V], q); the first ``num_drafts`` real.
    draft_probs None: the drafts are deterministic (q one-hot at each draft, as prompt
    lookup's), without the [K, V] array of one-hots.
    Draft i is kept with probability min(1, p_i(x) / q_i(x)); the first rejected one is
    replaced by a draw from normalize(max(0, p_n - q_n)); with all kept, the next token is a
    bonus draw from p_n. The tokens then follow p exactly, whatever q is.
    """
    k = drafts.shape[0]
    accept_key, draw_key = jax.random.split(key)
    rows = jnp.arange(k)
    p_draft = probs[rows, drafts]
    q_draft = jnp.ones_like(p_draft) if draft_probs is None else draft_probs[rows, drafts]
    u = jax.random.uniform(accept_key, (k,))
    ok = (u * q_draft < p_draft) & (rows < num_drafts)  # u < p/q without dividing by q
    n = _accepted_prefix(ok)
    if draft_probs is None:  # max(0, p_n - one_hot(x_n)) is p_n without the rejected x_n
        x_n = jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)])[n]
        rejected = (n < num_drafts) & (jnp.arange(probs.shape[-1]) == x_n)
        residual = jnp.where(rejected, 0.0, probs[n])
    else:
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
    draft_probs: jax.Array | None,
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
    ``num_drafts`` real). draft_probs: f32[T - 1, V], q (None: deterministic drafts).
    batch: the request's one-row SamplerBatch. token_counts i32[V] and prompt_mask bool[V]
    before the step; num_generated: tokens output before it; cache_lengths: i32[1] after it.
    Position t is processed as ``sample`` would process it after t drafts. ``with_top`` fills
    the top logprobs (a top-k over [T, V]; -inf / -1 otherwise). Everything stays on the
    device: the host reads only the accepted tokens.
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
    key = jax.random.fold_in(jax.random.fold_in(batch.keys[0], JUDGE_STREAM), num_generated)
    kept, replacement = rejection_sample(probs, drafts, draft_probs, num_drafts, key)
    # With every draft kept, the bonus token is ``sample``'s own draw of that output index
    # (Gumbel-max with the same noise): a row without drafts picks what a decode step would,
    # so a request's tokens do not depend on whether its batch speculated.
    index = (num_generated + kept)[None]
    noise = row_gumbel(batch.keys[:1], index, vocab)[0]
    bonus = jnp.argmax(processed[kept] + noise).astype(jnp.int32)
    sampled = (kept, jnp.where(kept < num_drafts, replacement, bonus))
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


def judge_rows(
    logits: jax.Array,
    step_tokens: jax.Array,
    draft_probs: jax.Array | None,
    num_drafts: jax.Array,
    batch: SamplerBatch,
    token_counts: jax.Array,
    prompt_mask: jax.Array,
    num_generated: jax.Array,
    cache_lengths: jax.Array,
    with_top: bool = False,
) -> Verdict:
    """``judge`` of every row: logits [B, T, V], step_tokens [B, T], draft_probs [B, T - 1, V]
    (or None), num_drafts [B], a B-row batch, token_counts [B, V], prompt_mask [B, V], num_generated
    [B], cache_lengths [B]; each field of the verdict gains a leading B axis."""

    def one(logits, tokens, q, n, row, counts, mask, generated, length):
        row = jax.tree_util.tree_map(lambda x: x[None], row)
        verdict = judge(
            logits[None], tokens[None], q, n, row, counts, mask, generated, length[None],
            with_top=with_top,
        )  # fmt: skip
        return verdict._replace(cache_lengths=verdict.cache_lengths[0])

    return jax.vmap(one)(
        logits, step_tokens, draft_probs, num_drafts, batch, token_counts, prompt_mask,
        num_generated, cache_lengths,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The speculative step: the generation core's rule.


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecState:
    """The carry's state: the target's cache and the device drafter's rows (None: host)."""

    target: Any
    draft: Any


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecParams:
    """The chunk's params: the target's and the device drafter's (None: host)."""

    target: Any
    draft: Any


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecRows:
    """Each row's fixed inputs for a run of speculative steps (B rows, K drafts)."""

    sampler: SamplerBatch
    prompt_mask: jax.Array  # bool[B, V] ([B, 1] when the rule is greedy)
    max_tokens: jax.Array  # int32[B]
    num_drafts: jax.Array  # int32[B]: drafts verified per step (fewer near max_tokens)
    draft_keys: jax.Array  # u32[B, 2]: the drafter's key stream of each row
    drafts: jax.Array  # int32[B, K]: a host drafter's proposal (unused by device drafters)
    draft_probs: jax.Array  # f32[B, K, V]: its q ([B, K, 1] when greedy or on the device)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SpecRecord:
    """What a chunk of S speculative steps tells the host, per row and step (T = K + 1)."""

    tokens: jax.Array  # int32[B, S, T]: kept drafts, then the target's token; -1 after
    num_accepted: jax.Array  # int32[B, S]
    num_drafts: jax.Array  # int32[B, S]: drafts verified (0: a plain decode step)
    valid: jax.Array  # bool[B, S]: the row was generating at that step
    logprobs: jax.Array | None  # f32[B, S, T]
    top_logprobs: jax.Array | None  # f32[B, S, T, MAX_LOGPROBS]
    top_ids: jax.Array | None  # int32[B, S, T, MAX_LOGPROBS]


class Proposal(NamedTuple):
    """``Speculation.forward``'s output: the verify logits and what was verified."""

    logits: jax.Array  # [B, T, V]
    drafts: jax.Array  # int32[B, K]
    draft_probs: jax.Array | None  # f32[B, K, V] q, or None (greedy, or deterministic drafts)
    num_drafts: jax.Array  # int32[B]: real drafts of each row (0 for inactive rows)
    hidden: jax.Array | None  # [B, T, D] the target's states (a drafter asked for them)

    @classmethod
    def of_logits(cls, logits: jax.Array) -> Proposal:
        """The proposal of a step without drafts (a prefill's logits [B, V])."""
        b = logits.shape[0]
        zeros = jnp.zeros((b,), jnp.int32)
        return cls(logits[:, None], jnp.zeros((b, 0), jnp.int32), None, zeros, None)


@dataclass(frozen=True)
class Speculation:
    """Speculative steps (``step.Rule``): draft, verify, accept, roll back, for every row.

    num_drafts: K, the verify step's width is K + 1 (0: plain decode steps, ``fn`` the
        runner's decode step; else its verify step, or ``verify_hidden_fn`` for a drafter that
        ``needs_hidden``).
    drafter: a device drafter's program; None: the drafts are ``rows.drafts`` (host).
    greedy: every row is plain greedy: acceptance is the argmax match and no processor runs.
    with_top: fill the record's logprob fields.
    The picker state is the output token counts int32[B, V] ([B, 1] when greedy).
    """

    num_drafts: int
    drafter: Any = None
    greedy: bool = False
    with_top: bool = False

    def forward(self, fn: Any, params: SpecParams, carry: Carry, rows: SpecRows, lora: Any):
        target, draft = carry.state.target, carry.state.draft
        k, active = self.num_drafts, carry.active
        if k == 0:
            logits, target = fn(params.target, carry.tokens, active, target, lora)
            return Proposal.of_logits(logits), SpecState(target, draft)
        room = rows.max_tokens - carry.num_generated - 1  # drafts past max_tokens are cut
        limit = jnp.where(active, jnp.clip(jnp.minimum(rows.num_drafts, room), 0, k), 0)
        if self.drafter is None:
            drafts, q = rows.drafts, None if self.greedy else rows.draft_probs
        else:
            drafts, q, draft = self.drafter.propose(
                params.target, params.draft, draft, carry, rows.draft_keys,
                rows.sampler.temperature, k, not self.greedy,
            )  # fmt: skip
        tokens = jnp.concatenate([carry.tokens[:, None], drafts], axis=1)
        lengths = jnp.where(active, limit + 1, 0)
        out, target = fn(params.target, tokens, lengths, target, lora)
        logits, hidden = out if self.needs_hidden else (out, None)
        return Proposal(logits, drafts, q, limit, hidden), SpecState(target, draft)

    @property
    def needs_hidden(self) -> bool:
        return self.drafter is not None and self.drafter.needs_hidden

    def empty_record(self, carry: Carry, rows: Any, num_steps: int) -> SpecRecord:
        b, t = carry.tokens.shape[0], self.num_drafts + 1
        steps = lambda *shape, dtype: jnp.zeros((b, num_steps, *shape), dtype)
        top = (None, None, None)
        if self.with_top:
            top = (
                steps(t, dtype=jnp.float32),
                steps(t, MAX_LOGPROBS, dtype=jnp.float32),
                steps(t, MAX_LOGPROBS, dtype=jnp.int32),
            )
        return SpecRecord(
            steps(t, dtype=jnp.int32), steps(dtype=jnp.int32), steps(dtype=jnp.int32),
            steps(dtype=bool), *top,
        )  # fmt: skip

    def advance(
        self, proposal: Proposal, carry: Carry, rows: SpecRows, record: SpecRecord, i: Any
    ) -> tuple[Carry, SpecRecord]:
        target = carry.state.target
        active, limit = carry.active, proposal.num_drafts
        step_tokens = jnp.concatenate([carry.tokens[:, None], proposal.drafts], axis=1)
        if self.greedy:
            n, tokens, counts = _greedy_verdict(proposal.logits, proposal.drafts, limit)
            lengths = target.lengths - limit + n  # verify kept the last token and each draft
            top = (record.logprobs, record.top_logprobs, record.top_ids)
        else:
            q = proposal.draft_probs  # None: deterministic drafts (judge's one-hot q)
            verdict = judge_rows(
                proposal.logits, step_tokens, q, limit, rows.sampler, carry.picker,
                rows.prompt_mask, carry.num_generated, target.lengths, self.with_top,
            )  # fmt: skip
            n, tokens, lengths = verdict.num_accepted, verdict.tokens, verdict.cache_lengths
            counts = jnp.where(active[:, None], verdict.token_counts, carry.picker)
            top = (record.logprobs, record.top_logprobs, record.top_ids)
            if self.with_top:
                top = (
                    record.logprobs.at[:, i].set(verdict.logprobs),
                    record.top_logprobs.at[:, i].set(verdict.top_logprobs),
                    record.top_ids.at[:, i].set(verdict.top_ids),
                )
        n = jnp.where(active, n, 0)
        last = jnp.take_along_axis(tokens, n[:, None], axis=1)[:, 0]
        done = _device_done(tokens, n, carry.num_generated, rows)
        lengths = jnp.where(active, lengths, target.lengths)
        draft = carry.state.draft
        if self.drafter is not None:
            outcome = Outcome(active, n, tokens, lengths, proposal.hidden)
            draft = self.drafter.accept(draft, outcome)
        record = SpecRecord(
            record.tokens.at[:, i].set(jnp.where(active[:, None], tokens, -1)),
            record.num_accepted.at[:, i].set(n),
            record.num_drafts.at[:, i].set(limit),
            record.valid.at[:, i].set(active),
            *top,
        )
        carry = Carry(
            SpecState(target.with_lengths(lengths), draft),
            jnp.where(active, last, carry.tokens),
            active & ~done,
            carry.num_generated + jnp.where(active, n + 1, 0),
            counts,
        )
        return carry, record

    def go_on(self, carry: Carry, entry: Carry, rows: Any) -> jax.Array:
        return jnp.any(carry.active)


def _greedy_verdict(
    logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    """(kept n[B], tokens[B, T], no counts): ``greedy_accept`` of every row, on plain argmax."""
    picks = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    n, following = jax.vmap(greedy_accept)(picks, drafts, num_drafts)
    at = jnp.arange(picks.shape[1])[None, :]
    padded = jnp.pad(drafts, ((0, 0), (0, 1)))
    tokens = jnp.where(at < n[:, None], padded, jnp.where(at == n[:, None], following[:, None], -1))
    return n, tokens, None


def _device_done(
    tokens: jax.Array, n: jax.Array, num_generated: jax.Array, rows: SpecRows
) -> jax.Array:
    """bool[B]: one of the step's n + 1 tokens is a stop id past min_tokens, or max_tokens is
    reached (``request.device_done`` over the step's tokens; stop strings are the host's)."""
    at = jnp.arange(tokens.shape[1])[None, :]
    count = num_generated[:, None] + at + 1  # the output length with that token
    stops = jnp.any(tokens[:, :, None] == rows.sampler.stop_ids[:, None, :], axis=-1)
    ends = (stops & (count >= rows.sampler.min_tokens[:, None])) | (
        count >= rows.max_tokens[:, None]
    )
    return jnp.any(ends & (at <= n[:, None]), axis=1)


# ---------------------------------------------------------------------------------------------
# The driver: one request.


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
    drafter: str | Drafter | DeviceDrafter | None = None,
    *,
    draft_model: Model | str | Path | None = None,
    skip: Sequence[int] | None = None,
    head: str | Path | tuple[Any, ModelConfig] | None = None,
    loop: LoopOptions | None = None,
) -> SpeculativeResult:
    """Generates one completion with drafts checked by the target (greedy when params is None).

    ``drafter``: a name (``"ngram"``, ``"draft"`` with ``draft_model``, ``"layer-skip"`` with
    ``skip``, ``"head"`` with ``head``; see ``drafters.make_drafter``) or a drafter object;
    default ``"ngram"``. Device drafters run ``loop.steps_per_sync`` speculative steps per host
    sync. One sequence per call: a batch is refused. Greedy output is token-identical to
    ``generate``; sampled output has the same distribution. Stops, penalties, logprobs and the
    request's LoRA adapter (applied by the target) behave as in ``generate``.
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
    if params.guided is not None:
        raise ValueError("speculative decoding does not apply guided decoding; use generate.")
    (prompt,) = check_prompts(model, [prompt_ids], [params])
    adapter = adapter_slot(model.lora_pool, params.adapter)  # unknown names fail here
    if drafter is None or isinstance(drafter, str):
        drafter = make_drafter(drafter or "ngram", model, draft_model, skip, head)
    if isinstance(drafter, DraftModelDrafter) and drafter.model.tensor_parallel != (
        model.tensor_parallel
    ):
        raise ValueError(
            f"the draft model is laid out over {drafter.model.tensor_parallel} device(s) and "
            f"the target over {model.tensor_parallel}; load the draft with tensor_parallel="
            f"{model.tensor_parallel} (one program drafts and verifies)."
        )
    slots = model.slot_pool.acquire(1)
    run = _Speculation(model, prompt, params, num_drafts, drafter, adapter, loop or LoopOptions())
    try:
        return run.generate()
    finally:
        if not run.on_device:
            drafter.finish()
        model.slot_pool.release(slots)


class _Speculation:
    """One request in flight: its state, the target's carry, the statistics."""

    def __init__(self, model, prompt, params, k, drafter, adapter, loop: LoopOptions):
        self.model = model
        self.runner = model.runner
        self.prompt = prompt
        self.params = params
        self.num_drafts = k
        self.drafter = drafter
        self.loop = loop
        self.on_device = is_device_drafter(drafter)
        self.request = RequestState(0, prompt, params, model.eos_token_ids, model.tokenizer)
        self.stats = dict.fromkeys(("drafted", "accepted", "verify_steps", "decode_steps"), 0)
        self.with_top = params.logprobs is not None
        self.greedy = params.plain_greedy
        self.program = drafter.program if self.on_device else None
        self.needs_hidden = self.on_device and self.program.needs_hidden
        pool = model.lora_pool
        self.lora_kw = {} if pool is None else {"adapters": [adapter]}
        self.lora = None if pool is None else self.runner.lora_input([adapter])
        self.max_len = cache_len(len(prompt) + params.max_tokens + k + 1)

    def rule(self, k: int) -> Speculation:
        return Speculation(k, self.program, self.greedy, self.with_top)

    def generate(self) -> SpeculativeResult:
        t0 = time.perf_counter()
        if not self.on_device:
            self.drafter.start(self.prompt, self.params, self.max_len - 1)
        self.prefill()
        timings = {"ttft_s": time.perf_counter() - t0}
        if self.on_device:
            self._device_loop()
        else:
            self._host_loop()
        timings["total_s"] = time.perf_counter() - t0
        timings["decode_steps"] = self.stats["verify_steps"] + self.stats["decode_steps"]
        return self.result(timings)

    def prefill(self) -> None:
        """Runs the prompt (and the drafter's start) and picks the first token."""
        runner, prompt, k = self.runner, self.prompt, self.num_drafts
        state = runner.init_state(1, self.max_len)
        hidden = None
        if self.needs_hidden:  # the verify step from an empty row is a prefill with states
            tokens = np.zeros((1, bucket(len(prompt))), np.int32)
            tokens[0, : len(prompt)] = prompt
            lengths = jnp.asarray([len(prompt)], jnp.int32)
            (logits, hidden), state = runner.verify_hidden_fn(
                runner.params, jnp.asarray(tokens), lengths, state, self.lora
            )
            logits = logits[:, len(prompt) - 1]
        else:
            logits, state = runner.prefill(state, [0], [prompt], [self.params], **self.lora_kw)
        draft, draft_params = None, None
        if self.on_device:
            draft = self.drafter.start(self.model, [prompt], self.max_len, k, TargetPrefill(hidden))
            draft_params = self.drafter.params(self.model)
        self.spec_params = SpecParams(runner.params, draft_params)
        vocab = self.vocab = logits.shape[-1]
        width = 1 if self.greedy else vocab
        prompt_mask = np.zeros((1, width), bool)
        if not self.greedy:
            prompt_mask[0, prompt] = True
        sampler = SamplerBatch.from_params([self.params], vocab, self.model.eos_token_ids)
        draft_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(sampler.keys, DRAFT_STREAM)
        self.rows = SpecRows(
            sampler,
            jnp.asarray(prompt_mask),
            jnp.asarray([self.params.max_tokens], jnp.int32),
            jnp.asarray([k], jnp.int32),
            draft_keys,
            jnp.zeros((1, k), jnp.int32),
            # q: a host drafter's sampled rows send theirs; nothing else reads it.
            jnp.zeros((1, k, 1 if self.greedy or self.on_device else vocab), jnp.float32),
        )
        self.carry = Carry(
            SpecState(state, draft),
            jnp.asarray([prompt[-1]], jnp.int32),
            jnp.ones((1,), bool),
            jnp.zeros((1,), jnp.int32),
            jnp.zeros((1, width), jnp.int32),
        )
        self.carry, record = pick(self.rule(0), Proposal.of_logits(logits), self.carry, self.rows)
        self._emit(record, target_steps=False)

    def _device_loop(self) -> None:
        """Chunks of speculative steps; the next is queued before this one is read while the
        request cannot end inside it by max_tokens."""
        k, s = self.num_drafts, self.loop.steps_per_sync
        fn = self.runner.verify_hidden_fn if self.needs_hidden else self.runner.verify_fn
        rule = self.rule(k)

        def dispatch() -> SpecRecord:
            self.carry, record = run_chunk(
                fn, rule, self.spec_params, self.lora, self.carry, self.rows, s,
                self.loop.exit_early,
            )  # fmt: skip
            return record

        record = dispatch()
        while True:
            remaining = self.params.max_tokens - len(self.request.tokens)
            ahead = dispatch() if remaining > s * (k + 1) else None
            self._emit(record)
            if self.request.finished:
                return
            record = ahead if ahead is not None else dispatch()

    def _host_loop(self) -> None:
        """One verify step per proposal of the host drafter (a decode step when it has none)."""
        k, vocab = self.num_drafts, self.vocab
        while not self.request.finished:
            remaining = self.params.max_tokens - len(self.request.tokens)
            # Drafts past max_tokens would be cut anyway: ask only for what can still be used.
            draft = self.drafter.propose(self.prompt + self.request.tokens, min(k, remaining - 1))
            m = len(draft.tokens)
            if m > k or any(not 0 <= t < vocab for t in draft.tokens):
                raise ValueError(
                    f"the drafter proposed {draft.tokens}: more than {k} tokens or ids outside "
                    f"[0, {vocab})."
                )
            if m == 0:  # no guess: a decode step is cheaper than verifying padding
                rule, fn = self.rule(0), self.runner.decode_fn
            else:  # padded to K drafts: one verify compile per K
                rule, fn = self.rule(k), self.runner.verify_fn
                drafts = np.zeros((1, k), np.int32)
                drafts[0, :m] = draft.tokens
                probs = self.rows.draft_probs
                if not self.greedy:
                    probs = _pad_draft_probs(draft, drafts[0], vocab)[None]
                self.rows = dataclasses.replace(
                    self.rows,
                    drafts=jnp.asarray(drafts),
                    draft_probs=probs,
                    num_drafts=jnp.asarray([m], jnp.int32),
                )
            self.carry, record = run_chunk(
                fn, rule, self.spec_params, self.lora, self.carry, self.rows, num_steps=1
            )
            self._emit(record)

    def _emit(self, record: SpecRecord, target_steps: bool = True) -> None:
        """Feeds a record's tokens to the request, step by step, until it finishes
        (``target_steps``: count the steps in the statistics; not the prefill's pick)."""
        want = ["tokens", "num_accepted", "num_drafts", "valid"]
        if self.with_top:
            want += ["logprobs", "top_logprobs", "top_ids"]
        host = jax.device_get({name: getattr(record, name) for name in want})
        for step in range(host["valid"].shape[1]):
            if self.request.finished or not host["valid"][0, step]:
                return
            n, m = int(host["num_accepted"][0, step]), int(host["num_drafts"][0, step])
            rows = _StepRows(*(host[f][0, step] if f in host else None for f in _StepRows._fields))
            for i in range(n + 1):
                lp = None
                if self.with_top:
                    lp = token_logprobs(rows, i, None, self.params.logprobs)
                self.request.add(int(rows.tokens[i]), lp)
                if self.request.finished:
                    break
            if target_steps and m:
                self.stats["drafted"] += m
                self.stats["accepted"] += n
                self.stats["verify_steps"] += 1
            elif target_steps:
                self.stats["decode_steps"] += 1

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


class _StepRows(NamedTuple):
    """One step's host arrays under the field names ``token_logprobs`` reads."""

    tokens: np.ndarray
    logprobs: np.ndarray | None
    top_logprobs: np.ndarray | None
    top_ids: np.ndarray | None


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
