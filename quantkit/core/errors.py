"""User-facing errors: one line naming the problem and the fix, turned into exit code 2 by the CLI."""


class QuantkitError(Exception):
    """A mistake in the user's input (paths, options, data). The CLI prints `str(err)` and exits 2."""


class StoppedFromOutside(QuantkitError):
    """The run was stopped by something outside it (another process of a multi-process run died): its finished
    work is kept for --resume, as after Ctrl-C."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (transformers' and gloo's run to paragraphs), or its type's name."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
