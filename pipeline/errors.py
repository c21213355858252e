"""The errors the layers share: ``JobSpecError`` (the job is wrong) and ``RowError`` (one row is; the job goes on)."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s message (stripped), or its class name when the message is empty: an exception
    from a library shown in a one-line error."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


class RowError(Exception):
    """This row cannot be generated: the message goes into the row's ``error`` column and the job goes on.

    Raised for what is wrong with one row's data (a null prompt, malformed messages, a prompt longer than
    the model's context, ...). Anything else raised while generating (a ``ValueError`` from MLX, a bug)
    is not a ``RowError`` and stops the run.
    """


class JobSpecError(ValueError):
    """The job is invalid: its file, or a setting the loaded model or the machine refutes (such as a batch
    whose KV cache does not fit); ``pipeline.jobspec`` checks the file.

    Attributes:
        problems: one line per problem, each naming its key path (``str(error)`` joins them with newlines).
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
