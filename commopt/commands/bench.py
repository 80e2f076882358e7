"""`commopt bench`: benchmarks, one sub-command each.

    $ commopt launch -n 2 -- commopt bench allreduce --comm mpi --codec fp32,qsgd4
    $ commopt bench allreduce --comm local -b 4K -e 64K      # a world of one: codec cost only

Each benchmark lives in ``commopt/bench/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``, imported only when asked for.
"""
from __future__ import annotations

import argparse
import importlib
import sys

HELP = "benchmarks: allreduce (nccl-tests style sweep over communicators and codecs), step"

# name -> one-line help; the module is commopt.bench.<name>.
BENCHMARKS = {
    "allreduce": "allreduce time, algbw, busbw and error over sizes and codecs",
    "step": "time of a training step with and without compression",
}


def _module(name: str):
    try:
        return importlib.import_module(f"commopt.bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name == f"commopt.bench.{name}":
            return None  # not written yet in this build
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = _module(name)
        if module is not None:
            module.add_arguments(p)
        p.set_defaults(_bench=module, _bench_name=name)


def run(args: argparse.Namespace) -> int:
    name = getattr(args, "_bench_name", None)
    if name is None:
        print("commopt bench: name a benchmark: " + ", ".join(BENCHMARKS)
              + " (e.g. commopt bench allreduce --help)", file=sys.stderr)
        return 2
    if args._bench is None:
        print(f"commopt bench: '{name}' is not available in this version of commopt",
              file=sys.stderr)
        return 2
    return int(args._bench.run(args) or 0)
