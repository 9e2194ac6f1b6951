"""How each byte-level BPE family named by a GGUF file splits text before BPE.

A GGUF vocabulary with ``tokenizer.ggml.model == "gpt2"`` keeps the tokens and merges of the
model's ``tokenizer.json`` but not the pipeline around them: the normalizer, the pre-tokenizer
that cuts text into the pieces BPE runs on, and the BPE option ``ignore_merges``. All three
change ids: Llama 3's " Việt" is one token only because of ``ignore_merges``, and StarCoder's
"½" after a space is one token (not two byte tokens) only because numbers are cut off first.
What the file keeps is ``tokenizer.ggml.pre``, the name llama.cpp's converter chose for the
model's family.

``GGUF_BPE_FAMILIES`` maps each name whose models' ``tokenizer.json`` is known to that pipeline,
component by component as the file declares it, so that ``tokenizers`` runs exactly what the
model's own tokenizer runs. Every other name is refused: splitting it "like GPT-2" or like a
neighbour gives ids the model was not trained on, silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tokenizers import Regex, normalizers, pre_tokenizers

from etjax.errors import TokenizerError

PreTokenizerFactory = Callable[[], pre_tokenizers.PreTokenizer]


@dataclass(frozen=True)
class BpeFamily:
    """The ``tokenizer.json`` pipeline around one family's byte-level BPE model.

    ``pre_tokenizer`` and ``normalizer`` build fresh ``tokenizers`` components (``normalizer``
    None: the family has none). ``ignore_merges``: a pre-token that is itself in the vocabulary
    is emitted whole, before any merge (tiktoken's rule, kept by vocabularies converted from
    tiktoken).
    """

    pre_tokenizer: PreTokenizerFactory
    normalizer: Callable[[], normalizers.Normalizer] | None = None
    ignore_merges: bool = False


def _isolate(pattern: str) -> pre_tokenizers.PreTokenizer:
    # Every Split in these files keeps the matches as pieces of their own ("Isolated").
    return pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    # use_regex=True also applies GPT-2's own split; files with a Split of their own turn it off.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=use_regex)


def _split_then_bytes(*patterns: str) -> PreTokenizerFactory:
    return lambda: pre_tokenizers.Sequence(
        [*(_isolate(p) for p in patterns), _byte_level(use_regex=False)]
    )


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # Every numeric character is a piece of its own, so no merge ever joins digits.
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
    )


def _falcon() -> pre_tokenizers.PreTokenizer:
    # Runs of punctuation first, then GPT-2's split; the digit steps run on the byte-level text,
    # cutting digit runs into groups of three from the left ("3333" -> "333" "3").
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Punctuation(behavior="contiguous"),
            _byte_level(use_regex=True),
            pre_tokenizers.Digits(individual_digits=False),
            _isolate(r"[0-9][0-9][0-9]"),
        ]
    )


# The split patterns, as the families' tokenizer.json files spell them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5 keeps combining marks with their letters.
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken: case-aware words, no contractions, single digits.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM / Coder: cased letters of a fixed Unicode version (not \p{L}: caseless scripts such
# as CJK, Arabic or Devanagari are left to later steps), ASCII and full-width punctuation, and
# CJK/Hangul runs; the class ranges are the files' own.
_DEEPSEEK_CASED_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_PUNCTUATION = "!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002"
_DEEPSEEK_CJK = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff"
# DeepSeek V3: up to three digits, CJK ideographs and kana, then a Llama-3-like split in which a
# word may start with one ASCII punctuation mark.
_DEEPSEEK_V3_KANJI_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_V3_SPLIT = (
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _deepseek(*patterns: str) -> PreTokenizerFactory:
    # The DeepSeek LLM/Coder splits, then single digits, then bytes.
    return lambda: pre_tokenizers.Sequence(
        [
            *(_isolate(p) for p in patterns),
            pre_tokenizers.Digits(individual_digits=True),
            _byte_level(use_regex=False),
        ]
    )


_GPT2 = BpeFamily(lambda: _byte_level(use_regex=True))
# GPT-NeoX's tokenizer (Pythia, MPT, OLMo 1): NFC, then GPT-2's split. Its runs of spaces are added
# tokens, which the GGUF file carries as user-defined tokens.
_GPT_NEOX = BpeFamily(lambda: _byte_level(use_regex=True), normalizers.NFC)
_FALCON = BpeFamily(_falcon)  # Falcon 7B/40B/180B
_DIGITS_GPT2 = BpeFamily(_digits_then_gpt2)  # StarCoder 2, Refact, SmolLM
_COMMAND_R = BpeFamily(_digits_then_gpt2, normalizers.NFC)
# Llama 3, GLM-4 and Mistral's tekken come from tiktoken vocabularies, and their tokenizer.json
# files keep tiktoken's rule (ignore_merges). Smaug-Llama-3 has Llama 3's vocabulary in a file
# without it (llama.cpp, which gave it a name of its own, splits it the same way).
_LLAMA3 = BpeFamily(_split_then_bytes(_LLAMA3_SPLIT), ignore_merges=True)
_SMAUG = BpeFamily(_split_then_bytes(_LLAMA3_SPLIT))
_TEKKEN = BpeFamily(_split_then_bytes(_TEKKEN_SPLIT), ignore_merges=True)
# Qwen 1.5/2/2.5/3 and DeepSeek-R1-Distill-Qwen; Qwen 3.5.
_QWEN2 = BpeFamily(_split_then_bytes(_QWEN2_SPLIT), normalizers.NFC)
_QWEN35 = BpeFamily(_split_then_bytes(_QWEN35_SPLIT), normalizers.NFC)
# DeepSeek LLM (and V2), DeepSeek Coder, DeepSeek V3 (and R1).
_DEEPSEEK_LLM = BpeFamily(
    _deepseek(
        r"[\r\n]",
        rf"\s?[{_DEEPSEEK_CASED_LETTERS}]+",
        rf"\s?[{_DEEPSEEK_PUNCTUATION}]+",
        r"\s+$",
        f"[{_DEEPSEEK_CJK}]+",
    )
)
_DEEPSEEK_CODER = BpeFamily(_deepseek(r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_DEEPSEEK_CJK}]+"))
_DEEPSEEK_V3 = BpeFamily(
    _split_then_bytes(r"\p{N}{1,3}", _DEEPSEEK_V3_KANJI_KANA, _DEEPSEEK_V3_SPLIT)
)

# tokenizer.ggml.pre -> family. The names are llama.cpp's; one family can have several.
GGUF_BPE_FAMILIES: Mapping[str, BpeFamily] = {
    "gpt-2": _GPT2,
    "mpt": _GPT_NEOX,
    "olmo": _GPT_NEOX,
    "falcon": _FALCON,
    "starcoder": _DIGITS_GPT2,
    "refact": _DIGITS_GPT2,
    "smollm": _DIGITS_GPT2,
    "command-r": _COMMAND_R,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "smaug-bpe": _SMAUG,
    "chatglm-bpe": _LLAMA3,
    "glm4": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": _QWEN35,
    "tekken": _TEKKEN,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "deepseek-v3": _DEEPSEEK_V3,
}


def gguf_bpe_family(pre: object, source: str) -> BpeFamily:
    """The family a GGUF file's ``tokenizer.ggml.pre`` value names.

    ``source`` names the file in errors. Raises TokenizerError for a missing value or one this
    table does not reproduce exactly, naming the supported values.
    """
    supported = ", ".join(sorted(GGUF_BPE_FAMILIES))
    if pre is None:
        raise TokenizerError(
            f"{source}: GGUF metadata has no tokenizer.ggml.pre field, so the pre-tokenizer of "
            f"this byte-level BPE vocabulary is unknown (convert the model again with a current "
            f"llama.cpp); supported values: {supported}"
        )
    family = GGUF_BPE_FAMILIES.get(pre) if isinstance(pre, str) else None
    if family is None:
        raise TokenizerError(
            f"{source}: tokenizer.ggml.pre is {pre!r}, a pre-tokenizer etjax does not reproduce "
            f"exactly (its ids would differ from the model's own tokenizer); supported values: "
            f"{supported}"
        )
    return family
