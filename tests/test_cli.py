"""The command line, ``python -m spark_jax.generate``, driven through ``main([...])`` on the CPU.

NLLB: a tiny random M2M100 saved by transformers plus a tiny NLLB sentencepiece model, put
through the project's converter, translates a prompt (beam and greedy) and a batch of stdin
lines exactly as the library calls do. Decoder: ``--json`` on the real SmolLM2 checkpoint.
Bad flag values stop the CLI before any model is loaded. The load flags (``--tensor-parallel``,
``--kv-cache-dtype``) reach ``sj.load`` from both command lines, the CLI's and the server's.
"""

from __future__ import annotations

import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import helpers
import pytest
import sentencepiece

import spark_jax as sj
from conversion.hf_to_orbax import convert
from spark_jax.generate import main
from spark_jax.generation import beam as beam_module
from spark_jax.generation.generate import generate

SENTENCES = ["the quick brown fox", "hello world again", "a lazy dog sleeps here"]
MAX_TOKENS = 12
NLLB_FLAGS = ["--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn", "--max-tokens", str(MAX_TOKENS)]


def _train_nllb_spm() -> bytes:
    """A bpe sentencepiece model of exactly ``helpers.SPM_SIZE`` pieces (the fixture's layout)."""
    words = "the quick brown fox jumps over a lazy dog hello world again sleeps here".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(300)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=helpers.SPM_SIZE,
        model_type="bpe",
        minloglevel=2,
    )
    return model.getvalue()


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A converted tiny NLLB checkpoint whose tokenizer is a real sentencepiece model."""
    hf_dir = tmp_path_factory.mktemp("nllb_hf")
    # A mild EOS boost: translations end early but not before they hold a few pieces.
    helpers.tiny_hf(seed=3, eos_boost=1.0).save_pretrained(hf_dir)
    (hf_dir / "sentencepiece.bpe.model").write_bytes(_train_nllb_spm())
    return convert(hf_dir, tmp_path_factory.mktemp("nllb") / "converted", "float32", False)


@pytest.fixture(scope="module")
def nllb_model(nllb_dir: Path) -> sj.Model:
    return sj.load(nllb_dir)


NO_CACHE = ["--compilation-cache", ""]  # XLA's cache dir is process-wide config: keep it off


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main([*NO_CACHE, *argv]) == 0
    return capsys.readouterr().out.splitlines()


def _beam_text(model: sj.Model, text: str, num_beams: int = 4) -> str:
    source = model.tokenizer.encode_source(text, "eng_Latn")
    request = sj.BeamRequest(
        prompt_tokens=source,
        src_lang="eng_Latn",
        tgt_lang="fra_Latn",
        num_beams=num_beams,
        max_new=MAX_TOKENS,
    )
    return model.tokenizer.decode(sj.generate_beam(model, [request])[0].sequences[0])


def _greedy_text(model: sj.Model, text: str) -> str:
    source = model.tokenizer.encode_source(text, "eng_Latn")
    params = sj.SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, src_lang="eng_Latn", tgt_lang="fra_Latn"
    )
    return generate(model, source, params).text


# ---------------------------------------------------------------------------------------------
# NLLB


def test_the_converter_keeps_the_nllb_tokenizer(nllb_dir: Path, nllb_model: sj.Model) -> None:
    assert (nllb_dir / "sentencepiece.bpe.model").is_file()
    tokenizer = nllb_model.tokenizer
    assert tokenizer.lang_code_to_id("fra_Latn") == helpers.LANGUAGE_IDS["fra_Latn"]
    source = tokenizer.encode_source(SENTENCES[0], "eng_Latn")
    assert source[0] == helpers.LANGUAGE_IDS["eng_Latn"] and source[-1] == helpers.EOS
    assert tokenizer.decode(source) == SENTENCES[0]


def test_a_prompt_is_translated_with_beam_search_like_generate_beam(
    capsys: pytest.CaptureFixture[str], nllb_dir: Path, nllb_model: sj.Model
) -> None:
    out = _run(
        capsys,
        ["--model", str(nllb_dir), *NLLB_FLAGS, "--num-beams", "4", "--prompt", SENTENCES[0]],
    )
    assert out == [_beam_text(nllb_model, SENTENCES[0])]


def test_stdin_lines_are_translated_as_one_batch_equal_to_each_alone(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    nllb_dir: Path,
    nllb_model: sj.Model,
) -> None:
    calls: list[int] = []
    original = beam_module.generate_beam

    def counting(model: Any, requests: list[sj.BeamRequest], *args: Any, **kw: Any) -> Any:
        calls.append(len(requests))
        return original(model, requests, *args, **kw)

    monkeypatch.setattr(beam_module, "generate_beam", counting)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(SENTENCES) + "\n\n"))
    out = _run(capsys, ["--model", str(nllb_dir), *NLLB_FLAGS, "--num-beams", "4"])
    assert calls == [len(SENTENCES)]
    alone = [_beam_text(nllb_model, s) for s in SENTENCES]
    assert out == alone
    assert any(alone), "the tiny model should translate into some text"


def test_greedy_translation_of_a_prompt_and_of_stdin_lines(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    nllb_dir: Path,
    nllb_model: sj.Model,
) -> None:
    alone = [_greedy_text(nllb_model, s) for s in SENTENCES]
    flags = ["--model", str(nllb_dir), *NLLB_FLAGS, "--num-beams", "1"]
    assert _run(capsys, [*flags, "--prompt", SENTENCES[0]]) == [alone[0]]

    batches: list[int] = []
    original = sj.generate_batch

    def counting(model: Any, prompts: list[list[int]], *args: Any, **kw: Any) -> Any:
        batches.append(len(prompts))
        return original(model, prompts, *args, **kw)

    monkeypatch.setattr(sj, "generate_batch", counting)
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(SENTENCES)))
    assert _run(capsys, flags) == alone
    assert batches == [len(SENTENCES)]


# ---------------------------------------------------------------------------------------------
# Decoder


def test_json_output_of_smollm2_answers_paris(
    capsys: pytest.CaptureFixture[str], smollm2_converted: Path
) -> None:
    argv = [*NO_CACHE, "--model", str(smollm2_converted), "--json", "--max-tokens", "24"]
    out = _run(capsys, [*argv, "--prompt", "What is the capital of France?"])
    assert len(out) == 1
    result = json.loads(out[0])
    assert {"text", "output_tokens", "finish_reason", "timings"} <= set(result)
    assert "Paris" in result["text"]
    assert result["finish_reason"] in ("stop", "length")
    assert len(result["output_tokens"]) <= 24
    assert result["timings"]["load_s"] >= 0


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--temperature", "-1"], "temperature"),
        (["--kv-cache-dtype", "int4"], "kv_cache_dtype 'int4' is not supported; use one of"),
    ],
)
def test_an_invalid_flag_value_exits_before_loading(
    flags: list[str],
    says: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_load(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the model must not be loaded for an invalid flag")

    monkeypatch.setattr(sj, "load", no_load)
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "/nonexistent", *flags, "--prompt", "hi"])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("module", ["spark_jax.generate", "spark_jax.serve"])
def test_load_flags_reach_sj_load(
    module: str, nllb_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    seen: dict[str, Any] = {}

    def recording_load(path: Any, **kwargs: Any) -> None:
        seen.update(kwargs)
        raise OSError("stopped after the load's arguments")

    monkeypatch.setattr(sj, "load", recording_load)
    argv = [*NO_CACHE, "--model", str(nllb_dir)]
    argv += ["--prompt", "hi"] if module == "spark_jax.generate" else []
    cli = importlib.import_module(module)
    with pytest.raises(SystemExit, match="stopped after"):
        cli.main(argv)
    assert seen["kv_cache_dtype"] == "auto" and seen["tensor_parallel"] == 1
    seen.clear()
    with pytest.raises(SystemExit, match="stopped after"):
        cli.main([*argv, "--kv-cache-dtype", "fp8", "--tensor-parallel", "2"])
    assert seen["kv_cache_dtype"] == "fp8" and seen["tensor_parallel"] == 2


def test_an_fp8_cache_for_a_translation_model_is_one_line(nllb_dir: Path) -> None:
    argv = [*NO_CACHE, "--model", str(nllb_dir), *NLLB_FLAGS, "--prompt", "hello world"]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--kv-cache-dtype", "fp8"])
    assert str(exit_info.value) == (
        "error: kv_cache_dtype='fp8' is for decoder-only models; leave it 'auto' for an "
        "encoder-decoder."
    )


def test_importing_the_cli_module_keeps_sj_generate_working(tiny_llama):
    _, model = tiny_llama
    params = sj.SamplingParams(temperature=0.0, max_tokens=4)
    assert (
        sj.generate(model, [1, 2, 3], params).output_tokens
        == generate(model, [1, 2, 3], params).output_tokens
    )


def test_speculative_flags_give_the_greedy_answer_with_statistics(
    capsys: pytest.CaptureFixture[str], smollm2_converted: Path, smollm2: sj.Model
) -> None:
    question = "Repeat exactly: the cat sat on the mat. the cat sat on the mat."
    argv = [*NO_CACHE, "--model", str(smollm2_converted), "--json", "--max-tokens", "24"]
    main([*argv, "--speculative", "ngram", "--num-drafts", "4", "--prompt", question])
    out = json.loads(capsys.readouterr().out)
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": question}])
    plain = generate(smollm2, prompt, sj.SamplingParams(temperature=0.0, max_tokens=24))
    assert out["output_tokens"] == plain.output_tokens
    assert out["spec_stats"]["verify_steps"] >= 1 and out["spec_stats"]["num_drafted"] > 0
    with pytest.raises(SystemExit, match="--skip-layers"):
        main([*argv, "--speculative", "layer-skip", "--prompt", question])
