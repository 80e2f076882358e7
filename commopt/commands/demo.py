"""`commopt demo`: what a new user should see first.

Runs a 2-rank allreduce through every communicator available here, with its timing
(`commopt.examples.allreduce_tour`).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

HELP = "run the main demonstration job (2 ranks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib", type=float, default=16, help="allreduce buffer size in MiB")
    parser.add_argument("-n", "--nprocs", type=int, default=2)


def run(args: argparse.Namespace) -> int:
    cmd = [sys.executable, "-m", "commopt", "launch", "-n", str(args.nprocs), "--",
           sys.executable, "-m", "commopt.examples.allreduce_tour", "--mib", str(args.mib)]
    print("$ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)
