"""Tokenization for etjax: GGUF/Hugging Face tokenizers, chat templates, streaming decode."""

from etjax.tokenizer.chat_template import ChatTemplate
from etjax.tokenizer.detokenizer import IncrementalDetokenizer
from etjax.tokenizer.tokenizer import END_OF_TURN_TOKENS, Tokenizer

__all__ = ["END_OF_TURN_TOKENS", "ChatTemplate", "IncrementalDetokenizer", "Tokenizer"]
