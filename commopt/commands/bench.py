"""`commopt bench`: benchmarks, one sub-command each.

    $ commopt launch -n 2 -- commopt bench allreduce --comm mpi --codec fp32,qsgd4
    $ commopt bench allreduce --comm local -b 4K -e 64K      # a world of one: codec cost only
    $ commopt bench step --models mlp --configs ddp-fp32,commopt-qsgd4-db   # DDP against commopt

Each benchmark is the module (or package) ``commopt.bench.<name>``, with ``add_arguments(parser)`` and
``run(args) -> int``, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import sys

HELP = (
    "benchmarks: allreduce (nccl-tests style sweep over communicators and codecs), step "
    "(training steps, DDP against commopt), to_accuracy (time to a target loss), hsdp "
    "(sharded training: FSDP2's HSDP against commopt between nodes)"
)

# name -> one-line help; the module is commopt.bench.<name>.
BENCHMARKS = {
    "allreduce": "allreduce time, algbw, busbw and error over sizes and codecs",
    "step": "training steps side by side: PyTorch DDP and commopt on the same model and link",
    "to_accuracy": "wall time to a target validation loss: DDP against commopt on the link",
    "hsdp": "FSDP2's HSDP against HSDP with commopt's reduction between nodes, on the link",
}


def _module(name: str):
    """commopt.bench.<name>; one that is missing is a broken installation, said so."""
    try:
        return importlib.import_module(f"commopt.bench.{name}")
    except ModuleNotFoundError as exc:
        if exc.name in (f"commopt.bench.{name}", "commopt.bench"):
            raise ImportError(
                f"commopt bench {name}: the module commopt.bench.{name} is missing "
                f"from this installation of commopt; reinstall it "
                f"(pip install --force-reinstall commopt, or pip install . in a "
                f"checkout)"
            ) from exc
        raise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = _module(name)
        module.add_arguments(p)
        p.set_defaults(bench_module=module, bench_name=name)


def run(args: argparse.Namespace) -> int:
    name = getattr(args, "bench_name", None)
    if name is None:
        print(
            "commopt bench: name a benchmark: "
            + ", ".join(BENCHMARKS)
            + " (e.g. commopt bench allreduce --help)",
            file=sys.stderr,
        )
        return 2
    return int(args.bench_module.run(args) or 0)
