"""How close generated texts are to reference texts: ROUGE-L (Google's `rouge-score`) and
corpus BLEU (`sacrebleu`), the reference implementations, so figures compare with published
ones. Both are extras: pip install 'etjax[bench]'.
"""

from __future__ import annotations

from collections.abc import Sequence

from etjax.errors import EtjaxError


def rouge_l(candidates: Sequence[str], references: Sequence[str]) -> list[float]:
    """ROUGE-L F-measure of each candidate against its reference, in [0, 1]."""
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise EtjaxError("ROUGE needs rouge-score: pip install 'etjax[bench]'") from None
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    # rouge-score keeps only Latin letters and digits: an output of other characters has no
    # tokens and would score 0 even against itself. An identical pair is a perfect match.
    return [
        1.0 if cand == ref else scorer.score(ref, cand)["rougeL"].fmeasure
        for cand, ref in zip(candidates, references, strict=True)
    ]


def corpus_bleu(candidates: Sequence[str], references: Sequence[str]) -> float:
    """sacrebleu's corpus BLEU of the candidates against their references, in [0, 100]."""
    try:
        import sacrebleu
    except ImportError:
        raise EtjaxError("BLEU needs sacrebleu: pip install 'etjax[bench]'") from None
    return float(sacrebleu.corpus_bleu(list(candidates), [list(references)]).score)
