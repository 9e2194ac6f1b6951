"""Hypothesis strategies for JSON schemas of the shape extraction jobs ask for: an object of
one to three required fields, each a bounded string, a bounded integer, a boolean or an enum
(two of whose words share a prefix, so a value is not always forced by its first letters)."""

from __future__ import annotations

from hypothesis import strategies as st

NAMES = st.sampled_from(["id", "name", "city", "kind", "score", "tags"])
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 8)),
    st.builds(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 50}, st.integers(0, 9)),
    st.just({"type": "boolean"}),
    st.builds(
        lambda words: {"enum": sorted(words)},
        st.sets(st.sampled_from(["red", "green", "blue", "reddish"]), min_size=1, max_size=3),
    ),
)
SCHEMAS = st.builds(
    lambda fields: {
        "type": "object",
        "properties": dict(fields),
        "required": [name for name, _ in fields],
        "additionalProperties": False,
    },
    st.lists(st.tuples(NAMES, LEAVES), min_size=1, max_size=3, unique_by=lambda f: f[0]),
)
