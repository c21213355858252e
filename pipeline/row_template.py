"""The environment ``input.template`` is compiled (``jobspec``) and rendered (``inputs``) with."""

from __future__ import annotations

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class NullPrinted(Exception):
    """A template printed a null column value."""


def _finalize(value):
    if value is None:
        raise NullPrinted
    return value


def environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja2 environment (as for chat templates) where a name that is not a column is an error,
    never an empty string (``StrictUndefined``), and printing a null raises ``NullPrinted``."""
    return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                         finalize=_finalize)


def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in ``environment()``, checking every filter and test name it uses.

    jinja2 itself reports an unknown filter or test at compile time only outside conditional code: one inside
    ``{% if %}`` (or a conditional expression) becomes an error when a row reaches it. Here each is checked in
    the whole tree, so such a template fails before any row is read.

    Raises:
        jinja2.TemplateSyntaxError: a syntax error, or (as ``TemplateAssertionError``, jinja2's own wording)
            a filter or test the environment does not define, with its line.
    """
    env = environment()
    tree = env.parse(source)
    for kind, node_type, known in (("filter", nodes.Filter, env.filters), ("test", nodes.Test, env.tests)):
        for node in tree.find_all(node_type):
            if node.name not in known:
                raise jinja2.TemplateAssertionError(f"No {kind} named {node.name!r}.", node.lineno)
    return env.from_string(source)
