"""aot reports user errors through the runner's exception type, so one handler serves both."""

from runner.errors import AotError

__all__ = ["AotError"]
