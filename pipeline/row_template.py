"""The environment ``input.template`` is compiled (``jobspec``) and rendered (``inputs``) with."""

from __future__ import annotations

import jinja2
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
