"""`commopt tune`: grid parsing, ranking, the table and env file, and one real sweep on loopback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commopt.network import tune
from commopt.network.tune import BenchRow, PointResult


# -- grids -------------------------------------------------------------------------------------------
def test_grid_is_the_cartesian_product_in_order():
    points = tune.parse_grid(["A_X=1,2", "B_Y=x,y,z"])
    assert [(p["A_X"], p["B_Y"]) for p in points] == [
        ("1", "x"),
        ("1", "y"),
        ("1", "z"),
        ("2", "x"),
        ("2", "y"),
        ("2", "z"),
    ]


def test_grid_mca_names_linked_values_sizes_and_ranges():
    (p,) = tune.parse_grid(["btl_tcp_eager_limit+btl_tcp_rndv_eager_limit=256K"])
    assert p == {
        "OMPI_MCA_btl_tcp_eager_limit": "262144",
        "OMPI_MCA_btl_tcp_rndv_eager_limit": "262144",
    }
    assert [q["NCCL_NSOCKS_PERTHREAD"] for q in tune.parse_grid(["NCCL_NSOCKS_PERTHREAD=2-4"])] == [
        "2",
        "3",
        "4",
    ]
    assert [q["X_IF"] for q in tune.parse_grid(["X_IF=lo,docker0|lo"])] == ["lo,docker0", "lo"]
    assert tune.parse_value("1M") == "1048576" and tune.parse_value("2GiB") == str(2 * 2**30)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("NCCL_SOCKET_NTHREADS", "needs NAME=v1"),
        ("NCCL_SOCKET_NTHREADS=", "no values"),
        ("BAD-NAME=1", "not a variable name"),
    ],
)
def test_bad_grid_specs_say_what_to_write(spec, match):
    with pytest.raises(ValueError, match=match):
        tune.parse_grid([spec])


def test_same_variable_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        tune.parse_grid(["btl_tcp_links=1", "OMPI_MCA_btl_tcp_links=2"])


def test_default_grids_and_points_the_transport_would_change():
    nccl = tune.parse_grid(tune.DEFAULT_GRIDS["nccl"])
    assert len(nccl) == 16 and all(
        tune.skip_reason(p) is None for p in nccl
    )  # 8 x 8 = 64 is allowed
    assert "caps the product" in tune.skip_reason(
        {"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "8"}
    )
    assert "caps" in tune.skip_reason({"NCCL_SOCKET_NTHREADS": "32"})
    assert "rndv" in tune.skip_reason(
        {"OMPI_MCA_btl_tcp_eager_limit": "65536", "OMPI_MCA_btl_tcp_rndv_eager_limit": "131072"}
    )
    mpi = tune.parse_grid(tune.DEFAULT_GRIDS["mpi"])
    assert len(mpi) == 9 and {p["OMPI_MCA_btl_tcp_links"] for p in mpi} == {"1", "2", "4"}


# -- benchmark output ----------------------------------------------------------------------------------
def test_bench_output_is_found_among_other_lines():
    text = (
        "rank 0 warming up\n"
        + json.dumps(
            {"results": [{"bytes": 2**20, "busbw_gbps": 0.1}, {"bytes": 1024, "busbw_gbps": 0.01}]}
        )
        + "\ndone\n"
    )
    rows = tune.parse_bench_output(text)
    assert rows == [BenchRow(1024, 0.01), BenchRow(2**20, 0.1)]
    rows = tune.parse_bench_output(json.dumps([{"size": 8, "busbw_bytes_per_s": 2e9}]))
    assert rows == [BenchRow(8, 2.0)]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no json here",
        json.dumps({"results": []}),
        json.dumps([{"bytes": 8}]),
        json.dumps(
            [
                {"size": 8, "busbw_gbps": 1, "codec": "fp32"},
                {"size": 8, "busbw_gbps": 2, "codec": "fp16"},
            ]
        ),
    ],
)
def test_bad_bench_output_raises(text):
    with pytest.raises(ValueError):
        tune.parse_bench_output(text)


# -- ranking, table, env file ------------------------------------------------------------------------------
def res(point, pairs, error=None):
    return PointResult(point, [BenchRow(n, b) for n, b in pairs], error=error)


SIZES = (2**16, 2**20, 2**24)


def test_ranking_uses_large_messages_only():
    base = res({}, zip(SIZES, (0.5, 0.05, 0.05)))  # best at 64 KiB, poor when large
    links4 = res({"OMPI_MCA_btl_tcp_links": "4"}, zip(SIZES, (0.01, 0.10, 0.11)))
    broken = res({"OMPI_MCA_btl_tcp_links": "8"}, [], error="exit code 1")
    ranked = tune.rank([base, broken, links4])
    assert ranked == [links4, base, broken]
    assert links4.score() == pytest.approx(0.105)
    # Ranked by small messages instead, the defaults win.
    assert tune.rank([base, links4], large_from=1)[0] is base
    # No message is large enough: the largest one decides.
    assert res({}, [(100, 3.0), (200, 1.0)]).score() == 1.0


def test_table_shows_ratio_to_defaults_and_failures():
    base = res({}, zip(SIZES, (0.5, 0.05, 0.05)))
    links4 = res({"OMPI_MCA_btl_tcp_links": "4"}, zip(SIZES, (0.01, 0.10, 0.11)))
    broken = res({"OMPI_MCA_btl_tcp_links": "8"}, [], error="timed out after 5s")
    table = tune.format_table(tune.rank([base, links4, broken]))
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["#", "setting", "score", "GB/s"]
    assert "1M GB/s" in lines[0] and "16M GB/s" in lines[0] and "64K" not in lines[0]
    assert lines[2].startswith("1") and "btl_tcp_links=4" in lines[2] and "2.10x" in lines[2]
    assert "(defaults)" in lines[3] and "1.00x" in lines[3]
    assert "failed" in lines[4] and "timed out" in lines[4]
    # Every point failed: still a table, with the reasons.
    table = tune.format_table(tune.rank([broken]))
    assert "failed" in table and "timed out" in table


def test_env_file_exports_the_best_and_is_valid_shell(tmp_path):
    best = res({"OMPI_MCA_btl_tcp_links": "4", "X_LIST": "lo,docker0"}, [(2**20, 0.1)])
    base = res({}, [(2**20, 0.05)])
    text = tune.env_file_text(best, command="commopt bench allreduce", baseline=base)
    assert "2.00x" in text and "export OMPI_MCA_btl_tcp_links=4" in text
    f = tmp_path / "best.env"
    f.write_text(text)
    out = subprocess.run(
        ["bash", "-c", f"source {f}; echo $OMPI_MCA_btl_tcp_links $X_LIST"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["4", "lo,docker0"]
    assert "nothing to export" in tune.env_file_text(base, command="x")


def test_run_point_reports_failures_and_timeouts():
    ok = tune.run_point(
        {"COMMOPT_T": "7"},
        [
            sys.executable,
            "-c",
            "import os, json; print(json.dumps([{'bytes': 8, 'busbw': int(os.environ['COMMOPT_T'])}]))",
        ],
        timeout=60,
    )
    assert ok.error is None and ok.rows == [BenchRow(8, 7.0)]
    bad = tune.run_point({}, [sys.executable, "-c", "import sys; sys.exit('boom')"], timeout=60)
    assert bad.error.startswith("exit code 1") and "boom" in bad.error
    slow = tune.run_point({}, [sys.executable, "-c", "import time; time.sleep(30)"], timeout=1)
    assert slow.error == "timed out after 1s"


def test_repeats_take_the_median_and_a_failure_fails_the_point():
    runs = [res({"A_B": "1"}, [(2**20, v), (2**24, v * 2)]) for v in (0.3, 0.1, 0.2)]
    merged = tune.merge_runs(runs)
    assert merged.rows == [BenchRow(2**20, 0.2), BenchRow(2**24, 0.4)]
    assert merged.run_scores == pytest.approx([0.45, 0.15, 0.3])
    failed = tune.merge_runs(runs[:2] + [res({"A_B": "1"}, [], error="timed out after 9s")])
    assert failed.error == "1 of 3 runs failed: timed out after 9s" and not failed.rows
    table = tune.format_table(tune.rank([merged, res({}, [(2**20, 0.1), (2**24, 0.1)])]))
    assert "runs min-max" in table and "0.15-0.45" in table


def test_sweep_repeats_round_robin_and_skips_a_failed_point(tmp_path):
    log = tmp_path / "order.txt"
    script = (
        "import os, json, sys\n"
        f"open({str(log)!r}, 'a').write(os.environ.get('P_X', 'base') + '\\n')\n"
        "if os.environ.get('P_X') == 'bad': sys.exit(3)\n"
        "print(json.dumps([{'bytes': 2**20, 'busbw': 1.0}]))\n"
    )
    seen = []
    results = tune.sweep(
        [{}, {"P_X": "bad"}, {"P_X": "good"}],
        [sys.executable, "-c", script],
        timeout=60,
        repeats=2,
        progress=lambda i, n, r: seen.append((i, n)),
    )
    assert log.read_text().split() == ["base", "bad", "good", "base", "good"]
    assert [r.error is None for r in results] == [True, False, True]
    assert seen[-1] == (5, 5)
    with pytest.raises(ValueError, match="at least 1"):
        tune.sweep([{}], ["true"], repeats=0)


def test_nothing_from_argv_runs_when_the_env_file_is_sourced(tmp_path):
    """A newline or $(...) in the recorded command (it comes from argv) stays a comment."""
    import shlex

    best = res({"OMPI_MCA_btl_tcp_links": "4"}, [(2**20, 0.1)])
    command = shlex.join(
        [
            "commopt",
            "bench",
            "--bench-args",
            "x\ntouch injected-newline\n$(touch injected-subst) `touch injected-tick`",
        ]
    )
    env = tmp_path / "best.env"
    tune.write_env_file(str(env), tune.env_file_text(best, command=command))
    out = subprocess.run(
        ["bash", "-c", f"source {env}; echo $OMPI_MCA_btl_tcp_links"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.env"]
    assert "injected-newline" in env.read_text()  # recorded, as an escaped comment


def test_env_file_is_replaced_atomically_and_a_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    out = tmp_path / "tune.env"
    out.symlink_to(victim)
    tune.write_env_file(str(out), "export A=1\n")
    assert victim.read_text() == "keep me\n"
    assert not out.is_symlink() and out.read_text() == "export A=1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tune.env", "victim"]  # no temp file left
