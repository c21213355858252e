"""Chat templates rendered the way Hugging Face ``transformers`` renders them.

Source of the environment settings: ``transformers.utils.chat_template_utils._compile_jinja_template``
(an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, the ``loopcontrols``
extension, the ``{% generation %}`` tag, a ``tojson`` filter that keeps non-ASCII text, and the globals
``raise_exception`` and ``strftime_now``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (including its own ``raise_exception``)."""


class ChatTemplateCompileError(ChatTemplateError):
    """The chat template does not compile: a fault of the model's files, not of any row."""


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, rendered as its body. ``transformers``' ``AssistantTracker``
    also records where the body lies in the text (its ``return_assistant_tokens_mask``), which nothing here uses."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """The ``tojson`` filter as transformers' chat templates have it: ``json.dumps``, non-ASCII text kept
    as is (jinja's own escapes it and HTML characters, ``\\u003c``)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile_error(e: jinja2.exceptions.TemplateError) -> ChatTemplateCompileError:
    return ChatTemplateCompileError(f"the model's chat template does not compile: {e}; fix it in the model's "
                                    "files or set input.apply_chat_template: false")


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` (jinja2) compiled in ``transformers``' environment (module docstring); cached.

    Raises:
        ChatTemplateCompileError: the template does not compile.
    """
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as e:
        raise _compile_error(e) from None


@lru_cache(maxsize=8)
def template_literal_text(source: str) -> str:
    """The text a chat template writes as it is: its raw text between tags and its string constants, joined
    with NUL characters so that no substring spans two of them (``transformers``'
    ``chat_template_utils._get_template_literal_text``, where an added token found in it is a control token).

    Raises:
        ChatTemplateCompileError: the template does not compile.
    """
    try:
        ast = _environment().parse(source)
    except jinja2.exceptions.TemplateError as e:
        raise _compile_error(e) from None
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)}
    return "\0".join(sorted(literals))


# Names a message's reasoning comes under, the one templates read first (transformers' ``_REASONING_FIELDS``).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(messages: list[dict]) -> list[dict]:
    """Messages with a reasoning under any of ``_REASONING_FIELDS`` also given it as ``reasoning_content`` (the
    first non-None of them, so an existing ``reasoning_content`` stands) and, where absent, as ``thinking``
    (gpt-oss templates read that): ``transformers.utils.chat_template_utils._alias_reasoning_fields``."""
    out = []
    for m in messages:
        given = [m.get(k) for k in _REASONING_FIELDS] if isinstance(m, dict) else []
        reasoning = next((v for v in given if v is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def render_chat_template(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **extra,
) -> str:
    """Render ``messages`` (a list of ``{"role", "content"}`` dicts) with a jinja2 chat template.

    ``tools`` and ``documents`` are None unless ``extra`` gives them, as ``transformers``' ``apply_chat_template``
    passes them, so a template's ``tools is not none`` branch is not taken. A message's ``thinking`` or
    ``reasoning`` is given to the template as ``reasoning_content`` too (``_alias_reasoning_fields``).

    Returns the prompt text, special tokens written out as text.

    Raises:
        ChatTemplateCompileError: the template does not compile.
        ChatTemplateError: rendering failed: the template called ``raise_exception`` (on an unsupported role
            order, say) or its code raised any other exception on these messages (a ``TypeError`` of
            ``m.content + 1``), named with its type.
    """
    template = compile_chat_template(source)
    messages = _alias_reasoning_fields(messages)
    try:
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **{"tools": None, "documents": None, **extra},
        )
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template failed: {e}") from None
    except Exception as e:  # the template's own code failed on this data (`m.content + 1`, `x.index(y)`, ...)
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
