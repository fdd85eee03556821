"""Tokenisation, chat templates and incremental detokenisation (used by the gateway and offline API)."""

from shared.text.detokenizer import IncrementalDetokenizer
from shared.text.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]
