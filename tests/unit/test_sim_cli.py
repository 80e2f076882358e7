"""`commopt simulate` end to end: `python -m commopt simulate ...` in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from commopt.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def simulate_cli(*args, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "commopt", "simulate", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_issue_example_prints_a_table():
    r = simulate_cli(
        "--machine",
        "v100-nvlink-25g",
        "--model",
        "resnet50",
        "--gpus",
        "32",
        "--compression",
        "fp16",
        "--double-buffering",
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["gpus", "nodes"])
    assert set(lines[header + 1].replace(" ", "")) == {"-"}  # the rule under the header
    row = lines[header + 2].split()
    assert row[0] == "32" and row[1] == "4"
    assert float(row[-1].rstrip("%")) > 90  # double buffering hides the 25 Gbit/s all-reduce
    assert "double-buffering" in lines[0]


def test_sweep_writes_json_and_a_plot(tmp_path, capsys):
    # In-process (the subprocess path is covered above): the same parser and run().
    png = tmp_path / "scaling.png"
    assert (
        main(
            [
                "simulate",
                "--model",
                "bert-large",
                "--sweep",
                "gpus=8..1024",
                "--json",
                "--plot",
                str(png),
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    gpus = [row["gpus"] for row in doc["rows"]]
    assert gpus == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert all(0 < row["efficiency"] <= 1 for row in doc["rows"])
    assert doc["rows"][-1]["throughput"] > doc["rows"][0]["throughput"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_process_paths(tmp_path, capsys):
    # Measured numbers against the testbed preset.
    assert (
        main(
            [
                "simulate",
                "--machine",
                "testbed-1gbit",
                "--gpus",
                "2",
                "--compute-time",
                "0.5",
                "--grad-bytes",
                str(64 * 2**20),
                "--measured-step",
                "1.1",
                "--algorithm",
                "ring",
                "--no-overlap",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "measured step 1100.0 ms" in out and "error" in out
    # A sweep of link speeds, a codec benchmark file, an unknown codec.
    bench = tmp_path / "codec.json"
    bench.write_text(json.dumps([{"codec": "qsgd4", "encode_GBps": 50, "decode_GBps": 80}]))
    assert (
        main(
            [
                "simulate",
                "--model",
                "resnet50",
                "--gpus",
                "1024",
                "--sweep",
                "inter_gbps=25,100,400",
                "--compression",
                "qsgd4",
                "--codec-bench",
                str(bench),
                "--json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["inter_gbps"] for r in rows] == [25.0, 100.0, 400.0]
    assert rows[0]["efficiency"] <= rows[-1]["efficiency"]
    assert main(["simulate", "--compression", "zip"]) == 2
    assert "unknown codec" in capsys.readouterr().err
    assert main(["simulate", "--gpus", "12"]) == 2
    assert "multiple of 8" in capsys.readouterr().err
    assert main(["simulate", "--list"]) == 0
    assert "testbed-1gbit" in capsys.readouterr().out


def test_profile_model_on_this_cpu(tmp_path, capsys):
    """A real ResNet-50 run on this CPU (batch 1, 64x64, one timed iteration), written out and
    used with the V100's published speed."""
    out = tmp_path / "r50.json"
    assert (
        main(
            [
                "simulate",
                "--profile-model",
                "resnet50",
                "--profile-out",
                str(out),
                "--profile-iters",
                "1",
                "--machine",
                "v100-nvlink-25g",
                "--gpus",
                "16",
                "--json",
            ]
        )
        == 0
    )
    measured = json.loads(out.read_text())
    assert measured["name"] == "resnet50" and measured["throughput"]["cpu"] > 0
    assert sum(lay["numel"] for lay in measured["layers"]) == 25_557_032
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"]["batch_per_gpu"] == 64  # the built-in V100 batch and speed
    assert doc["rows"][0]["single_gpu_throughput"] == pytest.approx(1226)


def test_piece_size_of_the_scatter_reduce_pipeline(capsys):
    # qsgd4, 64 MiB on the testbed: pipelined pieces hide the codec work behind the wire.
    common = [
        "simulate",
        "--machine",
        "testbed-1gbit",
        "--compression",
        "qsgd4",
        "--algorithm",
        "scatter_reduce",
        "--gpus",
        "2",
        "--compute-time",
        "1e-6",
        "--grad-bytes",
        str(64 << 20),
        "--no-overlap",
        "--json",
    ]
    steps = {}
    for piece in ("0", "4"):
        assert main(common + ["--piece-mb", piece]) == 0
        steps[piece] = json.loads(capsys.readouterr().out)["rows"][0]["step_s"]
    assert steps["4"] < steps["0"], f"pieces of 4 MiB should beat one piece: {steps}"
    assert main(common + ["--piece-mb", "-1"]) != 0
    assert "piece size must be >= 0" in capsys.readouterr().err
