"""User-facing errors: one line naming the problem and the fix, turned into exit code 2 by the CLI."""


class QuantkitError(Exception):
    """A mistake in the user's input (paths, options, data). The CLI prints `str(err)` and exits 2."""


class StoppedFromOutside(QuantkitError):
    """The run was stopped by something outside it (another process of a multi-process run died): its finished
    work is kept for --resume, as after Ctrl-C."""
