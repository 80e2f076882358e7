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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="commopt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        module = _load(name)
        if module is None:
            continue
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # `commopt launch ... -- cmd` must keep everything after `--` untouched.
    args, rest = parser.parse_known_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    if rest:
        if rest and rest[0] == "--":
            rest = rest[1:]
        if not hasattr(args, "command_args"):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.command_args = list(getattr(args, "command_args") or []) + rest
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
