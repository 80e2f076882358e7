"""``python -m commopt.bench.hsdp``: the same as ``commopt bench hsdp`` (the ranks start this way)."""

import argparse
import sys

from commopt.bench.hsdp import DESCRIPTION, add_arguments, run

parser = argparse.ArgumentParser(prog="commopt bench hsdp", description=DESCRIPTION)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
