"""What GGUF vocabularies of every kind share: reading the `tokenizer.ggml.*` fields, and the
special tokens, BOS/EOS wrapping and chat template a Tokenizer is made with.

Byte-level BPE vocabularies (tokenizer.py, `Tokenizer.from_gguf_metadata`) and SentencePiece
ones (sentencepiece_gguf.py) build their own `tokenizers` backend, then both finish it here
(`gguf_specials`), so the two paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from etjax.errors import TokenizerError

# llama.cpp's token types (gguf's TokenType): control tokens are special, user-defined ones
# match whole but are text.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def string_list(metadata: Mapping[str, Any], key: str, source: str) -> list[str]:
    value = metadata.get(key)
    if value is None:
        raise TokenizerError(f"{source}: GGUF metadata has no {key} field")
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise TokenizerError(f"{source}: {key} must be an array of strings")
    return list(value)


def gguf_token_id(metadata: Mapping[str, Any], key: str, count: int, source: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
        raise TokenizerError(
            f"{source}: {key} is {value!r}; it must be a token id in 0..{count - 1}"
        )
    return value


def template_processor(
    bos: tuple[str, int] | None, eos: tuple[str, int] | None
) -> processors.TemplateProcessing:
    """Post-processor that wraps each sequence in the given BOS/EOS (either may be None)."""
    head = f"{bos[0]}:0 " if bos else ""
    tail = f" {eos[0]}:0" if eos else ""
    single = f"{head}$A:0{tail}"
    pair = (
        f"{single}{(' ' + bos[0] + ':1') if bos else ''} $B:1{(' ' + eos[0] + ':1') if eos else ''}"
    )
    special = [t for t in (bos, eos) if t is not None]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def mark_special(backend: tokenizers.Tokenizer, texts: Iterable[str]) -> None:
    """Register existing vocabulary entries as special added tokens.

    transformers registers every named special token (and GPT2Tokenizer's default
    ``<|endoftext|>``) this way, which makes it match whole in text and drop out of
    ``decode(skip_special_tokens=True)``. Unlike transformers we never *create* a token here:
    a text absent from the vocabulary would get an id past the model's embedding table.
    """
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    vocab = backend.get_vocab(with_added_tokens=False)
    new = []
    for text in texts:
        if text in vocab and text not in added:
            new.append(AddedToken(text, special=True, normalized=False))
            added.add(text)
    if new:
        backend.add_special_tokens(new)


def gguf_specials(
    metadata: Mapping[str, Any],
    tokens: Sequence[str],
    backend: tokenizers.Tokenizer,
    source: str,
    add_bos_default: bool = True,
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """Finish `backend` for a GGUF vocabulary of `tokens`: mark its named special tokens (and
    `extra` texts) special and wrap sequences in BOS/EOS as the file says
    (`add_bos_token` defaults to `add_bos_default`: SentencePiece files add BOS unless told,
    byte-level ones do not). Returns the other keyword arguments of `Tokenizer`: the BOS,
    EOS and extra end-of-turn ids, the chat template, the named special tokens, the source."""
    ids = {
        name: gguf_token_id(metadata, f"tokenizer.ggml.{key}", len(tokens), source)
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    special_tokens = {name: tokens[i] for name, i in ids.items() if i is not None}
    mark_special(backend, [*special_tokens.values(), *extra])
    bos_id, eos_id = ids["bos_token"], ids["eos_token"]
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = template_processor(
        (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None,
        (tokens[eos_id], eos_id) if add_eos and eos_id is not None else None,
    )
    extra_eos = [
        i
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if (i := gguf_token_id(metadata, key, len(tokens), source)) is not None
    ]
    template = metadata.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{source}: tokenizer.chat_template must be a string")
    return {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "extra_eos_token_ids": extra_eos,
        "chat_template": template,
        "chat_template_origin": f"{source}: tokenizer.chat_template",
        "special_tokens": special_tokens,
        "source": source,
    }
