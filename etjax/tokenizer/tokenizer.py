"""Text <-> token ids for etjax, built on the Hugging Face ``tokenizers`` library.

Three sources are supported:

* a GGUF file (``Tokenizer.from_gguf``) whose ``tokenizer.ggml.model`` is ``"gpt2"`` (byte-level
  BPE: GPT-2, Llama 3, Qwen 2, SmolLM, DeepSeek, ...). The tokenizer is rebuilt from the GGUF
  metadata so that it produces exactly the ids of the model's own ``tokenizer.json``: the family
  named by ``tokenizer.ggml.pre`` brings its normalizer, pre-tokenizer and BPE options
  (``gguf_bpe.py``), and a family it does not know is refused.
* a GGUF file whose ``tokenizer.ggml.model`` is ``"llama"`` (SentencePiece) of the Gemma
  family, rebuilt by etjax/tokenizer/sentencepiece_gguf.py to the same standard.
* a Hugging Face model folder (``Tokenizer.from_hf_dir``) holding ``tokenizer.json``, loaded the
  way transformers' generic ``TokenizersBackend`` loads it.

Special-token rules (documented here once, used by both loaders):

* ``bos_token_id`` is the declared BOS (GGUF ``tokenizer.ggml.bos_token_id``; HF
  ``tokenizer_config.json``/``special_tokens_map.json`` ``bos_token``, else
  ``generation_config.json`` ``bos_token_id``). ``encode`` prepends it only when the tokenizer
  says so (``add_bos_token``; GGUF ``tokenizer.ggml.add_bos_token``, default False for gpt2
  vocabularies as in transformers; HF: only the ``tokenizer.json`` post-processor, because
  transformers 5 ignores ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` when
  ``tokenizer.json`` exists).
* ``eos_token_ids`` are all ids that end generation: the declared EOS first, then, in ascending
  id order, (a) GGUF ``tokenizer.ggml.eot_token_id``/``eom_token_id`` and HF
  ``generation_config.json`` ``eos_token_id`` (an int or a list), and (b) every token of
  ``END_OF_TURN_TOKENS`` that is in the vocabulary *and registered as a special token*. A chat
  model declares one EOS but ends its turns with ``<|im_end|>``/``<|eot_id|>``, and a base model
  ends documents with ``<|endoftext|>``; stopping on any of them is always right, while requiring
  "special" keeps ordinary text that happens to spell such a string from stopping generation.
  ``<|end|>`` is deliberately not in the list: gpt-oss emits it between channels mid-answer
  (Phi-3, which ends turns with it, declares it through eot/generation_config instead).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, decoders
from tokenizers.models import BPE

from etjax.errors import TokenizerError
from etjax.gguf_file import GGUFFile, read_gguf
from etjax.tokenizer.chat_template import ChatTemplate
from etjax.tokenizer.gguf_bpe import gguf_bpe_family
from etjax.tokenizer.gguf_vocab import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    gguf_specials,
    mark_special,
    string_list,
)
from etjax.tokenizer.sentencepiece_gguf import sentencepiece_backend

# Tokens that end a turn or a document in common chat/base models; see the module docstring.
END_OF_TURN_TOKENS: tuple[str, ...] = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<end_of_turn>",
)

# Named special tokens, as transformers passes them to chat templates.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# llama.cpp's token types (enum llama_token_type) that matter for matching text.


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 stand for themselves; the rest (controls, space, ...) are
    shifted to U+0100 and up, in byte order.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + shifted)
            shifted += 1
    return table


_BYTE_TO_CHAR = _byte_to_char()
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def _byte_level_spelling(token: str) -> str:
    """How a byte-level vocabulary spells ``token``.

    GGUF files store byte-level tokens already spelled in the byte alphabet; one stored as raw
    text is re-spelled from its UTF-8 bytes (added tokens keep their text: see
    ``_added_token_texts``).
    """
    if set(token) <= _BYTE_ALPHABET:
        return token
    return "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8"))


def _added_token_texts(
    tokens: Sequence[str], types: Sequence[int], merges: Sequence[tuple[str, str]]
) -> dict[int, str]:
    """The text each control or user-defined GGUF token matches, by token index.

    Most added tokens are stored as the text they match ("<|im_end|>", DeepSeek's
    "<｜end▁of▁sentence｜>", GPT-NeoX's "  "). One exception: llama.cpp's converter decodes an
    added token whose tokenizer.json text was byte-level spelled ("ĊĊ") into raw text ("\\n\\n").
    Such a token is an ordinary vocabulary entry that BPE produces, so it is spelled back: when
    the byte-level spelling is a merge result and no other token has it (a raw-text added token
    always has an id of its own, apart from the entry of the same bytes).
    """
    kinds = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    merged = {left + right for left, right in merges}
    ordinary = {
        _byte_level_spelling(token)
        for token, kind in zip(tokens, types, strict=False)
        if kind not in kinds
    }
    texts = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind not in kinds:
            continue
        spelled = _byte_level_spelling(token)
        texts[index] = spelled if spelled in merged and spelled not in ordinary else token
    return texts


class Tokenizer:
    """A text tokenizer with special-token, chat-template and stop-token knowledge.

    Build one with ``from_gguf`` or ``from_hf_dir``; the constructor takes an already configured
    ``tokenizers.Tokenizer`` (``backend``). See the module docstring for the BOS/EOS rules.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
        chat_template_origin: str = "chat_template",
        special_tokens: Mapping[str, str] | None = None,
        source: str = "<memory>",
    ) -> None:
        self._backend = backend
        self._source = source
        self._bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self._special_tokens = dict(special_tokens or {})
        self._chat_template = (
            ChatTemplate(chat_template, chat_template_origin) if chat_template is not None else None
        )
        self._special_ids = frozenset(
            i for i, t in backend.get_added_tokens_decoder().items() if t.special
        )
        self._special_texts = tuple(
            t.content for t in backend.get_added_tokens_decoder().values() if t.special
        )
        self._eos_token_ids = self._stop_ids(eos_token_id, extra_eos_token_ids)
        probe = backend.encode("", add_special_tokens=True).ids
        self._add_bos_token = bos_token_id is not None and probe[:1] == [bos_token_id]

    # ----------------------------------------------------------------------------- loaders

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | GGUFFile | GGUFReader) -> Tokenizer:
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Accepts a path, a header already read (`etjax.gguf_file.read_gguf`) or an
        open ``gguf.GGUFReader``. Byte-level BPE vocabularies
        (``tokenizer.ggml.model == "gpt2"``) and Gemma's SentencePiece ones (``"llama"``) are
        supported. Returns a Tokenizer whose ids match transformers' for the same file; raises
        TokenizerError naming the file and the field at fault.
        """
        if isinstance(path, GGUFReader):
            return cls._from_gguf_reader(path)
        if isinstance(path, GGUFFile):
            header = path
        else:
            where = os.fspath(path)
            if not Path(where).is_file():
                raise TokenizerError(f"GGUF file {where} does not exist")
            try:
                header = read_gguf(where)
            except (OSError, ValueError) as exc:  # names the field or offset at fault
                raise TokenizerError(f"{where} is not a readable GGUF file: {exc}") from exc
        metadata = {k: v for k, v in header.fields.items() if _tokenizer_key(k)}
        return cls.from_gguf_metadata(metadata, source=str(header.path))

    @classmethod
    def _from_gguf_reader(cls, reader: GGUFReader) -> Tokenizer:
        where = str(getattr(getattr(reader, "data", None), "filename", None) or "GGUF file")
        metadata = {}
        for key, field in reader.fields.items():
            if _tokenizer_key(key):
                try:
                    metadata[key] = field.contents()
                except Exception as exc:  # undecodable strings or malformed arrays
                    raise TokenizerError(f"{where}: GGUF field {key} is unreadable: {exc}") from exc
        return cls.from_gguf_metadata(metadata, source=where)

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "GGUF") -> Tokenizer:
        """Build the tokenizer from already-read GGUF ``tokenizer.*`` metadata (key -> value).

        ``source`` names the file in error messages. Returns a Tokenizer; raises TokenizerError.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError(f"{source}: GGUF metadata has no tokenizer.ggml.model field")
        if model == "llama":
            # SentencePiece vocabularies (Gemma) have a module of their own.
            tokens, backend = sentencepiece_backend(metadata, source)
            return cls(backend, **gguf_specials(metadata, tokens, backend, source))
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) "
                "and, for Gemma, 'llama' (SentencePiece) vocabularies are supported"
            )
        tokens = string_list(metadata, "tokenizer.ggml.tokens", source)
        merge_lines = string_list(metadata, "tokenizer.ggml.merges", source)
        types = metadata.get("tokenizer.ggml.token_type")
        if types is not None and (
            not isinstance(types, Sequence)
            or len(types) != len(tokens)
            or not all(isinstance(t, int) for t in types)
        ):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.token_type must be a list of {len(tokens)} integers, "
                "one per token in tokenizer.ggml.tokens"
            )
        types = list(types or ())

        merges = []
        for index, line in enumerate(merge_lines):
            pair = line.split(" ")
            if len(pair) != 2:
                raise TokenizerError(
                    f"{source}: tokenizer.ggml.merges[{index}] is {line!r}; each merge must be "
                    "two tokens separated by one space"
                )
            merges.append((pair[0], pair[1]))
        family = gguf_bpe_family(metadata.get("tokenizer.ggml.pre"), source)

        # Added tokens (control and user-defined) keep the text llama.cpp stored, which is the
        # text they match; every other token is a byte-level vocabulary entry. Later duplicates
        # win, as in a dict built from the list.
        added = _added_token_texts(tokens, types, merges)
        vocab = {
            added.get(index, _byte_level_spelling(token)): index
            for index, token in enumerate(tokens)
        }
        try:
            model_obj = BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                ignore_merges=family.ignore_merges,
            )
        except Exception as exc:  # tokenizers raises a bare Exception for unknown merge parts
            raise TokenizerError(
                f"{source}: tokenizer.ggml.merges do not fit tokenizer.ggml.tokens: {exc}"
            ) from exc
        backend = tokenizers.Tokenizer(model_obj)
        if family.normalizer is not None:
            backend.normalizer = family.normalizer()
        backend.pre_tokenizer = family.pre_tokenizer()
        backend.decoder = decoders.ByteLevel()

        # Control tokens become special added tokens so they match whole and can be skipped on
        # decode; user-defined ones (<think>, GPT-NeoX's runs of spaces) match whole but are
        # not special. Each keeps its id: its text is its vocabulary entry.
        backend.add_special_tokens(
            [
                AddedToken(added[index], special=True, normalized=False)
                for index, kind in enumerate(types)
                if kind == TOKEN_TYPE_CONTROL
            ]
        )
        backend.add_tokens(
            [
                AddedToken(added[index], special=False, normalized=False)
                for index, kind in enumerate(types)
                if kind == TOKEN_TYPE_USER_DEFINED
            ]
        )

        # transformers' GPT2Tokenizer also registers its default "<|endoftext|>" as special.
        return cls(
            backend,
            **gguf_specials(
                metadata, tokens, backend, source, add_bos_default=False, extra=["<|endoftext|>"]
            ),
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a Hugging Face tokenizer folder: ``tokenizer.json`` plus optional configs.

        Reads ``tokenizer_config.json`` (special tokens, ``chat_template``), ``chat_template.jinja``
        (preferred over the config's template, as in transformers), ``special_tokens_map.json``
        and ``generation_config.json`` when present.
        Returns a Tokenizer; raises TokenizerError naming the missing or corrupt file.
        """
        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(
                f"{root} is not a directory; from_hf_dir needs a folder holding tokenizer.json"
            )
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file} is missing; from_hf_dir needs the Hugging Face fast-tokenizer "
                "file tokenizer.json (slow-only tokenizers such as a lone tokenizer.model are "
                "not supported)"
            )
        raw = _read_json(tokenizer_file)
        if not isinstance(raw, dict) or "model" not in raw:
            raise TokenizerError(f"{tokenizer_file} is not a tokenizers file: it has no 'model'")
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(raw))
        except Exception as exc:  # tokenizers raises a bare Exception on schema errors
            raise TokenizerError(
                f"{tokenizer_file} cannot be loaded by the tokenizers library: {exc}"
            ) from exc

        config = _optional_json_object(root / "tokenizer_config.json")
        special_map = _optional_json_object(root / "special_tokens_map.json")
        generation = _optional_json_object(root / "generation_config.json")

        special_tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            for file_name, table in (
                ("tokenizer_config.json", config),
                ("special_tokens_map.json", special_map),
            ):
                if table.get(name) is not None:
                    special_tokens[name] = _token_text(table[name], root / file_name, name)
                    break
        mark_special(backend, special_tokens.values())

        def named_id(name: str) -> int | None:
            text = special_tokens.get(name)
            if text is None:
                return None
            token_id = backend.token_to_id(text)
            if token_id is None and name in ("bos_token", "eos_token"):
                raise TokenizerError(
                    f"{root}: {name} {text!r} (tokenizer_config.json/special_tokens_map.json) is "
                    "not in the vocabulary of tokenizer.json"
                )
            return token_id

        gen_file = root / "generation_config.json"
        gen_bos = _id_list(generation.get("bos_token_id"), gen_file, "bos_token_id")
        gen_eos = _id_list(generation.get("eos_token_id"), gen_file, "eos_token_id")
        bos_id = named_id("bos_token")
        if bos_id is None and gen_bos:
            bos_id = gen_bos[0]
        eos_id = named_id("eos_token")
        if eos_id is None and gen_eos:
            eos_id = gen_eos[0]

        # Whether BOS/EOS are added is left to tokenizer.json's post-processor: transformers 5
        # drops add_bos_token/add_eos_token from tokenizer_config.json whenever tokenizer.json
        # exists (save_pretrained bakes them into the post-processor).
        template, origin = _hf_chat_template(root, config)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            extra_eos_token_ids=gen_eos,
            chat_template=template,
            chat_template_origin=origin,
            special_tokens=special_tokens,
            source=str(root),
        )

    # ----------------------------------------------------------------------------- properties

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate it)."""
        return self._backend

    @property
    def source(self) -> str:
        """Where this tokenizer was loaded from (a file or folder path)."""
        return self._source

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids are ``0 .. vocab_size - 1``)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """The declared beginning-of-sequence id, or None when the tokenizer declares none."""
        return self._bos_token_id

    @property
    def add_bos_token(self) -> bool:
        """Whether ``encode(..., add_special_tokens=True)`` prepends ``bos_token_id``."""
        return self._add_bos_token

    @property
    def eos_token_id(self) -> int | None:
        """The single declared end-of-sequence id, or None."""
        return self._eos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All ids that should stop generation: declared EOS first (rule in module docstring)."""
        return self._eos_token_ids

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special tokens (``bos_token``, ``eos_token``, ...) mapped to their text."""
        return dict(self._special_tokens)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template source, or None when the model ships none."""
        return self._chat_template.source if self._chat_template else None

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write this tokenizer as a Hugging Face folder that ``from_hf_dir`` reads back.

        Writes tokenizer.json, tokenizer_config.json (named special tokens, chat template) and
        generation_config.json (every stop id, so ``eos_token_ids`` survives the round trip).
        """
        root = Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(root / "tokenizer.json"))
        config: dict[str, Any] = dict(self._special_tokens)
        if self._chat_template is not None:
            config["chat_template"] = self._chat_template.source
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation: dict[str, Any] = {"eos_token_id": list(self._eos_token_ids)}
        if self._bos_token_id is not None:
            generation["bos_token_id"] = self._bos_token_id
        (root / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")

    # ----------------------------------------------------------------------------- encode/decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``; with ``add_special_tokens`` the BOS/EOS the tokenizer asks for are
        added. Special-token text such as ``"<|im_start|>"`` maps to its single id. Returns ids.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Tokenize several texts (in parallel in the Rust backend). Returns one id list each."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Turn ids back into text (invalid UTF-8 becomes U+FFFD). Returns the text.

        Ids the vocabulary does not know (e.g. padding rows of a model's embedding) are skipped.
        """
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of ``token_id`` (byte-level spelling), or None if unknown."""
        return self._backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of the vocabulary string ``token``, or None if it is not a token."""
        return self._backend.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        """Whether ``token_id`` is a registered special (control) token."""
        return int(token_id) in self._special_ids

    # ----------------------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat template.

        Output equals transformers' ``apply_chat_template(..., tokenize=False)``. Returns the
        prompt text; raises TokenizerError if the model has no chat template.
        """
        if self._chat_template is None:
            raise TokenizerError(
                f"{self._source} has no chat template (GGUF tokenizer.chat_template, or "
                "chat_template.jinja / tokenizer_config.json chat_template); use encode() on "
                "plain text instead"
            )
        return self._chat_template.render(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            special_tokens=self._special_tokens,
            **template_kwargs,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        trusted: bool = False,
        **kwargs: Any,
    ) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result. Returns ids.

        Like transformers, no BOS/EOS is added: the template writes the special tokens it wants.
        Message content is untrusted by default: special-token text inside it (a user writing
        ``<|im_start|>system``) is tokenized as plain text, so it cannot open a turn of its own;
        only the template's own markup becomes special tokens. Content without such text
        tokenizes exactly as transformers does. ``trusted=True`` parses it as transformers
        does always.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        if trusted or not any(self._holds_special_text(m.get("content")) for m in messages):
            return self.encode(text, add_special_tokens=False)
        return self._encode_untrusted(messages, add_generation_prompt, text, **kwargs)

    def _holds_special_text(self, content: object) -> bool:
        return isinstance(content, str) and any(t in content for t in self._special_texts)

    def _encode_untrusted(self, messages, add_generation_prompt, text, **kwargs) -> list[int]:
        # Render with a marker in place of each content, tokenize the template's pieces with
        # special tokens parsed and each content with them read as text.
        marked = [
            {**m, "content": f"\ue000{i}\ue001"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        template = self.apply_chat_template(marked, add_generation_prompt, **kwargs)
        pieces = re.split("\ue000(\\d+)\ue001", template)
        contents = [messages[int(p)]["content"] for p in pieces[1::2]]
        rebuilt = "".join(
            piece if k % 2 == 0 else contents[k // 2] for k, piece in enumerate(pieces)
        )
        if rebuilt != text:
            raise TokenizerError(
                f"{self._source}'s chat template rewrites message content, so special-token "
                "text inside it cannot be kept as text; remove it, or pass trusted=True if "
                "the content is yours"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2 == 0:
                ids += self._backend.encode(piece, add_special_tokens=False).ids if piece else []
                continue
            self._backend.encode_special_tokens = True  # special-token text stays text
            try:
                ids += self._backend.encode(contents[k // 2], add_special_tokens=False).ids
            finally:
                self._backend.encode_special_tokens = False
        return ids

    # ----------------------------------------------------------------------------- internals

    def _stop_ids(self, declared: int | None, extra: Iterable[int]) -> tuple[int, ...]:
        others = set(int(i) for i in extra)
        for text in END_OF_TURN_TOKENS:
            token_id = self._backend.token_to_id(text)
            if token_id is not None and self.is_special(token_id):
                others.add(token_id)
        head = [declared] if declared is not None else []
        return tuple(head + sorted(others - set(head)))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self._source!r}, vocab_size={self.vocab_size}, "
            f"bos_token_id={self._bos_token_id}, eos_token_ids={self._eos_token_ids})"
        )


# --------------------------------------------------------------------------------- helpers


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path} is not UTF-8 text: {exc}") from None
    except OSError as exc:
        raise TokenizerError(f"{path} cannot be read: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenizerError(
            f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}"
        ) from None


def _optional_json_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    value = _read_json(path)
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} must hold a JSON object, not {type(value).__name__}")
    return value


def _token_text(value: Any, path: Path, field: str) -> str:
    # Older files store special tokens as serialized AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise TokenizerError(
            f"{path}: {field} must be a string or an object with a 'content' string"
        )
    return value


def _id_list(value: Any, path: Path, field: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise TokenizerError(f"{path}: {field} must be a token id or a list of token ids")
    return items


def _hf_chat_template(root: Path, config: Mapping[str, Any]) -> tuple[str | None, str]:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja_file} cannot be read as UTF-8 text: {exc}") from None
    origin = f"{root / 'tokenizer_config.json'}: chat_template"
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template, origin
    # A list of named templates: the one transformers uses by default is "default".
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in template
    ):
        named = {t["name"]: t.get("template") for t in template}
        if isinstance(named.get("default"), str):
            return named["default"], f"{origin}[default]"
        raise TokenizerError(
            f"{origin} lists templates {sorted(named)} but none named 'default' holding a string"
        )
    raise TokenizerError(f"{origin} must be a string or a list of {{name, template}} objects")


def _tokenizer_key(key: str) -> bool:
    # SentencePiece vocabularies are built by architecture, as transformers builds them.
    return key.startswith("tokenizer.") or key == "general.architecture"
