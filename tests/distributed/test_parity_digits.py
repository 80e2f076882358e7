"""Accuracy parity on load_digits (real data), short: 2 ranks, one seed, a looser bound.

The full benchmark (3 seeds, 1 point) is `recipes/digits_parity.py`; its results are in
docs/recipes.md."""

from __future__ import annotations

import json

import pytest

from tests.multirank import run_mpi

pytestmark = pytest.mark.distributed

MAIN = """
import sys
from recipes.digits_parity import main
sys.exit(main(sys.argv[1:]))
"""


def test_compressed_and_double_buffered_training_stay_near_fp32(tmp_path):
    pytest.importorskip("sklearn", reason="the parity test needs scikit-learn (the recipes extra)")
    out_file = tmp_path / "parity.json"
    run_mpi(
        MAIN,
        2,
        timeout=240,
        args=[
            "--configs",
            "fp32,qsgd4+ef,db",
            "--seeds",
            "0",
            "--epochs",
            "20",
            "--lr",
            "0.02",
            "--tolerance",
            "3",
            "--out",
            str(out_file),
        ],
    )
    report = json.loads(out_file.read_text())
    assert report["world_size"] == 2
    acc = {r["config"]: r["mean_accuracy"] for r in report["rows"]}
    assert acc["fp32"] > 0.9, acc  # the baseline really learned the digits
    for config in ("qsgd4+ef", "db"):
        assert abs(acc[config] - acc["fp32"]) <= 0.03, (config, acc)
    runs = {r["config"]: r for r in report["runs"]}
    assert runs["qsgd4+ef"]["compressed_fraction"] > 0.9  # the codec really was on the wire
    assert runs["qsgd4+ef"]["digest"] != runs["fp32"]["digest"]
