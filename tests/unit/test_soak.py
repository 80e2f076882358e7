"""The soak benchmark, short: 2 ranks, 200 steps of one mode (benchmarks/soak.py runs 4 ranks,
2,000 steps of five). Every sampled resource must stay flat after warm-up, and the
communicators a mode used must be freed once it is finalized."""

from __future__ import annotations

import json

from tests.multirank import needs_mpirun
from tests.unit.bench_scripts import load_benchmark

soak = load_benchmark("soak")


@needs_mpirun
def test_short_soak_stays_flat(tmp_path):
    out = tmp_path / "soak.json"
    args = ["--ranks", "2", "--steps", "200", "--every", "50", "--warmup", "100"]
    rc = soak.main([*args, "--modes", "qsgd4+ef", "--timeout", "300", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and record["passed"], json.dumps(record["modes"], indent=1)[:4000]
    assert set(record["modes"]) == {"qsgd4+ef"}
    for mode, entry in record["modes"].items():
        assert set(entry["ranks"]) == {"0", "1"}, mode
        assert entry["mpi_comms_kept"] == 0, f"{mode}: MPI communicators left after finalize"
        for rank, r in entry["ranks"].items():
            assert set(r["metrics"]) == set(soak.METRICS), f"{mode} rank {rank}"
    for r in record["per_rank"]:
        samples = r["modes"]["qsgd4+ef"]["samples"]
        assert [s["step"] for s in samples] == [50, 100, 150, 200], f"rank {r['rank']}"
        assert all(s["mpi_comms"] >= 1 for s in samples), (
            f"rank {r['rank']}: no communicator counted"
        )


def test_flatness_flags_growth():
    samples = [{"step": s, "rss_kib": 1000 + 10 * s, "open_fds": 20} for s in (100, 200, 300)]
    flat = soak.flatness(samples, 0, 0.05)
    assert flat["open_fds"]["flat"] and not flat["rss_kib"]["flat"]
    assert flat["rss_kib"]["max_rel_change"] == (4000 - 2000) / 2000
