"""benchmarks/allreduce_link.py: medians over rounds, paired ratios, targets, simulator entries."""

import pytest

from tests.unit.bench_scripts import load_benchmark

link = load_benchmark("allreduce_link")
SIZE = 64 << 20


def fake_data(mpi_ms, gloo_ms, qsgd_ms):
    runs = []
    for rnd, (m, g, q) in enumerate(zip(mpi_ms, gloo_ms, qsgd_ms)):
        common = {
            "link_bits_per_s": 10**9,
            "round": rnd,
            "shell_command": "cmd",
            "load_average": 1.0,
        }
        runs.append(
            {
                **common,
                "config": "mpi",
                "results": [
                    {"codec": "fp32", "size": SIZE, "wire_bytes": SIZE, "time_us": m * 1e3},
                    {"codec": "qsgd4", "size": SIZE, "wire_bytes": SIZE // 7, "time_us": q * 1e3},
                ],
            }
        )
        runs.append(
            {
                **common,
                "config": "torch",
                "results": [
                    {"codec": "fp32", "size": SIZE, "wire_bytes": SIZE, "time_us": g * 1e3}
                ],
            }
        )
    return {"nprocs": 2, "rounds": len(mpi_ms), "runs": runs, "started": "t0"}


def test_medians_limits_and_targets():
    data = fake_data([570, 580, 600], [575, 590, 600], [100, 90, 95])
    summary = link.summarize(data)
    mpi = link._row(summary, "mpi", "fp32", SIZE)
    assert mpi["time_s"] == pytest.approx(0.580)
    assert mpi["limit_s"] == pytest.approx(SIZE * 8 / 1e9)  # 2(n-1)/n = 1 for two ranks
    assert mpi["x_limit"] == pytest.approx(0.580 / (SIZE * 8 / 1e9))
    assert link.paired(data, ("mpi", "fp32"), ("torch", "fp32"), SIZE) == pytest.approx(
        [570 / 575, 580 / 590, 600 / 600]
    )
    met = {t["target"].split(":")[1].strip(): t["met"] for t in link.targets(data, summary)}
    assert met["mpi no slower than gloo"] is True  # medians 580 vs 590 ms
    assert met["mpi within 1.10x of 2(n-1)/n x bytes / rate"] is True
    assert met["effective busbw >= 6x fp32's"] is True  # 580 / 95 = 6.1x


def test_slower_mpi_misses_and_simulator_entries_name_the_plan():
    data = fake_data([700, 700, 700], [600, 600, 600], [200, 200, 200])
    summary = link.summarize(data)
    assert not any(t["met"] for t in link.targets(data, summary))
    entries = link.sim_measurements(data, summary)
    fp32 = [e for e in entries if e["what"].startswith("allreduce fp32")]
    assert {e["plan"]["algorithm"] for e in fp32} == {"ring"} and len(fp32) == 2  # mpi, gloo
    assert all(e["compute_s"] > 0 and e["grad_bytes"] == SIZE for e in entries)
    assert {e["plan"]["algorithm"] for e in entries if e["plan"]["compression"] == "qsgd4"} == {
        "scatter_reduce"
    }
