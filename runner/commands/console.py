"""Command-line error handling shared by `aot` and `python -m runner`.

User errors (AotError) print one line and exit 1 (or the error's `exit_status`); click's usage
errors exit 2; anything else is a bug and prints one line too, with its traceback only under
--debug (or AOT_DEBUG=1). A crash in native code (a segfault in a compiled package or a kernel)
prints the Python stack it happened under (faulthandler) before the process dies, so a dead rank
says where.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import click

from runner.errors import AotError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERNAL = 1, 2, 3


def _rank_prefix() -> str:
    world = os.environ.get("WORLD_SIZE")
    return f"[rank {os.environ.get('RANK', '?')}] " if world and world != "1" else ""


def console_main(cli: click.Command, prog_name: str, argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("AOT_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    if not faulthandler.is_enabled():
        faulthandler.enable()
    try:
        cli.main(args=argv, prog_name=prog_name, standalone_mode=False)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(EXIT_ERROR)
    except AotError as e:
        if debug:
            raise
        click.echo(f"{prog_name}: error: {_rank_prefix()}{e}", err=True)
        e.before_exit()
        sys.exit(e.exit_status)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if debug:
            raise
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        click.echo(f"{prog_name}: internal error: {_rank_prefix()}{type(e).__name__}: {message} (rerun with --debug for the traceback)", err=True)
        sys.exit(EXIT_INTERNAL)


debug_option = click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    help="Show Python tracebacks instead of one-line errors (also AOT_DEBUG=1).",
)
