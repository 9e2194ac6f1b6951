"""Rendering Hugging Face chat templates (Jinja) exactly as transformers does, but sandboxed.

Chat templates come from model files, so they are untrusted code: they run in jinja2's
``ImmutableSandboxedEnvironment``, which forbids attribute access to Python internals and
mutation of the objects passed in. The environment is configured like transformers' own
(``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, the ``{% generation %}`` tag, a ``tojson``
filter that does not escape HTML, and the ``raise_exception``/``strftime_now`` globals), so the
rendered text is byte-identical to ``apply_chat_template(..., tokenize=False)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from etjax.errors import RequestError, TokenizerError

# The names a message's reasoning text travels under; templates read the first, older callers
# and gpt-oss templates use the others. transformers copies the value under all of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own ``raise_exception(...)``: the conversation broke its rules."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` and render its body unchanged.

    transformers uses the tag to find assistant tokens for training masks; for inference only
    the text matters, but templates that use the tag must still parse.
    """

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        """Parse the tag's body into a call block that just renders it."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so templates cannot reach dunder slots."""

    # No named `self`, as in jinja2.utils.Namespace: a template may pass `self=...` as a key.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not store underscore-prefixed names on a namespace: {name!r}"
            )


class _DictFactory:
    """``dict(...)`` for templates, without exposing the ``dict`` type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        """Same as ``dict.fromkeys``."""
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson HTML-escapes '<', '>' and '&', which would corrupt tool schemas
    # in the prompt; transformers replaces it with plain json.dumps, and so do we.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


_ENVIRONMENT = _make_environment()


def _plain(value: Any) -> Any:
    """Copy ``value`` into plain JSON-like data, the only kind a template gets to see.

    Rich objects (arrays, images, SDK objects) carry methods the sandbox does not know are unsafe,
    so like transformers we convert Mappings, sequences, dataclasses and pydantic models, keep
    JSON scalars, and replace anything else by a ``"<TypeName>"`` placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        # numpy scalars: np.bool_(False) must stay falsy, not become a truthy placeholder.
        return _plain(item())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Return ``messages`` as plain dicts the way transformers hands them to a template.

    Keys whose value is None are dropped (templates handle a missing key but print "None"), and
    reasoning text is copied under every name in ``_REASONING_FIELDS``. Raises RequestError when
    ``messages`` is not a list of mappings.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RequestError(
            f"chat messages must be a list of dicts with 'role' and 'content', "
            f"got {type(messages).__name__}"
        )
    normalized = []
    for index, message in enumerate(messages):
        if dataclasses.is_dataclass(message) and not isinstance(message, type):
            message = {f.name: getattr(message, f.name) for f in dataclasses.fields(message)}
        elif callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise RequestError(
                f"chat message {index} must be a dict with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        plain = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        normalized.append(plain)
    return normalized


class ChatTemplate:
    """A compiled, sandboxed chat template.

    ``origin`` names where the template came from (a file and field) and is quoted in errors.
    Construction raises TokenizerError when the source is not valid Jinja.
    """

    def __init__(self, source: str, origin: str = "chat_template") -> None:
        if not isinstance(source, str):
            raise TokenizerError(
                f"{origin}: a chat template must be a Jinja string, got {type(source).__name__}"
            )
        self.source = source
        self.origin = origin
        try:
            self._template = _ENVIRONMENT.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"{origin}: the chat template is not valid Jinja (line {exc.lineno}): {exc.message}"
            ) from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text.

        ``special_tokens`` (``bos_token``, ``eos_token``, ...) are visible to the template as
        variables, and ``template_kwargs`` override them, as in transformers. Tools and documents
        must be dicts (JSON schemas). Returns the rendered text.

        Raises RequestError when the template rejects the conversation through
        ``raise_exception`` or the inputs are malformed, TokenizerError when the template itself
        fails.
        """
        chat = normalize_messages(messages)
        for name, value in (("tools", tools), ("documents", documents)):
            if value is not None and not all(isinstance(item, Mapping) for item in value):
                raise RequestError(f"{name} must be a list of dicts (JSON schemas / documents)")
        variables = _plain({**(special_tokens or {}), **template_kwargs})
        try:
            return self._template.render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as exc:
            raise RequestError(
                f"the chat template ({self.origin}) rejected the conversation: {exc}"
            ) from None
        except Exception as exc:  # any failure inside untrusted template code
            raise TokenizerError(
                f"the chat template ({self.origin}) failed to render: {type(exc).__name__}: {exc}"
            ) from exc
