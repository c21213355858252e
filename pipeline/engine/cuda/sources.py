"""The fused step's CUDA text: the files under ``kernels/`` (package data), read and filled in per shape.

Each file holds sections: a section starts after a line ``//@ name`` and runs up to the line break
before the next such line, or to the end of the file; lines before the first marker are comments for
the reader. A section's ``$name`` / ``${name}`` placeholders (``string.Template``) are filled in by the
host code with shapes, constants and other sections; the result is the exact ``source`` or ``header``
text given to ``mx.fast.cuda_kernel``.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from string import Template

_MARKER = re.compile(r"(?:^|\n)//@ (\w+)\n")


@functools.cache
def _sections(file: str) -> dict[str, str]:
    text = (resources.files(__package__) / "kernels" / file).read_text(encoding="utf-8")
    parts = _MARKER.split(text)
    return dict(zip(parts[1::2], parts[2::2]))


def header() -> str:
    """The device helpers every kernel is compiled with (``kernels/common.cuh``), verbatim: the
    ``header`` argument of ``mx.fast.cuda_kernel``."""
    return _sections("common.cuh")["header"]


def fill(file: str, section: str, **values) -> str:
    """Section ``section`` of ``kernels/<file>`` with each ``$name`` replaced by ``str(values[name])``.

    Raises:
        KeyError: no such section, or a placeholder without a value.
        FileNotFoundError: no such file (the package was installed without its data files).
    """
    return Template(_sections(file)[section]).substitute(values)


def float_literal(x: float) -> str:
    """``x`` as a CUDA float literal: Python's shortest round-tripping ``repr`` of it, suffix ``f``."""
    return repr(float(x)) + "f"
