"""Every byte-level BPE family a GGUF file may name tokenizes exactly as its own tokenizer.json.

No real vocabulary of these families reaches the test machine, so each is rebuilt in miniature
with the ``tokenizers`` library: the family's pipeline as its tokenizer.json declares it
(normalizer, pre-tokenizer, ``ignore_merges``; written out below, apart from etjax's table), a
BPE trained on the Lee corpus and multilingual text so that the merges are real, a few entries no
merge reaches (as vocabularies converted from tiktoken have), and special and user-defined added
tokens. That ``tokenizers.Tokenizer`` is the truth. It is written to a GGUF file the way
llama.cpp's converter writes one, read back with ``Tokenizer.from_gguf``, and the two must give
identical ids on hard strings and on the Lee articles.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import AddedToken, pre_tokenizers
from tokenizers.trainers import BpeTrainer

from etjax.bench.corpus import lee_articles
from etjax.errors import TokenizerError
from etjax.tokenizer import Tokenizer
from etjax.tokenizer.gguf_bpe import GGUF_BPE_FAMILIES

# ------------------------------------------------------------------ the families' tokenizer.json


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _byte_level(use_regex: bool) -> dict:
    return {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": use_regex,
    }


def _digits(individual: bool) -> dict:
    return {"type": "Digits", "individual_digits": individual}


def _sequence(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


def _char_class(ranges: list[tuple[int, int]]) -> str:
    return "".join(chr(lo) if lo == hi else f"{chr(lo)}-{chr(hi)}" for lo, hi in ranges)


_NFC = {"type": "NFC"}
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letter class: the cased letters (Lu, Ll, Lt) of these code point ranges.
_DEEPSEEK_LETTERS = _char_class(
    [
        (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
        (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
        (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
        (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
        (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
        (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A),
        (0x1E00, 0x1F15), (0x1F18, 0x1F1D), (0x1F20, 0x1F45), (0x1F48, 0x1F4D),
        (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
        (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
        (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB),
        (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
        (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D),
        (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128), (0x212A, 0x212D),
        (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
        (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4),
        (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B),
        (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
        (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A),
        (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2),
        (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
    ]
)  # fmt: skip
_DEEPSEEK_PUNCT = _char_class(
    [
        (0x21, 0x2F),
        (0x3A, 0x7E),
        (0xFF01, 0xFF0F),
        (0xFF1A, 0xFF5E),
        (0x2018, 0x201F),
        (0x3000, 0x3002),
    ]
)
_DEEPSEEK_CJK = _char_class([(0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF)])
_DEEPSEEK_V3_CJK = _char_class([(0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF)])
_DEEPSEEK_V3_WORDS = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
)
# GPT-NeoX's added tokens for runs of 2..24 spaces (normalized, not special).
_NEOX_SPACES = [" " * n for n in range(24, 1, -1)]


@dataclass(frozen=True, eq=False)  # compared by identity: one truth tokenizer each
class Family:
    """A family's tokenizer.json pieces (JSON as the file has them) and its own added tokens."""

    pre_tokenizer: dict
    normalizer: dict | None = None
    ignore_merges: bool = False
    added: tuple[str, ...] = ()


GPT2 = Family(_byte_level(True))
NEOX = Family(_byte_level(True), _NFC, added=tuple(_NEOX_SPACES))
FALCON = Family(
    _sequence(
        {"type": "Punctuation", "behavior": "Contiguous"},
        _byte_level(True),
        _digits(False),
        _split("[0-9][0-9][0-9]"),
    )
)
STARCODER = Family(_sequence(_digits(True), _byte_level(True)))
COMMAND_R = Family(_sequence(_digits(True), _byte_level(True)), _NFC)
LLAMA3 = Family(_sequence(_split(_LLAMA3), _byte_level(False)), ignore_merges=True)
SMAUG = Family(_sequence(_split(_LLAMA3), _byte_level(False)))
QWEN2 = Family(_sequence(_split(_QWEN2), _byte_level(False)), _NFC)
QWEN35 = Family(_sequence(_split(_QWEN35), _byte_level(False)), _NFC)
TEKKEN = Family(_sequence(_split(_TEKKEN), _byte_level(False)), ignore_merges=True)
DEEPSEEK_LLM = Family(
    _sequence(
        _split("[\r\n]"),
        _split(f"\\s?[{_DEEPSEEK_LETTERS}]+"),
        _split(f"\\s?[{_DEEPSEEK_PUNCT}]+"),
        _split("\\s+$"),
        _split(f"[{_DEEPSEEK_CJK}]+"),
        _digits(True),
        _byte_level(False),
    )
)
DEEPSEEK_CODER = Family(
    _sequence(
        _split("[\r\n]"),
        _split("\\s?\\p{L}+"),
        _split("\\s?\\p{P}+"),
        _split(f"[{_DEEPSEEK_CJK}]+"),
        _digits(True),
        _byte_level(False),
    )
)
DEEPSEEK_V3 = Family(
    _sequence(
        _split("\\p{N}{1,3}"),
        _split(f"[{_DEEPSEEK_V3_CJK}]+"),
        _split(_DEEPSEEK_V3_WORDS),
        _byte_level(False),
    )
)

# Each name the loader accepts, with the tokenizer.json of the models llama.cpp gives it.
TRUTH: dict[str, Family] = {
    "gpt-2": GPT2,
    "mpt": NEOX,
    "olmo": NEOX,
    "falcon": FALCON,
    "starcoder": STARCODER,
    "refact": STARCODER,
    "smollm": STARCODER,
    "command-r": COMMAND_R,
    "llama-bpe": LLAMA3,
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "chatglm-bpe": LLAMA3,
    "glm4": LLAMA3,
    "smaug-bpe": SMAUG,
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "qwen35": QWEN35,
    "tekken": TEKKEN,
    "deepseek-llm": DEEPSEEK_LLM,
    "deepseek-coder": DEEPSEEK_CODER,
    "deepseek-v3": DEEPSEEK_V3,
}

# llama.cpp names (and other values) whose ids etjax would not reproduce exactly.
REFUSED = [
    "default", "dbrx", "gpt-4o", "llama4", "falcon3", "falcon-h1", "pixtral", "bloom", "phi-2",
    "stablelm2", "jina-v2-es", "kimi-k2", "minimax-m2", "exaone", "codeshell", "poro-chat",
    "megrez", "kormo", "lfm2", "", "LLAMA-BPE", "gpt2",
]  # fmt: skip

# ------------------------------------------------------------------ text

HARD_STRINGS = [
    "Tiếng Việt là ngôn ngữ chính thức của Việt Nam.",
    " Việt",
    "Việt Nam",
    "Huế và Đà Nẵng, Huế",
    " Huế",
    "東京都に住む 4444 Hello, Привет!",
    "中文文本，简体与繁體。我想在apple工作1314151天～",
    "日本語のテキスト、カタカナとひらがな。東京は晴れ。",
    "مرحبا بالعالم، هذا نص عربي ١٢٣",
    "नमस्ते दुनिया, यह हिंदी पाठ है १२३४",
    "Привет, мир! Это русский текст на Български.",
    "Ελληνικά: Καλημέρα κόσμε ΑΒΓ",
    "한국어 텍스트 안녕하세요",
    "0 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 12345678901",
    "3333 33333 333333 3.3 3..3 3...3 1,000,000 2024-06-01 v1.2.3 x²y ¹ ³",
    "digits glued: abc123def 42nd 7a 0x1F",
    "  Hello",
    "   Hello  world   ",
    "\tHello\t\tworld\t",
    "\n =",
    "line one\n\nline two\n\n\nline three\r\n\r\nend\n",
    " \n \n\n \t \t\t \t\n  \n   \n    \n",
    "trailing spaces   ",
    "    indented code():\n        return x ** 2  # comment\n",
    "😀 🤗🎉 👩‍👩‍👧‍👦 🇯🇵 ❤️ 👍🏽 😶‍🌫️ 🦙🦙",
    "Mixed 日本 emoji🤗and ASCII, Việt 123 ½",
    "I'm you're we've they'll he'd it's DON'T We'Ve a'lL 'RE 'M 'D",
    " ½",
    "½ ¼ ¾ 4½ months, ⅓ cup and a ⅓",
    "Latin-1: © ® ° ± × ÷ ¿ ¡ § ¶ · « » µ ß ÿ £ ¥ ¢ ¤ ¦ ¨ ª ¬ ¯ ´ ¸ º",
    "Accents: café, naïve, Zürich, São Paulo, façade, Ångström, ñandú",
    "Combining: e\u0301 a\u0308 n\u0303 x\u0301 \u212b Å",
    "------======= ''''''```````\"\"\"\"......!!!!!!??????",
    "punctuation!!! (parens) [brackets] {braces} <angle> a/b/c path\\to\\file",
    "symbols: x+=1; a$b ^c|d~e `f` 5%+3 <=> a->b #tag @user",
    "full-width ＡＢＣ ａｂｃ ！？（） “quotes” ‘single’ 　ideographic space。",
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    "<｜begin▁of▁sentence｜>Hello<think>x</think>",
    "almost special: <|im_start |> <im_start|> <｜begin",
    "control chars: \x00\x01\x7f NBSP\u00a0ZWSP\u200b",
    "",
]

# Multilingual training text (merges in every script of the hard strings), plus the corpus.
_MULTILINGUAL = [
    "Tiếng Việt là ngôn ngữ của người Việt. Người Việt Nam nói tiếng Việt.",
    "我想在北京工作。中文是世界上使用人数最多的语言之一。你好世界，今天天气很好。",
    "日本語は日本の言語です。東京は日本の首都です。ひらがなとカタカナを使います。",
    "العربية لغة سامية. مرحبا بالعالم، كيف حالك اليوم؟",
    "हिन्दी भारत की एक भाषा है। नमस्ते दुनिया, आप कैसे हैं?",
    "Русский язык — один из восточнославянских языков. Привет, мир! Български език.",
    "Η ελληνική γλώσσα είναι ινδοευρωπαϊκή. Καλημέρα κόσμε.",
    "한국어는 한국의 공용어입니다. 안녕하세요, 세계.",
    "def main():\n    for i in range(10):\n        print(i)\n\n\n"
    "if __name__ == '__main__':\n    main()\n",
    "Numbers: 1 22 333 4444 55555 2024 1999 3.14159 1,000,000 ½ ¼ ¾ 100%",
    "Emoji 😀😀 🤗 🎉🎉 👍🏽 ❤️ 🇯🇵 and text\n\n\tTabs\tand  spaces   here",
    "x+=1; y-=2; a$b ^c|d~e `f` <=> a->b #tag @user I'm you're DON'T we'Ve 'RE",
]

# Vocabulary entries no merge reaches (none is in the training text): a pre-token that spells one
# is a single token only under ignore_merges, as Llama 3's " Việt" is.
_UNREACHED = [" Huế", "Huế", " Nẵng", "東京都", "⅓", " ⅓", "4444", " Привет", "Hello", " Hello"]
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<｜begin▁of▁sentence｜>"]
_USER_DEFINED = ["<think>", "</think>"]


def _spell(text: str) -> str:
    # The byte-level vocabulary spelling of text (tokenizers' own byte alphabet).
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return byte_level.pre_tokenize_str(text)[0][0]


@pytest.fixture(scope="module")
def articles() -> list[str]:
    return lee_articles()


@pytest.fixture(scope="module")
def trained(articles: list[str]) -> dict:
    """A tokenizer.json trained on the corpus, whose vocabulary and merges every family shares.

    It is trained on coarse pieces (a word with the whitespace before it, or a run of
    whitespace), so its merges cross every boundary some family's pre-tokenizer draws (digit
    groups, punctuation, scripts, combining marks, a space before a symbol): the family's
    pipeline decides which merges apply, and a pipeline rebuilt wrong shows in the ids. The
    entries of ``_UNREACHED`` are appended after training.
    """
    coarse = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": _sequence(_split(r"\s?\S+|\s+"), _byte_level(False)),
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    tok = tokenizers.Tokenizer.from_str(json.dumps(coarse))
    trainer = BpeTrainer(
        vocab_size=3000,
        special_tokens=_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(articles + _MULTILINGUAL * 30, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for text in _UNREACHED:
        assert _spell(text) not in vocab, f"{text!r} was learned; pick an unseen text"
        vocab[_spell(text)] = len(vocab)
    return data


@pytest.fixture(scope="module")
def truths(trained: dict) -> dict[Family, tokenizers.Tokenizer]:
    return {family: _family_tokenizer(family, trained) for family in set(TRUTH.values())}


def _family_tokenizer(family: Family, trained: dict) -> tokenizers.Tokenizer:
    """The family's tokenizer: its pipeline around the shared BPE, and its added tokens."""
    data = {
        **trained,
        "normalizer": family.normalizer,
        "pre_tokenizer": family.pre_tokenizer,
        "model": {**trained["model"], "ignore_merges": family.ignore_merges},
    }
    truth = tokenizers.Tokenizer.from_str(json.dumps(data))
    truth.add_tokens([AddedToken(t, normalized=False, special=False) for t in _USER_DEFINED])
    truth.add_tokens([AddedToken(t, normalized=True, special=False) for t in family.added])
    if family is GPT2:
        # An added token spelled in the byte alphabet ("Ġthe"): llama.cpp's converter writes it
        # decoded (" the"), and etjax must still read it as the vocabulary entry it is.
        assert _spell(" the") in data["model"]["vocab"]
        truth.add_tokens([AddedToken(_spell(" the"), normalized=False, special=False)])
    return truth


# ------------------------------------------------------------------ GGUF, as llama.cpp writes it


def _write_gguf(truth: tokenizers.Tokenizer, pre: str, path: Path) -> None:
    """Write truth's vocabulary as convert_hf_to_gguf.py does for a byte-level BPE model."""
    by_id = {i: text for text, i in truth.get_vocab(with_added_tokens=True).items()}
    added = truth.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(len(by_id)):
        text = by_id[i]
        if i not in added:
            types.append(gguf.TokenType.NORMAL)
        else:
            if not added[i].normalized:  # the converter stores what decode gives back
                ids = truth.encode(text, add_special_tokens=False).ids
                text = truth.decode(ids, skip_special_tokens=False)
            looks_special = text.startswith(("<|", "<｜")) and text.endswith(("|>", "｜>"))
            special = added[i].special or looks_special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        tokens.append(text)
    merges = [" ".join(pair) for pair in json.loads(truth.to_str())["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(truth.token_to_id("<|im_start|>"))
    writer.add_eos_token_id(truth.token_to_id("<|endoftext|>"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _from_gguf(truth: tokenizers.Tokenizer, pre: str, tmp_path: Path) -> Tokenizer:
    path = tmp_path / f"{pre}.gguf"
    _write_gguf(truth, pre, path)
    return Tokenizer.from_gguf(path)


# ------------------------------------------------------------------ tests


def test_every_accepted_name_is_tested() -> None:
    assert set(GGUF_BPE_FAMILIES) == set(TRUTH)


@pytest.mark.parametrize("pre", sorted(TRUTH))
def test_ids_match_the_family_tokenizer(pre: str, truths, articles, tmp_path: Path) -> None:
    truth = truths[TRUTH[pre]]
    ours = _from_gguf(truth, pre, tmp_path)
    for text in HARD_STRINGS:
        ids = truth.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == ids, repr(text)
        assert ours.decode(ids) == truth.decode(ids, skip_special_tokens=False), repr(text)
    expected = [e.ids for e in truth.encode_batch(articles, add_special_tokens=False)]
    assert ours.encode_batch(articles, add_special_tokens=False) == expected
    for text in _SPECIALS:
        assert ours.is_special(ours.token_to_id(text))


def test_llama3_keeps_vocabulary_pre_tokens_whole(truths, tmp_path: Path) -> None:
    ours = _from_gguf(truths[LLAMA3], "llama-bpe", tmp_path)
    assert ours.encode(" Huế", add_special_tokens=False) == [ours.token_to_id(_spell(" Huế"))]
    smaug = _from_gguf(truths[SMAUG], "smaug-bpe", tmp_path)
    assert len(smaug.encode(" Huế", add_special_tokens=False)) > 1


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tok.backend.pre_tokenizer.pre_tokenize_str(text)]


def test_falcon_cuts_digit_runs_in_threes(truths, tmp_path: Path) -> None:
    ours = _from_gguf(truths[FALCON], "falcon", tmp_path)
    assert _pieces(ours, "3333") == ["333", "3"]
    assert _pieces(ours, "\n =") == [_spell("\n "), "="]


def test_digit_families_cut_numbers_from_spaces(truths, tmp_path: Path) -> None:
    for pre in ("starcoder", "smollm", "command-r", "deepseek-llm", "deepseek-coder"):
        ours = _from_gguf(truths[TRUTH[pre]], pre, tmp_path)
        assert _pieces(ours, " ½") == [_spell(" "), _spell("½")], pre


def test_neox_runs_of_spaces_are_tokens(truths, tmp_path: Path) -> None:
    ours = _from_gguf(truths[NEOX], "mpt", tmp_path)
    ids = ours.encode("  Hello", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("  ") and ours.decode(ids[1:]) == "Hello"
    assert not ours.is_special(ids[0])


@pytest.mark.parametrize("pre", [*REFUSED, 3, None])
def test_unknown_pre_tokenizers_are_refused_by_name(pre) -> None:
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<|endoftext|>"]
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3],
        "tokenizer.ggml.merges": [],
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    expected = "no tokenizer.ggml.pre" if pre is None else f"tokenizer.ggml.pre is {pre!r}"
    with pytest.raises(
        TokenizerError, match=rf"x\.gguf: .*{re.escape(expected)}.*supported values: chatglm-bpe, "
    ):
        Tokenizer.from_gguf_metadata(metadata, source="x.gguf")
