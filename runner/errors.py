"""The one exception type that reaches a user as a single line.

Anything the user can fix (a wrong path, an altered file, a mismatched world size) raises
`AotError`; the command-line wrappers print its message without a traceback and exit non-zero.
Any other exception is a bug in aot and keeps its traceback behind `--debug`.
"""


class AotError(Exception):
    """A problem with the user's input, reported as one line."""

    # The exit status when this error ends a command: 1, except where a command's exit statuses
    # mean something else (`aot diff`, like diff(1): 1 "different", 2 trouble).
    exit_status = 1

    def before_exit(self) -> None:
        """Runs after the line is printed and before the process exits (nothing, unless a subclass
        has to coordinate its exit with other ranks)."""
