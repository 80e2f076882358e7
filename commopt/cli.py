"""The `commopt` command line: `commopt launch | bench | doctor | tune | simulate | demo`.

Each subcommand lives in its own module under commopt/commands/ and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``. Modules are
imported only when their subcommand runs, so optional dependencies stay optional.

    $ commopt launch -n 2 -- python -c "import commopt; print(commopt.create_communicator('mpi').rank)"
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under commopt.commands; order is the order shown in --help.
SUBCOMMANDS = {
    "launch": "launch",
    "bench": "bench",
    "doctor": "doctor",
    "tune": "tune",
    "simulate": "simulate",
    "demo": "demo",
}


def _load(name: str):
    try:
        return importlib.import_module(f"commopt.commands.{SUBCOMMANDS[name]}")
    except ModuleNotFoundError as exc:
        if exc.name == f"commopt.commands.{SUBCOMMANDS[name]}":
            return None  # not part of this build
        raise


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one (its module alone is imported)."""
    parser = argparse.ArgumentParser(prog="commopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS if only is None else [only]:
        module = _load(name)
        if module is None:
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(command_module=module)
    return parser


def entry() -> None:
    """The process's entry point (the ``commopt`` script, ``python -m commopt``): ``main()``
    on ``sys.argv``, its result the exit status; ``commopt launch``'s status is decided when
    its job has stopped (``commands.signals.exit_status``: Ctrl-C gives 130, never the
    interpreter's own death by SIGINT)."""
    if sys.argv[1:2] == ["launch"]:
        from commopt.commands.signals import exit_status

        raise SystemExit(exit_status(main))  # (main() installs the launcher's handlers)
    raise SystemExit(main())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["launch"]:
        # Before anything slow is imported: a Ctrl-C or SIGTERM during start-up must stop
        # the launch like one that comes later, never be lost.
        from commopt.commands.signals import install_signal_handlers

        install_signal_handlers()
    parser = build_parser(argv[0] if argv[:1] and argv[0] in SUBCOMMANDS else None)
    # Everything after the first `--` is the command `commopt launch` runs, untouched.
    head, tail = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None)
    )
    args, rest = parser.parse_known_args(head)
    if not getattr(args, "command_module", None):
        parser.print_help()
        return 2
    sub = _subparser(parser, args.command)
    unknown = [a for a in rest if a.startswith("-") and a != "-"]
    if unknown or (rest and not hasattr(args, "command_args")):
        sub.error(_unknown_message(sub, unknown or rest, hasattr(args, "command_args")))
    if hasattr(args, "command_args"):
        args.command_args = list(args.command_args or []) + list(rest) + list(tail or [])
    elif tail is not None:
        sub.error(f"unrecognized arguments: -- {' '.join(tail)}")
    return int(args.command_module.run(args) or 0)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def _unknown_message(sub: argparse.ArgumentParser, unknown: list[str], takes_command: bool) -> str:
    """Name each unknown option with the closest known one, e.g. --timout -> --timeout."""
    import difflib

    known = {o.lstrip("-"): o for a in sub._actions for o in a.option_strings if o.startswith("--")}
    parts = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0].lstrip("-"), known, n=1, cutoff=0.7)
        parts.append(f"{arg}" + (f" (did you mean {known[close[0]]}?)" if close else ""))
    msg = f"unrecognized arguments: {', '.join(parts)}"
    if takes_command:
        msg += "; options of the command itself go after --, e.g. -- python train.py --lr 0.1"
    return msg


if __name__ == "__main__":
    raise SystemExit(main())
