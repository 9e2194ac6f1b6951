"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model == "llama"``), rebuilt for
the ``tokenizers`` library so that they produce the ids transformers produces for the same file.

llama.cpp stores such a vocabulary as three parallel arrays: the pieces (spaces spelled "▁"),
their scores and their token types (1 normal, 3 control, 4 user-defined, 6 byte: the 256
``<0xNN>`` pieces that spell any character the vocabulary lacks, as UTF-8 bytes). There are no
merges. transformers 5 (``integrations/gguf/gguf_tokenizer_mapping.py``, the reference) builds
the tokenizer by ``general.architecture``; etjax supports the Gemma family (gemma, gemma2,
gemma3), which it builds as ``GemmaTokenizer``:

* a BPE model with byte fallback over the whole text: the normalizer spells every space "▁"
  and nothing splits the text into words, so a run of spaces, tabs or newlines is merged like
  any other characters; no "▁" is prepended (whatever ``tokenizer.ggml.add_space_prefix``
  says, transformers ignores it for Gemma);
* merges derived from the vocabulary: every way of cutting a piece in two whose halves are
  both pieces, pieces in file order (Gemma's scores do not follow its merge order, the file
  order does), the cuts of one piece longest left half first;
* the user-defined pieces of two or more spaces, stored with real spaces, respelled with "▁"
  (Gemma's own vocabulary spells them so, and the merges above must meet them);
* control pieces (``<bos>``, ``<start_of_turn>``, ``<unused0>``, ...) as special added tokens
  and the other user-defined ones (newline runs, HTML tags) as plain added tokens: both are
  matched whole in the raw text;
* BOS prepended when ``tokenizer.ggml.add_bos_token`` says so (true when absent, as llama.cpp
  and transformers read a SentencePiece vocabulary), EOS appended when ``add_eos_token`` does.

The Llama 2 / Mistral / Phi-3 flavours of the same vocabulary type (a "▁" prepended, merges by
score) are built differently by transformers and are not supported: they raise TokenizerError.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, normalizers
from tokenizers.models import BPE

from etjax.errors import TokenizerError
from etjax.tokenizer.gguf_vocab import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    gguf_token_id,
    string_list,
)

GEMMA_ARCHITECTURES: frozenset[str] = frozenset({"gemma", "gemma2", "gemma3"})
_SPACE = "\u2581"  # SentencePiece's spelling of " "


def sentencepiece_backend(
    metadata: Mapping[str, Any], source: str
) -> tuple[list[str], tokenizers.Tokenizer]:
    """The tokens and `tokenizers` backend of a GGUF SentencePiece vocabulary (rules in the
    module docstring), before its special tokens are marked (gguf_vocab.py `gguf_specials`).

    ``metadata`` holds the file's ``tokenizer.*`` fields and its ``general.architecture``;
    ``source`` names the file in error messages. The finished Tokenizer's ids equal
    transformers' ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``; raises
    TokenizerError naming the field at fault.
    """
    architecture = metadata.get("general.architecture")
    if architecture not in GEMMA_ARCHITECTURES:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.model is 'llama' (a SentencePiece vocabulary) and "
            f"general.architecture is {architecture!r}; etjax builds SentencePiece vocabularies "
            f"of {sorted(GEMMA_ARCHITECTURES)} only (byte-level 'gpt2' ones of any model)"
        )
    tokens = string_list(metadata, "tokenizer.ggml.tokens", source)
    types = metadata.get("tokenizer.ggml.token_type")
    if (
        not isinstance(types, Sequence)
        or len(types) != len(tokens)
        or not all(isinstance(t, int) for t in types)
    ):
        raise TokenizerError(
            f"{source}: tokenizer.ggml.token_type must be a list of {len(tokens)} integers, one "
            "per token in tokenizer.ggml.tokens (a SentencePiece vocabulary needs it to tell "
            "control and user-defined pieces from text)"
        )

    unk = gguf_token_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens), source)
    backend = gemma_backend(tokens, types, unk_token="<unk>" if unk is None else tokens[unk])
    return tokens, backend


def gemma_backend(
    tokens: Sequence[str], types: Sequence[int], unk_token: str = "<unk>"
) -> tokenizers.Tokenizer:
    """Gemma's BPE tokenizer from GGUF pieces and their llama.cpp token types.

    Returns a ``tokenizers.Tokenizer`` without post-processor: ids only, no BOS/EOS.
    """
    pieces = [_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    # Later duplicates win, as in a dict built from the list (what transformers does).
    vocab = {piece: index for index, piece in enumerate(pieces)}
    backend = tokenizers.Tokenizer(
        BPE(
            vocab=vocab,
            merges=derived_merges(vocab),
            unk_token=unk_token,
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    # Spaces become "▁" before the model sees them, so the text is one sequence for BPE: no
    # pre-tokenizer (transformers sets one that splits on " ", which never occurs by then).
    backend.normalizer = normalizers.Replace(" ", _SPACE)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    # Added tokens are matched in the raw text, before the normalizer: a user-defined piece is
    # added only under the spelling it has in the vocabulary, so the respelled space runs are
    # left to the merges.
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in zip(tokens, types, strict=True)
            if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
    )
    return backend


def derived_merges(vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a merge-less vocabulary implies, best first.

    Each piece contributes every cut into two pieces of ``vocab``; pieces rank by id (file
    order), and the cuts of one piece by the length of their left half, longest first. Returns
    ``(left, right)`` pairs, the order transformers' ``generate_merges`` gives when scored by
    file position.
    """
    merges = []
    for piece, _ in sorted(vocab.items(), key=lambda item: item[1]):
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
