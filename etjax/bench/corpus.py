"""The text every etjax workload is built from: gensim's Lee background corpus.

300 Australian news articles (Lee, Pincombe & Welsh, 2005), shipped inside the gensim wheel as
`gensim/test/test_data/lee_background.cor`, one article per line. No download is needed, which
is why the benchmarks and tests use it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from etjax.errors import EtjaxError


def lee_articles() -> list[str]:
    """The 300 news articles of the Lee background corpus, in corpus order."""
    # Found through the import system without importing gensim, which is slow (it loads scipy).
    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise EtjaxError("the Lee corpus ships with gensim: pip install 'etjax[bench]' (or gensim)")
    root = Path(next(iter(spec.submodule_search_locations)))
    text = (root / "test" / "test_data" / "lee_background.cor").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]
