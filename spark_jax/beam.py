"""Beam search with HF transformers' semantics, the beams of many requests in one batch.

Each request is a ``BeamRequest`` for an encoder-decoder runner (NLLB): its ``num_beams``
beams occupy ``num_beams`` rows of one shared cache. Every step decodes all rows of all
requests as ONE batched forward, whatever their beam counts, source lengths and target
languages; the device returns the top ``2 * max_beams`` log-probs of each row and the host
picks candidates per request from those few numbers. Beams are reordered by a gather of cache
rows on the device. A finished request leaves the batch and its rows go to the next waiting
request (admitted with a prefill while the others keep decoding). A request's LoRA adapter
(``BeamRequest.adapter``) is recorded for each of its rows, so requests with different
adapters share every step; a reused row takes the adapter of its new request.

The per-request host logic replays ``GenerationMixin._beam_search`` of transformers 5
(``_get_top_k_continuations``, ``_get_running_beams_for_next_iteration``,
``_update_finished_beams``, ``_check_early_stop_heuristic``) for one batch item, in float32
like torch, including its -1e9 penalties. Lengths follow HF with the decoder prompt
``[decoder_start]``: the forced language token counts, so a hypothesis of n generated tokens
(EOS included) is scored ``sum_logprobs / (n + 1) ** length_penalty``, and ``max_new`` is HF's
``max_new_tokens`` minus one. The forced step itself is not searched: HF's forced-BOS processor
leaves beam 0 alone at score 0 (the other beams at -1e9 never reach the top 2 * num_beams),
which is exactly the prefill's single row.

Errors: every request is checked before any device work; one invalid request fails the whole
call with a ValueError naming its index, and no request of that call is run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.models.common import bucket

_PENALTY = np.float32(-1.0e9)  # HF's "never pick this" offset, in the same float32 arithmetic
_DEFAULT_MAX_ROWS = 256


@dataclass(frozen=True)
class BeamRequest:
    """One source to translate with beam search (HF ``generate(num_beams=...)`` knobs)."""

    prompt_tokens: Sequence[int]  # [src_lang] tokens </s>
    src_lang: str | None = None
    tgt_lang: str | None = None  # None: the runner's default target language
    adapter: str | None = None
    num_beams: int = 4
    max_new: int = 64  # tokens after the forced language token (HF max_new_tokens - 1)
    length_penalty: float = 1.0
    early_stopping: bool | str = True  # True | False | "never"
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", tuple(int(t) for t in self.prompt_tokens))
        for name in ("num_beams", "max_new", "num_return_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams "
                f"({self.num_beams}): beam search keeps only num_beams hypotheses"
            )
        if self.early_stopping not in (True, False) and self.early_stopping != "never":
            raise ValueError(
                f'early_stopping must be True, False or "never", got {self.early_stopping!r}'
            )
        if not np.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be finite, got {self.length_penalty!r}")


@dataclass
class BeamResult:
    """The best ``num_return_sequences`` hypotheses, best first, with HF's sequence scores."""

    sequences: list[list[int]]  # generated tokens, without the forced language token
    scores: list[float]  # HF sequences_scores: sum of logprobs / length ** length_penalty


# ---------------------------------------------------------------------------------------------
# Device side: the only per-step copy to the host is [rows, 2 * max_beams] log-probs and ids.


@partial(jax.jit, static_argnames=("k",))
def _top_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Per row, the k largest log-softmax values (descending) and their token ids."""
    return jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)


# ---------------------------------------------------------------------------------------------
# Host side: one request's search state, advanced one HF iteration at a time.


@dataclass
class _Search:
    index: int
    request: BeamRequest
    rows: list[int]  # cache row of beam b
    eos: frozenset[int]
    adapter: int = -1  # LoRA pool slot of every beam of this request (-1: the base model)
    cur_len: int = 2  # HF's decoder length: [decoder_start, forced_bos]
    running: list[list[int]] = field(default_factory=lambda: [[]])  # beam 0 alone at first
    running_scores: np.ndarray = field(default_factory=lambda: np.zeros(1, np.float32))
    finished: list[list[int]] = field(default_factory=list)
    finished_scores: np.ndarray | None = None
    is_finished: np.ndarray | None = None
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    done: bool = False

    def __post_init__(self) -> None:
        n = self.request.num_beams
        self.finished = [[] for _ in range(n)]
        self.finished_scores = np.full(n, _PENALTY, np.float32)
        self.is_finished = np.zeros(n, bool)

    @property
    def max_length(self) -> int:
        return self.request.max_new + 2

    def step(self, values: np.ndarray, ids: np.ndarray) -> list[tuple[int, int]]:
        """One beam-search iteration from the top log-probs [beams, >= 2n] of each running beam.

        Returns the next running beams as (parent beam, token); empty once the search is done.
        """
        r, n = self.request, self.request.num_beams
        k = 2 * n
        # c. top-2n continuations over all beams, ordered like torch.topk over beam * V + token
        scores = (values[:, :k] + self.running_scores[:, None]).astype(np.float32)
        beams = np.broadcast_to(np.arange(len(scores))[:, None], scores.shape)
        order = np.lexsort((ids[:, :k].ravel(), beams.ravel(), -scores.ravel()))[:k]
        top_scores, top_beams = scores.ravel()[order], beams.ravel()[order]
        top_tokens = ids[:, :k].ravel()[order]
        top_seqs = [self.running[b] + [int(t)] for b, t in zip(top_beams, top_tokens, strict=True)]
        # d. stopping criteria: EOS, or the maximum length reached
        hits = np.isin(top_tokens, list(self.eos)) | (self.cur_len + 1 >= self.max_length)
        # e. the best n candidates that did not stop keep running
        running_scores = top_scores + hits.astype(np.float32) * _PENALTY
        keep = np.argsort(-running_scores, kind="stable")[:n]
        self.running = [top_seqs[i] for i in keep]
        self.running_scores = running_scores[keep]
        parents = [(int(top_beams[i]), int(top_tokens[i])) for i in keep]
        # f. stopped candidates among the top n join the finished hypotheses if good enough
        just_finished = hits & (np.arange(k) < n)
        length = np.float32((self.cur_len + 1 - 1) ** r.length_penalty)
        finished_scores = top_scores / length
        if self.is_finished.all() and r.early_stopping is True:
            finished_scores = finished_scores + _PENALTY
        if not self.improvable:
            finished_scores = finished_scores + _PENALTY
        finished_scores = finished_scores + (~just_finished).astype(np.float32) * _PENALTY
        merged_scores = np.concatenate([self.finished_scores, finished_scores])
        merged_seqs = self.finished + top_seqs
        merged_flags = np.concatenate([self.is_finished, just_finished])
        best = np.argsort(-merged_scores, kind="stable")[:n]
        self.finished = [merged_seqs[i] for i in best]
        self.finished_scores = merged_scores[best]
        self.is_finished = merged_flags[best]
        # g. can the running beams still beat the worst finished hypothesis?
        self.cur_len += 1
        if r.early_stopping == "never" and r.length_penalty > 0.0:
            best_length = self.max_length - 1
        else:
            best_length = self.cur_len - 1
        best_possible = self.running_scores[0] / np.float32(best_length**r.length_penalty)
        worst = np.where(self.is_finished, self.finished_scores.min(), _PENALTY)
        self.improvable = self.improvable and bool(np.any(best_possible > worst))
        all_full = bool(self.is_finished.all()) and r.early_stopping is True
        self.done = not self.improvable or all_full or bool(hits.all())
        return [] if self.done else parents

    def result(self) -> BeamResult:
        m = self.request.num_return_sequences
        return BeamResult(
            sequences=[list(s) for s in self.finished[:m]],
            scores=[float(s) for s in self.finished_scores[:m]],
        )


# ---------------------------------------------------------------------------------------------
# The co-batched driver.


def _as_runner(model_or_runner: Any) -> Any:
    runner = getattr(model_or_runner, "runner", model_or_runner)
    if not hasattr(runner, "reorder_rows"):
        raise ValueError(
            "beam search needs an encoder-decoder model (NLLB / M2M100); "
            f"{type(runner).__name__} cannot reorder its cache rows."
        )
    return runner


def _adapter_slot(runner: Any, name: str | None) -> int:
    """The LoRA pool slot of an adapter name (-1 = base); unknown names are refused."""
    if name is None:
        return -1
    pool = getattr(runner, "lora_pool", None)
    if pool is None:
        raise ValueError(f"adapter {name!r} is not loaded; add it with Model.add_adapter.")
    return pool.index(name)


def _check(runner: Any, requests: Sequence[BeamRequest]) -> list[int]:
    """Validates every request; returns each one's adapter slot."""
    adapters = []
    for i, request in enumerate(requests):
        try:
            if not isinstance(request, BeamRequest):
                raise ValueError(f"expected a BeamRequest, got {type(request).__name__}")
            adapters.append(_adapter_slot(runner, request.adapter))
            runner.check_source(request.prompt_tokens, request)
            runner.target_language_id(request)
        except ValueError as error:
            raise ValueError(f"request {i}: {error}") from error
    return adapters


def generate_beam(
    model_or_runner: Any, requests: Sequence[BeamRequest], max_rows: int | None = None
) -> list[BeamResult]:
    """Beam search for every request, all beams decoded as one batch per step.

    ``max_rows`` bounds the cache rows (beams in flight); requests wait, in order, for rows
    to free up. Results are in request order and equal those of each request run alone.
    """
    runner = _as_runner(model_or_runner)
    requests = list(requests)
    if not requests:
        return []
    adapter_of = _check(runner, requests)
    # Adapters go to the runner only when a pool exists, so plain models keep one compile.
    use_lora = getattr(runner, "lora_pool", None) is not None
    eos = frozenset(runner.eos_token_ids)
    widest = max(r.num_beams for r in requests)
    width = 2 * widest
    rows = bucket(sum(r.num_beams for r in requests), minimum=8)
    rows = max(min(rows, max_rows or _DEFAULT_MAX_ROWS), widest)
    max_len = bucket(max(r.max_new for r in requests) + 2)
    state = runner.init_state(rows, max_len, max(len(r.prompt_tokens) for r in requests))

    pending = deque(enumerate(requests))
    free = list(range(rows))[::-1]
    results: list[BeamResult | None] = [None] * len(requests)
    top: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # request index -> (values, ids)
    active_searches: list[_Search] = []
    tokens = np.zeros(rows, np.int32)
    row_adapters = np.full(rows, -1, np.int32)  # each cache row's adapter, set at admission

    def admit() -> None:
        nonlocal state
        admitted = []
        while pending and pending[0][1].num_beams <= len(free):
            index, request = pending.popleft()
            taken = [free.pop() for _ in range(request.num_beams)]
            row_adapters[taken] = adapter_of[index]
            admitted.append(_Search(index, request, taken, eos, adapter_of[index]))
        if not admitted:
            return
        slots = [s.rows[0] for s in admitted]
        prompts = [s.request.prompt_tokens for s in admitted]
        lora = {"adapters": [s.adapter for s in admitted]} if use_lora else {}
        logits, state = runner.prefill(state, slots, prompts, [s.request for s in admitted], **lora)
        values, ids = jax.device_get(_top_log_probs(logits, width))
        for i, search in enumerate(admitted):
            top[search.index] = (values[i : i + 1], ids[i : i + 1])
        active_searches.extend(admitted)

    admit()
    while active_searches:
        source_rows = np.arange(rows, dtype=np.int32)
        active = np.zeros(rows, bool)
        first_steps = False
        for search in list(active_searches):
            values, ids = top.pop(search.index)
            first_steps |= search.cur_len == 2
            parents = search.step(values, ids)
            if search.done:
                results[search.index] = search.result()
                active_searches.remove(search)
                free.extend(search.rows)
                continue
            for beam, (parent, token) in enumerate(parents):
                source_rows[search.rows[beam]] = search.rows[parent]
                tokens[search.rows[beam]] = token
                active[search.rows[beam]] = True
        if not active_searches and not pending:
            break
        # A request's first step fans its one prefilled row out to all its beams: the cross
        # K/V move too. Later steps reorder within a request, whose beams share the source.
        state = runner.reorder_rows(state, jnp.asarray(source_rows), first_steps)
        admit()
        if active.any():
            lora = {"adapters": row_adapters.copy()} if use_lora else {}
            logits, state = runner.decode(state, jnp.asarray(tokens), jnp.asarray(active), **lora)
            values, ids = jax.device_get(_top_log_probs(logits, width))
            for search in active_searches:
                if search.index not in top:
                    beam_rows = search.rows[: len(search.running)]
                    top[search.index] = (values[beam_rows], ids[beam_rows])
    return results
