"""The simulator against the published scaling rows and effects, and the testbed's physics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from commopt.sim import Configuration, get_machine, load_profile, simulate
from commopt.sim.costs import GBYTE, Link
from commopt.sim.validation import (
    PUBLISHED_ROWS,
    TOLERANCE,
    Measurement,
    _predict,
    cgx_effect,
    chainermn_effect,
    compare_measured,
    compare_testbed_measurements,
    load_measurements,
    physical_allreduce_s,
    predict_testbed_allreduce,
    published_comparison,
)
from tests.unit.bench_scripts import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "sim-testbed-1gbit.json")

ROWS = published_comparison()


def _id(r):
    source = "cgx" if r.row.source.startswith("CGX") else "nvidia-dle-b16"
    return f"{source}-{r.row.model}-{r.row.machine}-{r.row.gpus}"


@pytest.mark.parametrize("compared", ROWS, ids=_id)
def test_published_scaling_rows_within_15_percent(compared):
    if compared.row.gpus == 1:
        # The anchor: the published single-GPU speed is an input.
        assert compared.error == pytest.approx(0.0, abs=1e-9)
        return
    if compared.known_miss:
        # Stated, not tuned away; the row must really be missed, or the reason is stale.
        assert abs(compared.error) > TOLERANCE, (
            f"{_id(compared)} is now within 15%: drop known_miss"
        )
        pytest.xfail(compared.known_miss)
    assert abs(compared.error) <= TOLERANCE, (
        f"{_id(compared)}: predicted {compared.predicted:.0f}, published {compared.row.published:.0f}"
    )


def test_only_one_published_row_is_a_known_miss():
    assert sum(r.known_miss is not None for r in ROWS) == 1


def test_assumption_dependent_rows_really_depend_on_the_assumption():
    """The BERT rows on the 3090 hinge on the unpublished batch: say so, and check it is true."""
    flagged = [r for r in ROWS if r.caveat]
    assert {(r.row.model, r.row.machine) for r in flagged} == {("bert-large", "rtx3090-pcie")}
    profile = load_profile("bert-large")

    def error_at(r, seqs: int) -> float:
        """The row's error with ``seqs`` sequences of 384 per GPU."""
        batch = profile.with_overrides(batch_per_gpu=seqs * 384)
        other = simulate(batch, r.row.machine, r.row.plan, r.row.gpus)
        return abs(other.throughput / r.row.published - 1)

    for r in flagged:
        for seqs in (2, 8):
            assert error_at(r, seqs) > 0.3
    # The V100 BERT rows are a real test: they hardly move with the batch.
    for r in ROWS:
        if (r.row.model, r.row.machine) == ("bert-large", "v100-nvlink-25g") and r.row.gpus > 1:
            for seqs in (2, 8):
                assert error_at(r, seqs) <= TOLERANCE


def test_bert_on_the_3090_is_slower_on_2_gpus_than_on_1_as_published():
    one = simulate("bert-large", "rtx3090-pcie", Configuration(), 1).throughput
    two = simulate("bert-large", "rtx3090-pcie", Configuration(), 2).throughput
    four = simulate("bert-large", "rtx3090-pcie", Configuration(), 4).throughput
    assert four < one and two < 1.1 * one


def test_chainermn_double_buffering_and_fp16_reach_the_published_efficiency():
    e = chainermn_effect()
    assert abs(e.error) <= TOLERANCE, f"predicted {e.predicted_value:.2f} vs published 0.96"
    # The features are what make it: without them the same run scales far worse.
    assert e.baseline_value < 0.75 * e.predicted_value


def test_cgx_compression_brings_bert_on_the_3090_to_the_v100s_scaling():
    e = cgx_effect("bert-large")
    assert abs(e.error) <= TOLERANCE
    assert e.predicted_value > 3 * e.baseline_value


def test_cgx_compression_on_transformer_xl_direction_and_size():
    e = cgx_effect("transformer-xl-base")
    assert e.predicted_value > 1.8 * e.baseline_value  # published: 35% -> about 87%
    if abs(e.error) > TOLERANCE:
        pytest.xfail(
            "Transformer-XL's tied embedding (71% of its gradient) is complete only at the end of "
            "the backward pass, so even compressed its all-reduce stays exposed: predicted "
            f"{e.predicted_value:.0%} vs about {e.published_value:.0%} published. The target is CGX's "
            "general claim (pytorch-cgx.github.io/benchmarks: 'up to 90% of ideal scaling' over four "
            "models, 4 bits, bucket 1024); the first author's page (ilmarkov.github.io/projects/CGX) "
            "gives Transformer-XL base on 8x RTX 3090 a 60% speedup over NCCL, about 55% efficiency "
            "from the published 105k tok/s baseline"
        )


def test_testbed_allreduce_against_the_physical_limit():
    limit = physical_allreduce_s(64 * 2**20, 2, 1.0)
    assert limit == pytest.approx(64 * 2**20 / 125e6)  # 2(n-1)/n * bytes / rate, n = 2
    predicted = predict_testbed_allreduce(64 * 2**20, 2)
    assert limit < predicted < 1.10 * limit  # TCP headers, 2 latencies
    assert predict_testbed_allreduce(64 * 2**20, 2, codec="fp16") < 0.6 * predicted


def test_testbed_measurements_can_be_compared():
    m = get_machine("testbed-1gbit")
    assert m.gpus_per_node == 1 and m.inter_gbps == 1.0
    out = compare_measured(measured_step_s=1.4, compute_s=0.5, grad_bytes=64 * 2**20)
    assert out["predicted_step_s"] == pytest.approx(
        0.5 + predict_testbed_allreduce(64 * 2**20), rel=0.01
    )
    rows = compare_testbed_measurements(
        [Measurement("resnet50 fp32", "commopt bench ...", 2, 0.5, 64 * 2**20, 1.0)]
    )
    assert rows[0]["error"] == pytest.approx(rows[0]["predicted_step_s"] - 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        compare_measured(measured_step_s=1.0, compute_s=0.0, grad_bytes=1)


def test_documented_alternatives_to_the_3090_uplink_break_the_bert_rows():
    """The reason the 3090 Transformer-XL 4-GPU row stays a known miss, checked: the measured
    6.1 GB/s misses it, and the documented larger figures (8.6 GB/s cross-switch, 12.6 GB/s PCIe
    3.0 x16 x 0.8) put some BERT row on that server beyond 15%."""
    base = get_machine("rtx3090-pcie")
    assert base.uplink.bandwidth_Bps == pytest.approx(6.1 * GBYTE)
    rows = [r for r in PUBLISHED_ROWS if r.machine == "rtx3090-pcie" and r.gpus > 1]
    for uplink in (8.6, 12.6):
        m = replace(base, uplink=Link(base.uplink.latency_s, uplink * GBYTE))
        errors = {
            (r.model, r.gpus): simulate(r.model, m, r.plan, r.gpus).throughput / r.published - 1
            for r in rows
        }
        assert max(errors[("bert-large", g)] for g in (2, 4, 8)) > TOLERANCE


def test_transformer_xl_as_nvidias_script_runs_ddp_misses_the_3090_rows_further():
    """The other half of that reason, checked: NVIDIA's train.py uses DDP with
    find_unused_parameters=True, so the buckets keep their construction order and the first one
    (r_w_bias, r_r_bias, used by every layer) is ready only at the end of the backward pass: no
    overlap. Modelled so, the 3090 rows fall further below the published ones (the 8-GPU row
    beyond 15% too), while the V100 rows stay within 15%."""
    rows = [r for r in PUBLISHED_ROWS if r.model == "transformer-xl-base" and r.gpus > 1]
    no_overlap = {
        (r.machine, r.source, r.gpus): _predict(
            replace(r, plan=Configuration(overlap=False))
        ).throughput
        / r.published
        - 1
        for r in rows
    }
    with_overlap = {
        (c.row.machine, c.row.source, c.row.gpus): c.error for c in ROWS if c.row in rows
    }
    for key, err in no_overlap.items():
        if key[0] == "rtx3090-pcie":
            assert err < with_overlap[key]
        else:
            assert abs(err) <= TOLERANCE
    assert no_overlap[("rtx3090-pcie", rows[0].source, 8)] < -TOLERANCE


def _measurement(**kw):
    base = dict(
        what="allreduce qsgd4 64 MiB",
        command="commopt launch ... --comm mpi ...",
        gpus=2,
        compute_s=1e-6,
        grad_bytes=64 * 2**20,
        measured_step_s=0.080,
        plan={
            "algorithm": "scatter_reduce",
            "compression": "qsgd4",
            "overlap": False,
            "bucket_cap_mb": 64,
        },
    )
    return Measurement(**{**base, **kw})


def test_measurements_pick_their_transports_preset():
    assert _measurement().transport_name() == "mpi"
    assert (
        _measurement(command="commopt launch --launcher torch -- ... --comm torch").transport_name()
        == "torch"
    )
    assert (
        _measurement(command="COMMOPT_MPI_PIPELINE=off commopt launch ...").transport_name()
        == "mpi-native"
    )
    assert _measurement(transport="torch", command="").transport_name() == "torch"
    rows = compare_testbed_measurements(
        [
            _measurement(),
            _measurement(transport="torch"),
            _measurement(transport="mpi-native"),
            _measurement(
                measured_step_s=0.2,
                per_round=[
                    {"time_s": 0.2, "load_average": 1.0},
                    {"time_s": 0.09, "load_average": 6.0},
                ],
            ),
        ]
    )
    assert [r["machine"] for r in rows] == [
        "testbed-1gbit",
        "testbed-1gbit-gloo",
        "testbed-1gbit",
        "testbed-1gbit",
    ]
    assert rows[0]["status"] == "ok" and rows[1]["predicted_step_s"] > rows[0]["predicted_step_s"]
    assert rows[2]["status"] == "not modelled" and "Open MPI" in rows[2]["reason"]
    assert rows[3]["status"] == "miss"
    ev = rows[3]["evidence"]
    assert ev["fastest"]["time_s"] == 0.09 and ev["quietest"]["load_average"] == 1.0
    # The link limit of an allreduce row: 2(n-1)/n x wire bytes / line rate (qsgd4: 0.1328 of fp32).
    assert rows[0]["limit_s"] == pytest.approx(64 * 2**20 * 0.1328125 / 125e6, rel=1e-3)


def test_a_measurement_at_another_link_rate_uses_that_rate():
    fast = compare_testbed_measurements(
        [_measurement(plan={"algorithm": "ring", "compression": "none"}, link_bits_per_s=10e9)]
    )[0]
    slow = compare_testbed_measurements(
        [_measurement(plan={"algorithm": "ring", "compression": "none"})]
    )[0]
    assert fast["machine"].endswith("@10G")
    assert fast["predicted_step_s"] < slow["predicted_step_s"] / 5


def test_measurement_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            [
                {
                    "what": "x",
                    "command": "y",
                    "gpus": 2,
                    "compute_s": 1e-6,
                    "grad_bytes": 4,
                    "measured_step_s": 1.0,
                    "colour": "red",
                }
            ]
        )
    )
    with pytest.raises(ValueError, match=r"may have: .*transport"):
        load_measurements(str(bad))
    bad.write_text(json.dumps({"what": "x"}))
    with pytest.raises(ValueError, match="JSON list"):
        load_measurements(str(bad))
    with pytest.raises(FileNotFoundError, match="--sim-measurements"):
        load_measurements(str(tmp_path / "missing.json"))


@pytest.mark.skipif(
    not os.path.exists(RESULTS), reason="no benchmarks/results/sim-testbed-1gbit.json"
)
def test_the_recorded_testbed_measurements_all_get_a_prediction():
    rows = compare_testbed_measurements(load_measurements(RESULTS))
    assert rows and all(
        r["predicted_step_s"] > 0 and r["status"] in ("ok", "miss", "not modelled") for r in rows
    )
    assert {r["transport"] for r in rows} >= {"mpi", "torch"}


def test_the_validation_script_takes_every_testbed_row_from_its_files(tmp_path):
    path = tmp_path / "m.json"

    def entry(what: str, comm: str, step_s: float, algorithm: str, codec: str) -> dict:
        return dict(
            what=what,
            command=f"commopt launch ... --comm {comm}",
            gpus=2,
            compute_s=1e-6,
            grad_bytes=64 * 2**20,
            measured_step_s=step_s,
            plan={
                "algorithm": algorithm,
                "compression": codec,
                "overlap": False,
                "bucket_cap_mb": 64,
            },
        )

    entries = [
        entry("allreduce fp32 64 MiB, mpi", "mpi", 0.57, "ring", "none"),
        entry("allreduce qsgd4 64 MiB, gloo", "torch", 0.2, "scatter_reduce", "qsgd4"),
    ]
    path.write_text(json.dumps(entries))
    r = subprocess.run(
        [sys.executable, "benchmarks/sim_validation.py", "--markdown", "--measured", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    testbed = r.stdout.split("## Testbed")[1].split("## ResNet-50 to 4096")[0]
    assert (
        "| allreduce fp32 64 MiB, mpi | testbed-1gbit | 561.7 ms | 536.9 ms | 570.0 ms |" in testbed
    )
    assert "testbed-1gbit-gloo" in testbed and "| miss" in testbed
    assert "1 of 2 modelled rows within 15%" in testbed
    assert "pending" not in r.stdout


def _doc_region(doc: str, name: str) -> str:
    start = doc.index(f"<!-- sim_validation:{name} -->\n") + len(
        f"<!-- sim_validation:{name} -->\n"
    )
    return doc[start : doc.index(f"<!-- /sim_validation:{name} -->")].rstrip("\n")


def test_docs_carry_the_scripts_tables_unedited():
    """docs/scaling.md's generated tables are what the script prints now (regenerate with
    `python benchmarks/sim_validation.py --write-docs docs/scaling.md` when the model changes)."""
    script = load_benchmark("sim_validation")
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    paths = [str(p) for p in script.DEFAULT_MEASURED if p.exists()]
    measurements = [m for p in paths for m in load_measurements(p)]
    expected = {
        "published": script.published_table(True, {}),
        "choices": script.choices_table(True),
        "loo": script.loo_table(True, measurements),
        "effects": script.effects_table(True),
        "sockets": script.socket_sizes_table(True),
        "held-out": script.held_out_table(True),
        "predictions": script.predictions_table(True),
    }
    for name, table in expected.items():
        assert _doc_region(doc, name) == table, f"docs/scaling.md region {name} is stale"


def test_docs_carry_the_testbed_tables_unedited():
    """docs/scaling.md's testbed tables (allreduce and training-step rows, from the default
    measurement files) and their summary are what the script prints now."""
    script = load_benchmark("sim_validation")
    paths = [str(p) for p in script.DEFAULT_MEASURED if p.exists()]
    if len(paths) < 2:
        pytest.skip("the default measurement files are not both there")
    rows = compare_testbed_measurements([m for p in paths for m in load_measurements(p)])
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        doc = f.read()
    assert script.testbed_tables(True, rows) in doc


def test_placing_the_4_gpus_across_the_3090_switches_moves_bert_beyond_15_percent():
    """The third half of the reason: which 4 GPUs ran is not published, and the one other
    placement (2 + 2 across the switches) swings the Transformer-XL row from -23% to about +15%
    and takes the BERT 4-GPU row of the same table far beyond 15%."""
    base = get_machine("rtx3090-pcie")
    across = replace(base, group_size=2)
    rows = {r.model: r for r in PUBLISHED_ROWS if r.machine == "rtx3090-pcie" and r.gpus == 4}

    def err(machine, model):
        r = rows[model]
        return simulate(model, machine, r.plan, 4).throughput / r.published - 1

    assert (
        err(base, "transformer-xl-base") < -TOLERANCE and abs(err(base, "bert-large")) <= TOLERANCE
    )
    assert 0 < err(across, "transformer-xl-base") < 0.2
    assert err(across, "bert-large") > 3 * TOLERANCE
