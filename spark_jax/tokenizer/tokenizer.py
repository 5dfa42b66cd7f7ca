"""Text <-> token ids for a converted model directory, plus chat templates and streaming decode.

`Tokenizer.from_dir(path)` reads the Hugging Face tokenizer files a checkpoint carries:

- ``tokenizer.json`` through the `tokenizers` library (preferred: it is the exact pipeline HF
  uses, including normalizer, pre-tokenizer and post-processor special tokens);
- otherwise a sentencepiece model, ``tokenizer.model`` (Llama / Mistral style) or
  ``sentencepiece.bpe.model`` (NLLB). NLLB gets fairseq's id layout rebuilt on top of the
  sentencepiece ids, because the model's embedding rows are in that layout, not in spm's.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never split a
UTF-8 character and concatenate to exactly `Tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.sandbox

from spark_jax.tokenizer.nllb_languages import FAIRSEQ_LANGUAGE_CODES

_REPLACEMENT_CHAR = "\ufffd"
_NLLB_MODEL_TYPES = ("m2m_100", "nllb", "nllb-moe")


# ---------------------------------------------------------------------------------------------
# Config files


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json stores a special token either as a string or as a serialized
    # AddedToken ({"content": ..., "lstrip": ...}); only the text matters here.
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_template(path: Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.47 saves the template to its own file; older checkpoints keep it in
    # tokenizer_config.json, either as a string or as a list of named templates.
    template_file = path / "chat_template.jinja"
    if template_file.is_file():
        return template_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry["name"]: entry["template"] for entry in template}
        return named.get("default")
    return template


# ---------------------------------------------------------------------------------------------
# Backends: the minimal surface the Tokenizer needs from each tokenization library


class _Backend(Protocol):
    def encode(self, text: str, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...


class _HFTokenizersBackend:
    """tokenizer.json: the `tokenizers` library runs the whole HF pipeline itself."""

    def __init__(self, tokenizer_json: Path):
        import tokenizers

        self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        self._special_ids = frozenset(
            token_id
            for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
            if token.special
        )

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer


def _without_dummy_prefix(model_proto: bytes) -> bytes:
    # sentencepiece has no per-call switch for its dummy "▁" prefix. Protobuf merges repeated
    # occurrences of a singular sub-message, so appending a NormalizerSpec (ModelProto field 3)
    # that holds only add_dummy_prefix=false (NormalizerSpec field 3, varint 0) flips that one
    # flag and leaves everything else as trained — no protobuf dependency needed.
    return model_proto + b"\x1a\x02\x18\x00"


@dataclasses.dataclass(frozen=True)
class _SpmIdLayout:
    """How model ids map to sentencepiece ids.

    Llama-style models use spm ids unchanged. Fairseq (NLLB) pins `<s> <pad> </s> <unk>` to
    ids 0..3 and shifts every other spm piece up by `offset`; ids past the spm vocabulary are
    tokens that exist only in the model's vocabulary (language codes, `<mask>`).
    """

    offset: int
    pinned: Mapping[str, int]  # special token text -> model id, outside the spm shift
    spm_unk_id: int

    def to_model(self, spm_id: int) -> int:
        if spm_id == self.spm_unk_id and "<unk>" in self.pinned:
            return self.pinned["<unk>"]
        return spm_id + self.offset


class _SentencePieceBackend:
    """A sentencepiece model plus the extra tokens the model's vocabulary adds around it."""

    def __init__(
        self,
        model_file: Path,
        layout: _SpmIdLayout,
        extra_tokens: Mapping[str, int],
        prefix_after_special: bool,
    ):
        import sentencepiece

        proto = model_file.read_bytes()
        self._spm = sentencepiece.SentencePieceProcessor(model_proto=proto)
        # Text that follows a special token is a continuation, not the start of the input:
        # HF's non-legacy Llama tokenizers do not prepend "▁" there, NLLB ("always") does.
        self._spm_continuation = (
            self._spm
            if prefix_after_special
            else sentencepiece.SentencePieceProcessor(model_proto=_without_dummy_prefix(proto))
        )
        self._layout = layout
        self._spm_size = self._spm.get_piece_size()
        self._token_ids: dict[str, int] = {**layout.pinned, **extra_tokens}
        self._id_tokens = {token_id: token for token, token_id in self._token_ids.items()}
        # sentencepiece's own control pieces (<s>, </s>, <unk>) decode to "" or " ⁇ ", so the
        # ones that are not pinned still count as special for skip_special_tokens.
        control = {
            self._model_id(i)
            for i in range(self._spm_size)
            if self._spm.is_control(i) or self._spm.is_unknown(i)
        }
        self._special_ids = frozenset(self._id_tokens) | frozenset(control)
        # Longest first, so that a token is never matched by a shorter one that prefixes it.
        specials = sorted(self._token_ids, key=len, reverse=True)
        self._split_pattern = (
            re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None
        )

    def _model_id(self, spm_id: int) -> int:
        return self._layout.to_model(spm_id)

    def _spm_id(self, model_id: int) -> int | None:
        if model_id in self._id_tokens:
            return None
        spm_id = model_id - self._layout.offset
        return spm_id if 0 <= spm_id < self._spm_size else None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # add_special_tokens is handled by Tokenizer (BOS/EOS policy lives in the config).
        del add_special_tokens
        ids: list[int] = []
        pieces = self._split_pattern.split(text) if self._split_pattern else [text]
        after_special = False
        for index, piece in enumerate(pieces):
            if index % 2 == 1:  # re.split puts captured special tokens at odd indices
                ids.append(self._token_ids[piece])
                after_special = True
            elif piece:
                processor = self._spm_continuation if after_special else self._spm
                ids.extend(self._model_id(i) for i in processor.encode(piece))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # Runs of ordinary ids are decoded together so that spm can merge byte-fallback pieces
        # and handle "▁" spacing; special tokens are spliced in as their text (or dropped).
        parts: list[str] = []
        run: list[int] = []
        for model_id in ids:
            if model_id in self._special_ids and skip_special_tokens:
                continue
            spm_id = self._spm_id(model_id)
            if spm_id is not None and model_id not in self._special_ids:
                run.append(spm_id)
                continue
            if run:
                parts.append(self._spm.decode(run))
                run = []
            token = self._id_tokens.get(model_id)
            if token is None and spm_id is not None:
                token = self._spm.id_to_piece(spm_id)
            parts.append(token or "")
        if run:
            parts.append(self._spm.decode(run))
        return "".join(parts)

    def token_to_id(self, token: str) -> int | None:
        if token in self._token_ids:
            return self._token_ids[token]
        spm_id = self._spm.piece_to_id(token)
        if spm_id == self._spm.unk_id() and token != self._spm.id_to_piece(spm_id):
            return None
        return self._model_id(spm_id)

    @property
    def vocab_size(self) -> int:
        return max(self._spm_size + self._layout.offset, max(self._id_tokens, default=-1) + 1)

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids


# ---------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes "<" and ">", which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile_chat_template(source: str) -> jinja2.Template:
    # Templates ship with checkpoints and are untrusted code, hence the immutable sandbox. The
    # settings and helpers mirror transformers' so that templates render byte-identically.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------
# The tokenizer


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids, chat template, NLLB language codes."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        language_codes: Sequence[str] = (),
        default_src_lang: str | None = None,
    ):
        self._backend = backend
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}
        self._tokens |= {"unk_token": unk_token, "pad_token": pad_token}
        self._add_bos = add_bos_token
        self._add_eos = add_eos_token
        self._chat_template_source = chat_template
        self._chat_template: jinja2.Template | None = None
        self._language_ids = {code: backend.token_to_id(code) for code in language_codes}
        self.language_codes: tuple[str, ...] = tuple(language_codes)
        self.default_src_lang = default_src_lang

    # -- loading -----------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        model_type = _read_json(path / "config.json").get("model_type", "")
        is_nllb = (
            model_type in _NLLB_MODEL_TYPES
            or str(config.get("tokenizer_class", "")).startswith("Nllb")
            or (path / "sentencepiece.bpe.model").is_file()
        )

        def token(name: str, default: str | None) -> str | None:
            value = _token_content(config.get(name)) or _token_content(special_map.get(name))
            return value or default

        chat_template = _read_chat_template(path, config)
        if (path / "tokenizer.json").is_file():
            backend: _Backend = _HFTokenizersBackend(path / "tokenizer.json")
            # The post-processor in tokenizer.json already decides which specials are added.
            add_bos = add_eos = False
            codes = [c for c in FAIRSEQ_LANGUAGE_CODES if backend.token_to_id(c) is not None]
            languages = codes if is_nllb else []
        elif is_nllb and (path / "sentencepiece.bpe.model").is_file():
            backend = _nllb_sentencepiece_backend(path / "sentencepiece.bpe.model")
            add_bos, add_eos, languages = False, False, list(FAIRSEQ_LANGUAGE_CODES)
        elif (path / "tokenizer.model").is_file():
            backend = _llama_sentencepiece_backend(path / "tokenizer.model", config)
            # The slow HF Llama tokenizer's defaults: BOS on, EOS off.
            add_bos = bool(config.get("add_bos_token", True))
            add_eos = bool(config.get("add_eos_token", False))
            languages = []
        else:
            raise FileNotFoundError(
                f"{path}: no tokenizer.json, tokenizer.model or sentencepiece.bpe.model"
            )

        defaults = ("<s>", "</s>", "<unk>", "<pad>") if is_nllb else (None, None, None, None)
        return cls(
            backend,
            bos_token=token("bos_token", defaults[0]),
            eos_token=token("eos_token", defaults[1]),
            unk_token=token("unk_token", defaults[2]),
            pad_token=token("pad_token", defaults[3]),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=chat_template,
            language_codes=languages,
            default_src_lang=config.get("src_lang") or ("eng_Latn" if languages else None),
        )

    # -- special tokens ----------------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        token = self._tokens[name]
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        """Named special tokens (bos/eos/unk/pad) and every id that decode skips, sorted."""
        named = (self._special_id(name) for name in self._tokens)
        return tuple(sorted(self._backend.special_ids | {i for i in named if i is not None}))

    @property
    def skipped_special_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` drops (the backend's special tokens)."""
        return self._backend.special_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF's `len(tok)`)."""
        return self._backend.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` read from tokenizer.json (HF's name for it), or None
        for a sentencepiece model."""
        return getattr(self._backend, "tokenizer", None)

    # -- encode / decode ---------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.language_codes and add_special_tokens:
            # NLLB's special tokens depend on the source language; HF defaults to eng_Latn.
            return self.encode_source(text, self.default_src_lang or "eng_Latn")
        ids = self._backend.encode(text, add_special_tokens)
        if add_special_tokens:
            if self._add_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id, *ids]
            if self._add_eos and self.eos_token_id is not None:
                ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens)

    # -- NLLB languages ----------------------------------------------------------------------

    def lang_code_to_id(self, code: str) -> int:
        token_id = self._language_ids.get(code)
        if token_id is None:
            if not self.language_codes:
                raise ValueError(f"{code!r}: this tokenizer has no language codes")
            close = difflib.get_close_matches(code, self.language_codes, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown language code {code!r}{hint}")
        return token_id

    def encode_source(self, text: str, src_lang: str) -> list[int]:
        """An NLLB encoder input: `[src_lang] tokens </s>` (HF's non-legacy layout)."""
        lang_id = self.lang_code_to_id(src_lang)
        if self.eos_token_id is None:
            raise ValueError("tokenizer has no eos token")
        return [lang_id, *self._backend.encode(text, False), self.eos_token_id]

    # -- chat --------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template_source is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` to the prompt string the model was fine-tuned on."""
        if self._chat_template_source is None:
            raise ValueError("this tokenizer has no chat template")
        if self._chat_template is None:
            self._chat_template = _compile_chat_template(self._chat_template_source)
        special = {name: token for name, token in self._tokens.items() if token is not None}
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **{**special, **kwargs},
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # The template already writes BOS and role markers; adding specials again would double
        # them (HF tokenizes chat prompts with add_special_tokens=False for the same reason).
        prompt = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(prompt, add_special_tokens=False)


def _llama_sentencepiece_backend(model_file: Path, config: Mapping[str, Any]) -> _Backend:
    import sentencepiece

    spm = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    # spm's control pieces (<s>, </s>, <unk>) must be matchable in text, as in HF, so that a
    # chat template writing "<s>" encodes to BOS. Added tokens beyond the spm vocabulary (chat
    # markers and the like) are listed in tokenizer_config.json and matched the same way.
    extra = {
        spm.id_to_piece(i): i
        for i in (spm.bos_id(), spm.eos_id(), spm.unk_id())
        if 0 <= i < spm.get_piece_size()
    }
    for token_id, entry in config.get("added_tokens_decoder", {}).items():
        extra[entry["content"]] = int(token_id)
    layout = _SpmIdLayout(offset=0, pinned={}, spm_unk_id=spm.unk_id())
    # Legacy Llama tokenizers restart sentencepiece, dummy prefix included, after specials.
    legacy = bool(config.get("legacy", False))
    return _SentencePieceBackend(
        model_file, layout, extra_tokens=extra, prefix_after_special=legacy
    )


def _nllb_sentencepiece_backend(model_file: Path) -> _SentencePieceBackend:
    import sentencepiece

    spm_size = sentencepiece.SentencePieceProcessor(model_file=str(model_file)).get_piece_size()
    # fairseq's dictionary: four pinned specials, spm pieces shifted by one, then the language
    # codes in FAIRSEQ_LANGUAGE_CODES order, then <mask> last.
    offset = 1
    pinned = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    languages = {code: spm_size + offset + i for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)}
    extra = {**languages, "<mask>": spm_size + offset + len(FAIRSEQ_LANGUAGE_CODES)}
    layout = _SpmIdLayout(offset=offset, pinned=pinned, spm_unk_id=0)
    return _SentencePieceBackend(model_file, layout, extra_tokens=extra, prefix_after_special=True)


# ---------------------------------------------------------------------------------------------
# Streaming


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas.

    Decoding a single token in isolation is wrong twice over: sentencepiece drops the "▁" of
    the first token of a decode call, and a byte-level or byte-fallback token may hold only
    part of a UTF-8 character. So each step decodes a short window: `[prefix, read)` is text
    already emitted (kept only as context), `[read, end)` is new. The new suffix is emitted
    once it no longer ends in U+FFFD (an incomplete character), and the window then slides.
    Work per token is O(window), and ids before the window are dropped.

    Concatenating every `add` result and `finish()` equals `tokenizer.decode(all_ids)`.
    `context_ids` (e.g. the prompt's tail) seed the window so the first delta keeps its
    leading space; their own text is not emitted.
    """

    # A UTF-8 character has at most 4 bytes and every byte token carries at least one, so a
    # window still ending in U+FFFD after this many pending tokens holds genuinely invalid
    # bytes (or a literal U+FFFD): emit it rather than let the window grow without bound.
    _MAX_PENDING_TOKENS = 4
    _CONTEXT_TOKENS = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        context_ids: Sequence[int] = (),
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        # Skipped specials never enter the window: they decode to "" and, as the first token
        # of a window, would hide the "▁" of the token after them.
        self._dropped = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        context = [int(i) for i in context_ids if int(i) not in self._dropped]
        self._ids: list[int] = context[-self._CONTEXT_TOKENS :]
        self._prefix = 0
        self._read = len(self._ids)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], self._skip_special)

    def _emit(self, force: bool) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        full_text = self._decode(self._prefix, len(self._ids))
        pending = len(self._ids) - self._read
        complete = not full_text.endswith(_REPLACEMENT_CHAR)
        if not (force or complete or pending > self._MAX_PENDING_TOKENS):
            return ""
        delta = full_text[len(prefix_text) :]
        # Slide: the tokens just emitted become the context for the next window.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes (possibly "")."""
        token_id = int(token_id)
        if token_id in self._dropped:
            return ""
        self._ids.append(token_id)
        return self._emit(force=False)

    def finish(self) -> str:
        """Flush whatever is pending, incomplete characters included (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(force=True)
