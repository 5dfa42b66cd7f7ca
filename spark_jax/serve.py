"""The OpenAI-compatible server: ``python -m spark_jax.serve [--model DIR] [--port 8000]``.

With no ``--model`` it serves the embedded SmolLM2-135M-Instruct (as ``spark_jax.generate``
does); ``--model`` also takes an HF model directory or a ``.gguf`` file, converted once into
the cache (``spark_jax.model_dir``). ``--lora-modules NAME=PEFT_DIR`` (repeatable) serves
PEFT adapters as models of their own. ``--speculative-config JSON`` (vLLM's flag) speculates
inside the engine, e.g. ``'{"method": "ngram", "num_speculative_tokens": 4}'`` (the keys:
``spark_jax.serving.speculation``; a draft model or head is given by its path).
``--num-scheduler-steps N`` decodes N steps per device call while nothing is admitted, and
``--gpu-memory-utilization F`` sizes the KV page pool to that share of the GPU's memory
(vLLM's flags; ``sj.Engine``'s options of the same names). The engine
compiles every step shape before the server starts listening (``--skip-warmup`` compiles on
first use instead). Routes and errors: ``spark_jax.serving.server``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from spark_jax.model_dir import add_load_arguments, cache_root, load_arguments, resolve_model_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spark_jax.serve", description=__doc__)
    p.add_argument("--model", help="a converted directory, an HF directory or a .gguf file")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the base model's name (default: --model's)")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences decoded at once")
    p.add_argument("--max-model-len", type=int, help="longest prompt + output")
    p.add_argument(
        "--max-num-batched-tokens", type=int, help="prefill tokens per step (a power of two)"
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        help="decode steps per device call when a step only decodes (default 1; more trade "
        "time to first token for throughput: BENCHMARKS.md)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="size the KV page pool to this share of the GPU's memory (default: a row of "
        "--max-model-len per sequence)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="waiting requests beyond this are answered 503",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PEFT_DIR",
        help="LoRA adapters, each served under its NAME",
    )
    p.add_argument(
        "--speculative-config",
        type=_speculative_config,
        help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4}',
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast the weights on load")
    add_load_arguments(p)
    p.add_argument("--skip-warmup", action="store_true", help="compile step shapes on first use")
    p.add_argument(
        "--compilation-cache",
        default=str(cache_root() / "xla"),
        help="directory of XLA's persistent compilation cache ('' turns it off)",
    )
    return p


def _speculative_config(text: str) -> dict[str, Any]:
    """``--speculative-config``'s JSON object (its keys are checked by the engine)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error.msg}): {text!r}") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return config


def _adapters(parser: argparse.ArgumentParser, specs: list[str]) -> dict[str, str]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora-modules takes NAME=PEFT_DIR, got {spec!r}.")
        adapters[name] = path
    return adapters


def build_engine(args: argparse.Namespace, adapters: dict[str, str]) -> tuple[Any, str]:
    """The loaded model's engine (adapters added) and the base model's served name."""
    import spark_jax as sj

    path = resolve_model_dir(args.model)
    model = sj.load(path, dtype=args.dtype, **load_arguments(args))
    if model.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer files; reconvert it with its tokenizer.")
    if adapters:
        model.enable_lora(max_adapters=max(len(adapters), 1))
        for name, adapter_dir in adapters.items():
            model.add_adapter(name, adapter_dir)
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.max_num_batched_tokens is not None:
        if model.config.is_encoder_decoder:
            raise ValueError("--max-num-batched-tokens applies to decoder-only models.")
        kwargs["max_batch_tokens"] = args.max_num_batched_tokens
    for option in ("speculative_config", "num_scheduler_steps", "gpu_memory_utilization"):
        if getattr(args, option) is not None:  # the engine refuses those its model lacks
            kwargs[option] = getattr(args, option)
    engine = sj.Engine(model, **kwargs)
    name = args.served_model_name or (args.model or "SmolLM2-135M-Instruct")
    return engine, str(name)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    adapters = _adapters(parser, args.lora_modules)
    if args.compilation_cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    from spark_jax.serving.server import ServerOptions, serve

    try:
        engine, name = build_engine(args, adapters)
        options = ServerOptions(name, args.api_key, args.max_queued_requests)
        if not args.skip_warmup:
            print("compiling every step shape (warm-up)", file=sys.stderr)
            engine.warmup()
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None
    serve(engine, options, args.host, args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
