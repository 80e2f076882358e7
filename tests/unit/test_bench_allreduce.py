"""`commopt bench allreduce`: bandwidth arithmetic, size sweeps, the JSON schema, bad input."""

from __future__ import annotations

import json

import pytest

from commopt.bench.allreduce import bus_factor, make_row, summarize
from commopt.bench.sizes import parse_size, sizes
from commopt.cli import main


def test_bus_factor_is_nccl_tests_allreduce_factor():
    assert bus_factor(1) == 0.0
    assert bus_factor(2) == 1.0
    assert bus_factor(4) == 1.5
    assert bus_factor(8) == 1.75


def test_row_arithmetic():
    # 16 MB of fp32 through a 4x codec (4 MB wire) in 10 ms on 4 ranks.
    r = make_row(16_000_000, "qsgd8", 4_000_000, 0.010, 4, 0.01)
    assert r.count == 4_000_000 and r.type == "float"
    assert r.time_us == pytest.approx(10_000)
    assert r.algbw_gbps == pytest.approx(0.4)  # wire bytes / time
    assert r.busbw_gbps == pytest.approx(0.4 * 1.5)  # x 2(n-1)/n
    assert r.effective_busbw_gbps == pytest.approx(1.6 * 1.5)  # fp32 bytes / time x 2(n-1)/n
    assert r.max_rel_error == 0.01


def test_summary_averages_over_sizes_per_codec():
    rows = [
        make_row(s, c, w, t, 2, e)
        for s, c, w, t, e in [
            (1000, "fp32", 1000, 1e-6, 0.0),
            (2000, "fp32", 2000, 1e-6, 1e-7),
            (1000, "fp16", 500, 1e-6, 1e-4),
        ]
    ]
    s = summarize(rows)
    assert list(s) == ["fp32", "fp16"]
    assert s["fp32"]["avg_busbw_gbps"] == pytest.approx((1.0 + 2.0) / 2)
    assert s["fp16"]["avg_effective_busbw_gbps"] == pytest.approx(1.0)
    assert s["fp32"]["max_rel_error"] == 1e-7


def test_sizes_like_nccl_tests():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("2m") == 2 << 20
    assert sizes(8, 64, factor=2) == [8, 16, 32, 64]
    assert sizes(8, 100, factor=4) == [8, 32]
    assert sizes(100, 300, increment=100) == [100, 200, 300]
    assert sizes(64, 64, factor=1) == [64]
    with pytest.raises(ValueError, match="16M"):
        parse_size("lots")
    with pytest.raises(ValueError, match="begin <= end"):
        sizes(64, 8)
    with pytest.raises(ValueError, match="-f FACTOR"):
        sizes(8, 64, factor=1)


ROW_KEYS = {
    "size": int,
    "count": int,
    "type": str,
    "codec": str,
    "wire_bytes": int,
    "time_us": float,
    "algbw_gbps": float,
    "busbw_gbps": float,
    "effective_busbw_gbps": float,
    "max_rel_error": float,
}
CONFIG_KEYS = {
    "benchmark",
    "schema",
    "comm",
    "link_bits_per_s",
    "world_size",
    "nodes",
    "ranks_per_node",
    "device",
    "algorithm",
    "iters",
    "warmup",
    "check",
    "seed",
    "command",
    "results",
    "summary",
}


def test_json_schema_on_a_world_of_one(capsys):
    code = main(
        [
            "bench",
            "allreduce",
            "--comm",
            "local",
            "-b",
            "4K",
            "-e",
            "16K",
            "-f",
            "2",
            "-n",
            "2",
            "-w",
            "1",
            "--codec",
            "fp32,fp16,qsgd4",
            "--json",
        ]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == CONFIG_KEYS
    assert doc["benchmark"] == "allreduce" and doc["world_size"] == 1 and doc["iters"] == 2
    assert doc["command"].startswith("commopt bench allreduce -b 4K -e 16K")
    rows = doc["results"]
    assert [(r["size"], r["codec"]) for r in rows] == [
        (s, c) for s in (4096, 8192, 16384) for c in ("fp32", "fp16", "qsgd4")
    ]
    for r in rows:
        assert {k: type(v) for k, v in r.items()} == ROW_KEYS
        assert r["count"] == r["size"] // 4 and r["time_us"] > 0
        assert r["busbw_gbps"] == 0.0  # 2(n-1)/n is 0 for one rank, as in nccl-tests
        assert r["max_rel_error"] == 0.0  # a world of one reduces to the input itself
    wire = {r["codec"]: r["wire_bytes"] for r in rows if r["size"] == 4096}
    assert wire["fp32"] == 4096 and wire["fp16"] == 2048 and wire["qsgd4"] < 4096 / 6
    assert set(doc["summary"]) == {"fp32", "fp16", "qsgd4"}


def test_table_has_a_summary_line(capsys):
    assert (
        main(
            [
                "bench",
                "allreduce",
                "--comm",
                "local",
                "-b",
                "4K",
                "-e",
                "4K",
                "-n",
                "1",
                "-w",
                "0",
                "-c",
                "0",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = captured.out
    assert "# Avg bus bandwidth (fp32):" in out
    assert out.count("\n 4096 ") + out.count("  4096 ") >= 1
    # busbw is 0 on one rank: the run says why and how to launch N ranks (on stderr, so a
    # --json document on stdout stays clean).
    assert (
        "busbw is 0" in captured.err
        and "commopt launch -n 2 -- commopt bench allreduce" in captured.err
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--codec", "zip"], "valid names"),
        (["-b", "huge"], "16M"),
        (["-b", "64K", "-e", "4K"], "begin <= end"),
        (["-b", "2", "-e", "2"], "-b 4"),
        (["--algorithm", "magic"], "scatter_reduce"),
        (["--comm", "carrier-pigeon"], "valid names"),
        (["-n", "0"], "-n must"),
    ],
)
def test_bad_input_is_explained(capsys, args, message):
    base = ["bench", "allreduce", "--comm", "local", "-n", "1", "-w", "0"]
    assert main(base + args) == 2
    assert message in capsys.readouterr().err


def test_bench_needs_a_benchmark_name(capsys):
    assert main(["bench"]) == 2
    assert "allreduce" in capsys.readouterr().err
