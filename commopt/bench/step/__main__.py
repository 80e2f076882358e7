"""``python -m commopt.bench.step``: the same as ``commopt bench step`` (the ranks start this way)."""

import argparse
import sys

from commopt.bench.step.cli import add_arguments, run

parser = argparse.ArgumentParser(
    prog="commopt bench step",
    description="training steps side by side: "
    "PyTorch DDP and commopt on the same model, batch and link",
)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
