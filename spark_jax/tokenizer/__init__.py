"""Tokenizers (tokenizer.json / sentencepiece), chat templates and incremental detokenizing."""

from spark_jax.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
