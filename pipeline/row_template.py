"""The environment ``input.template`` is compiled (``jobspec``) and rendered (``inputs``) with."""

from __future__ import annotations

import jinja2
import jinja2.meta
import jinja2.tests
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_template import tojson as chat_tojson


class NullPrinted(Exception):
    """A template printed a null value, or used it as text or a number.

    Attributes:
        column: the null column's name, or None for a null inside a column's value (a struct's field, a list's
            item) or one the template computed.
    """

    def __init__(self, column: str | None = None):
        super().__init__(column)
        self.column = column


class NullCell:
    """A row's null cell as the template sees it: it tests as null (falsy, ``is none``, ``== none``,
    ``default(x, true)``) but raises ``NullPrinted`` naming its column when used as text, a number, a
    sequence or a mapping (``str``, ``~``, ``%``, ``join``, ``int``, ``tojson``, ``length``, ``q.attr``, ...),
    where a bare None would silently print "None", "null" or 0."""

    __slots__ = ("column",)

    def __init__(self, column: str):
        self.column = column

    def __bool__(self):
        return False

    def __eq__(self, other):
        return other is None or isinstance(other, NullCell)

    def __ne__(self, other):
        return not self.__eq__(other)

    def __hash__(self):
        return hash(None)

    def __getattr__(self, name):
        if name.startswith("_"):  # jinja and markupsafe probe for these; not the template's data
            raise AttributeError(name)
        raise NullPrinted(self.column)


def _refuse(self, *args):
    raise NullPrinted(self.column)


for _name in ("str repr format html iter len contains getitem int float index complex round abs neg pos invert "
              "add radd sub rsub mul rmul truediv rtruediv floordiv rfloordiv mod rmod pow rpow "
              "lt le gt ge").split():
    setattr(NullCell, f"__{_name}__", _refuse)


def _is_none(value) -> bool:
    return value is None or isinstance(value, NullCell)


def _is_sameas(value, other) -> bool:
    """jinja's ``sameas`` test, a null cell being ``none``."""
    return value is other or (other is None and isinstance(value, NullCell))


def _is_iterable(value) -> bool:
    """jinja's ``iterable`` test (which catches only TypeError from ``iter``): a null cell is not."""
    return not isinstance(value, NullCell) and jinja2.tests.test_iterable(value)


_GLOBALS = ImmutableSandboxedEnvironment().globals  # range is the sandbox's safe_range


def _finalize(value):
    if value is None:  # a null inside a column's value (a null column is a NullCell) or a computed one
        raise NullPrinted
    if callable(value):  # a jinja global (range, dict, ...) or a method: its text names a memory address
        name = getattr(value, "__name__", type(value).__name__)
        hint = next((f" (the jinja global {g!r}: it is read as a column only when the input has a column {g!r})"
                     for g, v in _GLOBALS.items() if v is value), "")
        raise TypeError(f"printed the function {name!r}, not a value{hint}")
    return value


def _tojson(value, **kwargs):
    """The chat templates' ``tojson`` (text as is, not jinja's HTML-safe ``\\u003c``). A null cell printed on its own
    fails its row as ``{{ q }}`` does; inside a list or mapping the template built it is JSON's ``null``."""
    if isinstance(value, NullCell):
        raise NullPrinted(value.column)
    return chat_tojson(_json_nulls(value), **kwargs)


def _json_nulls(value):
    """``value`` with every null cell in its lists, tuples and mappings replaced by None."""
    if isinstance(value, NullCell):
        return None
    if isinstance(value, dict):
        return {k: _json_nulls(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_nulls(v) for v in value]
    return value


def environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja2 environment (as for chat templates, with their ``tojson``) where a name that is not
    a column is an error, never an empty string (``StrictUndefined``), and printing a null (a ``NullCell``, or
    a None) raises ``NullPrinted``."""
    env = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                        finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.tests.update(none=_is_none, sameas=_is_sameas, iterable=_is_iterable)
    return env


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


def renders_empty(source: str) -> bool:
    """``source`` reads no name (column or global) and renders "" (``""``, only a ``{# comment #}``): every
    row's prompt would be empty. False for a template that does not compile (``compile_template`` says why)."""
    env = environment()
    env.globals.clear()  # so find_undeclared_variables lists a global it uses
    try:
        if jinja2.meta.find_undeclared_variables(env.parse(source)):
            return False
        return compile_template(source).render() == ""
    except Exception:  # noqa: BLE001 - a template that raises is reported when rows are rendered
        return False
