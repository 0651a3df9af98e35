"""Rendering chat templates (Jinja, as shipped in tokenizer_config.json / GGUF metadata).

``render_chat`` renders a template the way Hugging Face's ``apply_chat_template(...,
tokenize=False)`` does: an immutable sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape,
and the ``raise_exception`` / ``strftime_now`` helpers. Chat templates are untrusted code: they
only ever see plain JSON-like data.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from collections.abc import Mapping
from datetime import datetime
from typing import Any

__all__ = ["render_chat", "compile_chat_template", "ChatTemplateError"]


try:  # jinja2 is a runtime dependency; the import error is raised on use, with a hint
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError:  # pragma: no cover
    jinja2 = None


if jinja2 is not None:
    ChatTemplateError = jinja2.exceptions.TemplateError

    class _GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    class _Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore-prefixed attributes."""

        def __init__(*args, **kwargs):  # same signature trick as jinja2.utils.Namespace
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed namespace attributes ({name!r})"
                )
else:  # pragma: no cover
    ChatTemplateError = Exception


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes (<, >, &, '): chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str):
    """The compiled ``jinja2.Template`` for a chat template string (cached)."""
    if jinja2 is None:  # pragma: no cover
        raise ImportError("render_chat needs jinja2: pip install 'jinja2>=3.1'")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = dict
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Deep copy of ``value`` made of plain JSON-like Python types only."""
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
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _plain(value.item())
    if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def load_chat_template(value: str, field: str = "chat_template") -> str:
    """A chat template given as a file path or as the template itself (vLLM's
    --chat-template), compiled once to check it; ValueError naming `field` otherwise."""
    path = pathlib.Path(value) if len(value) < 4096 and "\n" not in value else None
    if path is not None and path.is_file():
        value = path.read_text(encoding="utf-8")
    elif "{{" not in value and "{%" not in value:
        raise ValueError(f"{field}: {value!r} is neither a file nor a Jinja chat template")
    try:
        compile_chat_template(value)
    except jinja2.TemplateError as e:
        raise ValueError(f"{field}: the template does not compile: {e}") from None
    return value


def content_text(content: Any, field: str = "content") -> str:
    """A chat message's content as one string: a string, None (empty), or OpenAI's list of
    parts, of which only text parts (joined by newlines, as vLLM joins them); anything else
    raises ValueError naming `field`."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{field}: must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{field}[{k}]: only text parts are supported (a text-only model), "
                             f"got {kind if kind is not None else part!r}")
        texts.append(part["text"])
    return "\n".join(texts)


def render_chat(
    template: str,
    messages,
    add_generation_prompt: bool = True,
    *,
    tools=None,
    documents=None,
    **special: Any,
) -> str:
    """Render ``messages`` (a list of ``{"role": ..., "content": ...}`` dicts) with ``template``.

    ``special`` holds the extra template variables HF passes (``bos_token``, ``eos_token``, ...,
    or any template-specific switch). Errors raised by the template (``raise_exception``) come out
    as ``jinja2.TemplateError`` (``ChatTemplateError``).
    """
    if not isinstance(template, str) or not template:
        raise ValueError("render_chat needs a non-empty chat template string")
    if hasattr(messages, "messages"):
        messages = messages.messages
    messages = _plain(list(messages))
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, got {m!r}")
    compiled = compile_chat_template(template)
    return compiled.render(
        messages=messages,
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(special),
    )
