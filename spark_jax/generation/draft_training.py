"""Training a draft head (spark_jax.models.draft_head) on a target's own outputs, with optax.

The target is frozen. For each training sequence (a prompt and the target's continuation),
the target's final hidden states h_p are computed once; the head then learns, at every
position p, the token t_{p+2} from (h_p, t_{p+1}) (cross-entropy through the target's LM
head) and the target's next state h_{p+1} (a mean-squared error, scaled by the states' mean
square), the second being what lets the head chain its own states for K > 1 drafts. Only
positions whose label lies in the continuation count: those are the target's own picks, the
tokens a drafter must guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from spark_jax.config import ModelConfig
from spark_jax.model import Model
from spark_jax.models import draft_head


@dataclass(frozen=True)
class HeadTraining:
    """How ``train_draft_head`` trains.

    steps: optimizer steps; batch_size: sequences per step.
    token_positions: positions per step whose cross-entropy is computed (the LM head over the
        whole vocabulary is most of a step's cost; the state loss covers every position).
    state_weight: the weight of the state loss beside the token loss.
    soft_labels: learn the target's whole next-token distribution (its LM head on h_{p+1})
        instead of its pick alone: more signal per position, so fewer data suffice.
    """

    steps: int = 300
    batch_size: int = 8
    learning_rate: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    token_positions: int = 256
    state_weight: float = 1.0
    soft_labels: bool = False
    seed: int = 0


@dataclass
class TrainedHead:
    """A trained head: its params, its block config and the loss of every step."""

    params: Any
    config: ModelConfig
    losses: list[float]


def target_states(
    model: Model, sequences: Sequence[Sequence[int]], batch_size: int = 16
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32[N, T], lengths int32[N], the target's final hidden states f32[N, T, D])
    of every sequence, padded to one length T (a multiple of 16: training compiles one shape,
    so the power-of-two ladder would only add padding)."""
    runner = model.runner
    width = -(-max(len(s) for s in sequences) // 16) * 16
    tokens = np.zeros((len(sequences), width), np.int32)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = s
    lengths = np.array([len(s) for s in sequences], np.int32)
    states = []
    for start in range(0, len(sequences), batch_size):
        rows = slice(start, start + batch_size)
        n = tokens[rows].shape[0]
        cache = runner.init_state(n, width)
        (_, hidden), _ = runner.verify_hidden_fn(
            runner.params, jnp.asarray(tokens[rows]), jnp.asarray(lengths[rows]), cache, None
        )
        states.append(np.asarray(hidden, np.float32))
    return tokens, lengths, np.concatenate(states)


def train_draft_head(
    model: Model,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    config: ModelConfig | None = None,
    training: HeadTraining = HeadTraining(),
    params: Any = None,
    on_step: Callable[[int, float], None] | None = None,
) -> TrainedHead:
    """Trains a head for ``model`` on ``sequences`` (prompt + the model's continuation; the
    first ``prompt_lengths[i]`` tokens of each are its prompt).

    ``config``: the head's block (``draft_head.head_config``; default: one target-sized layer);
    ``params``: where to start (default: random); ``on_step(step, loss)``: called after each
    step (progress). Returns the head and its losses.
    """
    if len(sequences) != len(prompt_lengths):
        raise ValueError("give one prompt length per sequence.")
    config = config or draft_head.head_config(model.config)
    tokens, lengths, states = target_states(model, sequences)
    key = jax.random.PRNGKey(training.seed)
    if params is None:
        params = draft_head.init_params(config, key, jnp.float32)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, training.learning_rate, training.warmup_steps, max(training.steps, 1)
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=training.weight_decay)
    )
    opt_state = optimizer.init(params)
    # Position p predicts t_{p+2}: it counts when that label is a real continuation token.
    at = np.arange(tokens.shape[1] - 2)[None, :]
    weights = (at + 2 >= np.asarray(prompt_lengths)[:, None]) & (at + 2 < lengths[:, None])
    rng = np.random.RandomState(training.seed)
    scale = float(np.mean(states[weights.nonzero()[0], weights.nonzero()[1] + 1] ** 2))
    losses = []
    for _ in range(training.steps):
        rows = rng.choice(len(sequences), size=min(training.batch_size, len(sequences)))
        pick = _token_positions(weights[rows], training.token_positions, rng)
        params, opt_state, loss = _train_step(
            params,
            opt_state,
            model.params,
            jnp.asarray(tokens[rows]),
            jnp.asarray(states[rows]),
            jnp.asarray(weights[rows], jnp.float32),
            jnp.asarray(pick),
            jnp.float32(scale),
            optimizer=optimizer,
            config=config,
            target_config=model.config,
            state_weight=training.state_weight,
            soft_labels=training.soft_labels,
        )
        losses.append(float(loss))
        if on_step is not None:
            on_step(len(losses), losses[-1])
    return TrainedHead(params, config, losses)


def _token_positions(weights: np.ndarray, n: int, rng: np.random.RandomState) -> np.ndarray:
    """int32[n, 2]: (row, position) pairs drawn among the counted positions."""
    rows, positions = np.nonzero(weights)
    chosen = rng.choice(len(rows), size=n, replace=len(rows) < n)
    return np.stack([rows[chosen], positions[chosen]], axis=1).astype(np.int32)


@partial(
    jax.jit,
    static_argnames=("optimizer", "config", "target_config", "state_weight", "soft_labels"),
)
def _train_step(
    params,
    opt_state,
    target_params,
    tokens,
    states,
    weights,
    pick,
    scale,
    *,
    optimizer,
    config,
    target_config,
    state_weight,
    soft_labels,
):
    def loss_fn(p):
        b, t = tokens.shape
        inputs = tokens[:, 1 : t - 1]  # t_{p+1} for p in [0, T - 2)
        cache = draft_head.init_cache(config, b, t - 2, jnp.float32)
        lengths = jnp.full((b,), t - 2, jnp.int32)
        h_next, _ = draft_head.head_states(
            p, target_params, config, target_config, inputs, states[:, : t - 2], lengths, cache,
            fresh=True,
        )  # fmt: skip
        error = jnp.mean((h_next - states[:, 1 : t - 1]) ** 2, axis=-1) / scale
        state_loss = jnp.sum(error * weights) / jnp.maximum(jnp.sum(weights), 1)
        chosen = h_next[pick[:, 0], pick[:, 1]]
        logits = draft_head.lm_logits(target_params, target_config, chosen)
        if soft_labels:
            # The target's distribution of t_{p+2} is its LM head on its own h_{p+1}.
            target = draft_head.lm_logits(
                target_params, target_config, states[pick[:, 0], pick[:, 1] + 1]
            )
            ce = optax.softmax_cross_entropy(logits, jax.nn.softmax(target, axis=-1))
        else:
            labels = tokens[pick[:, 0], pick[:, 1] + 2]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        token_loss = jnp.mean(ce)
        return token_loss + state_weight * state_loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
