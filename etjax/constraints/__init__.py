"""Constrained output: a request's JSON schema, regex, choices or grammar as an llguidance
grammar (grammar.py), and the host-side matchers whose masks the device step applies
(matcher.py; the device side is etjax/runtime/token_mask.py)."""
