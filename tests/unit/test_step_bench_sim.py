"""Training-step rows of the simulator's testbed validation: `commopt bench step`'s
--sim-measurements writer and their predictions (commopt.sim.validation)."""

import json
from pathlib import Path

import pytest

from commopt.bench.step import cli, sim_export
from commopt.sim import Configuration, get_machine, simulate
from commopt.sim.machines import Machine
from commopt.sim.validation import (
    Measurement,
    compare_testbed_measurements,
    load_measurements,
    synthetic_profile,
)
from tests.unit.bench_scripts import load_benchmark

REPO = Path(__file__).resolve().parents[2]
STEP_REPORT = REPO / "benchmarks" / "results" / "step-1gbit.json"
STEP_ENTRIES = REPO / "benchmarks" / "results" / "sim-testbed-steps-1gbit.json"
GLOO = get_machine("testbed-1gbit-gloo")
BW = 1e9 / 8 * 0.956  # the testbed's effective link, bytes/s
ALPHA = GLOO.inter.latency_s  # gloo: 180 us per collective


def _row(config, step=0.5, rounds=(0.5, 0.6, 0.45), compute=0.1, error=None):
    return {
        "config": config,
        "error": error,
        "step_s": step,
        "step_rounds": list(rounds),
        "compute_s": compute,
    }


def _report(comm="torch", rate=1e9, rows=None):
    rows = (
        rows
        if rows is not None
        else [
            _row("ddp-fp32"),
            _row("ddp-fp16"),
            _row("ddp-powersgd1"),
            _row("commopt-fp32"),
            _row("commopt-fp16-db"),
            _row("commopt-qsgd4"),
            _row("commopt-qsgd4+ef-db"),
            _row("commopt-fp16", error="Traceback ...\nRuntimeError: boom"),
        ]
    )
    return {
        "command": "python benchmarks/step_bench.py --json x.json",
        "nprocs": 2,
        "rate_bits": rate,
        "commopt_comm": comm,
        "load_average_start": 2.2,
        "load_average_end": 1.8,
        "models": {"mlp": {"params": 1000, "rows": rows}},
    }


def test_writer_gives_one_loadable_entry_per_configuration_that_ran(tmp_path):
    entries = sim_export.sim_measurements(_report())
    assert [e["what"].split(",")[0] for e in entries] == [
        "step mlp ddp-fp32",
        "step mlp ddp-fp16",
        "step mlp ddp-powersgd1",
        "step mlp commopt-fp32",
        "step mlp commopt-fp16-db",
        "step mlp commopt-qsgd4",
        "step mlp commopt-qsgd4+ef-db",
    ]  # failed: left out
    e = entries[0]
    assert e["command"] == "python benchmarks/step_bench.py --json x.json" and e["gpus"] == 2
    assert (e["compute_s"], e["measured_step_s"], e["grad_bytes"]) == (0.1, 0.5, 4000)
    assert (e["rounds"], e["measured_min_s"], e["measured_max_s"]) == (3, 0.45, 0.6)
    assert e["load_average"] == [1.8, 2.2] and e["link_bits_per_s"] == 1e9
    # The schema is Measurement's: the file loads.
    path = tmp_path / "steps.json"
    path.write_text(json.dumps(entries))
    loaded = load_measurements(str(path))
    assert len(loaded) == 7 and all(m.kind == "step" for m in loaded)


def test_writer_maps_each_configuration_to_the_plan_that_ran():
    plans = {
        e["what"].split(",")[0].split()[-1]: (e["plan"], e["transport"], e.get("not_modelled"))
        for e in sim_export.sim_measurements(_report(comm="mpi"))
    }
    assert plans["ddp-fp32"] == (
        {
            "algorithm": "ring",
            "compression": "none",
            "overlap": True,
            "double_buffering": False,
            "bucket_cap_mb": 25.0,
        },
        "torch",
        None,
    )  # DDP is always gloo, even beside --comm mpi
    assert (
        plans["ddp-fp16"][0]["compression"] == "fp16"
        and plans["ddp-fp16"][0]["algorithm"] == "ring"
    )
    assert plans["commopt-fp32"][1] == "mpi"
    assert plans["commopt-fp16-db"][0] == {
        "algorithm": "ring",
        "compression": "fp16",
        "overlap": True,
        "double_buffering": True,
        "bucket_cap_mb": 25.0,
    }
    assert plans["commopt-qsgd4"][0] == {
        "algorithm": "scatter_reduce",
        "compression": "qsgd4",
        "overlap": True,
        "double_buffering": False,
        "bucket_cap_mb": 25.0,
        "piece_mb": 4.0,
    }
    assert plans["commopt-qsgd4+ef-db"][0]["compression"] == "qsgd4+ef"
    assert plans["commopt-qsgd4+ef-db"][0]["double_buffering"] is True
    psgd, _, reason = plans["ddp-powersgd1"]
    assert psgd["compression"] == "powersgd1" and "low-rank" in reason


def test_writer_refuses_a_loopback_run_with_the_fix():
    with pytest.raises(ValueError, match="--link"):
        sim_export.sim_measurements(_report(rate=None))


def test_from_json_writes_the_entries(tmp_path, capsys):
    if not STEP_REPORT.exists():
        pytest.skip("no benchmarks/results/step-1gbit.json")
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "steps.json"
    args = parser.parse_args(["--from-json", str(STEP_REPORT), "--sim-measurements", str(out)])
    assert cli.run(args) == 0
    entries = json.loads(out.read_text())
    assert len(entries) == 24 and f"wrote {out} (24 entries)" in capsys.readouterr().out
    # The committed file is what the writer makes of the committed report.
    if STEP_ENTRIES.exists():
        assert json.loads(STEP_ENTRIES.read_text()) == entries


def _step(compute_s, grad_bytes, plan, machine=GLOO):
    return simulate(synthetic_profile(compute_s, grad_bytes, device="cpu"), machine, plan, 2)


def test_link_bound_step_is_compute_plus_exposed_communication():
    """MLP-sized fp32 gradient (100.8 MB) in 25 MiB buckets on gloo at 1 Gbit/s.

    Each bucket's ring on 2 hosts: 2 x (alpha + bucket / 2 / bw), so all 4 buckets together
    take 8 alpha + S / bw. Double buffering: the step is that communication (compute, 75 ms,
    is hidden). Overlap with backward: the first bucket (5 of the 16 even layers) is ready at
    forward + 5/16 of backward (forward = compute / 3), and the link then carries all buckets
    back to back: exposed communication = the whole all-reduce."""
    grad, compute = 100_765_760, 0.075
    comm = 8 * ALPHA + grad / BW
    db = _step(compute, grad, Configuration("ring", "none", 25, True, True))
    assert db.buckets == 4 and db.step_s == pytest.approx(comm, rel=1e-4)
    overlap = _step(compute, grad, Configuration("ring", "none", 25, True))
    first_ready = compute / 3 + (compute * 2 / 3) * 5 / 16
    assert overlap.step_s == pytest.approx(first_ready + comm, rel=1e-4)
    assert overlap.exposed_comm_s == pytest.approx(first_ready + comm - compute, rel=1e-4)
    none = _step(compute, grad, Configuration("ring", "none", 25, False))
    assert none.step_s == pytest.approx(compute + comm, rel=1e-4)


def test_the_testbed_core_runs_compute_and_codec_one_after_the_other():
    """A compute-bound qsgd4 step with double buffering: on the testbed (one core per rank) the
    codec work adds to compute; where the codec has its own hardware it is hidden."""
    assert GLOO.codec_shares_compute_core and get_machine("testbed-1gbit").codec_shares_compute_core
    assert not get_machine("v100-nvlink-25g").codec_shares_compute_core
    assert "share the machine's 2 cores" in GLOO.sources["codec_shares_compute_core"]
    plan = Configuration("scatter_reduce", "qsgd4", 25, True, True)
    grad, compute = 100_765_760, 0.300
    shared = _step(compute, grad, plan)
    separate = _step(
        compute,
        grad,
        plan,
        machine=Machine.from_dict({**GLOO.to_dict(), "codec_shares_compute_core": False}),
    )
    assert shared.comm_s < compute  # compute-bound either way
    # encode S at 6.74 GB/s, decode 1.5 S at 11.3 GB/s (n = 2): the measured codec speeds
    codec = grad / 6.74e9 + 1.5 * grad / 11.3e9
    assert shared.codec_s == pytest.approx(codec, rel=0.01)
    assert shared.step_s == pytest.approx(compute + shared.codec_s, rel=1e-6)
    assert separate.step_s == pytest.approx(compute, rel=1e-6)
    # Overlap with backward: the buckets sent during backward take their codec work from it.
    back = _step(compute, grad, plan.with_(double_buffering=False))
    back_separate = _step(
        compute,
        grad,
        plan.with_(double_buffering=False),
        machine=Machine.from_dict({**GLOO.to_dict(), "codec_shares_compute_core": False}),
    )
    assert back.step_s > back_separate.step_s


def _m(**kw):
    base = dict(
        what="step mlp x",
        command="python benchmarks/step_bench.py ...",
        gpus=2,
        compute_s=0.075,
        grad_bytes=100_765_760,
        measured_step_s=0.17,
        transport="torch",
        plan={
            "algorithm": "scatter_reduce",
            "compression": "qsgd4",
            "double_buffering": True,
            "bucket_cap_mb": 25,
        },
    )
    return Measurement(**{**base, **kw})


def test_step_rows_not_modelled_and_error_feedback():
    rows = compare_testbed_measurements(
        [
            _m(),
            _m(
                plan={
                    "algorithm": "scatter_reduce",
                    "compression": "qsgd4+ef",
                    "double_buffering": True,
                    "bucket_cap_mb": 25,
                }
            ),
            _m(
                plan={
                    "algorithm": "ring",
                    "compression": "powersgd1",
                    "overlap": True,
                    "bucket_cap_mb": 4096,
                },
                not_modelled="no low-rank codec",
            ),
        ]
    )
    assert [r["kind"] for r in rows] == ["step"] * 3 and rows[0]["machine"] == "testbed-1gbit-gloo"
    assert rows[1]["predicted_step_s"] == rows[0]["predicted_step_s"]  # EF's passes: not modelled
    assert rows[2]["status"] == "not modelled" and rows[2]["predicted_step_s"] is None
    # The link limit of a step row: the gradient's allreduce at line rate (qsgd4: 0.1328 of fp32).
    assert rows[0]["limit_s"] == pytest.approx(100_765_760 * 0.1328125 / 125e6, rel=1e-3)
    script = load_benchmark("sim_validation")
    text = script.testbed_tables(False, rows)
    assert "not modelled, powersgd1: no low-rank codec" in text
    assert "0 of 2 modelled rows within 15% (1 row the simulator does not model)." in text
    assert "compute (measured)" in text and "n/a" in text


@pytest.mark.skipif(
    not STEP_ENTRIES.exists(), reason="no benchmarks/results/sim-testbed-steps-1gbit.json"
)
def test_the_recorded_step_rows_all_get_a_prediction_or_a_reason():
    rows = compare_testbed_measurements(load_measurements(str(STEP_ENTRIES)))
    assert len(rows) == 24 and {r["kind"] for r in rows} == {"step"}
    assert (
        sum(r["status"] == "not modelled" for r in rows) == 4
    )  # PowerSGD rank 1 and 4, both models
    # (1 ulp of slack: a double-buffered step hidden entirely behind compute is compute itself)
    assert all(
        r["predicted_step_s"] >= r["compute_s"] * (1 - 1e-12)
        for r in rows
        if r["status"] != "not modelled"
    )


def test_a_miss_shows_the_cpu_one_rank_used_per_step():
    row = dict(_row("commopt-qsgd4-db", step=0.17, rounds=(0.17, 0.18), compute=0.074), cpu_s=0.16)
    entries = sim_export.sim_measurements(_report(rows=[row, _row("commopt-fp32")]))
    assert entries[0]["measured_cpu_s"] == 0.16 and "measured_cpu_s" not in entries[1]
    compared = compare_testbed_measurements([Measurement(**e) for e in entries])
    assert compared[0]["status"] == "miss" and compared[0]["measured_cpu_s"] == 0.16
    text = load_benchmark("sim_validation").render_step_table(False, compared)
    assert "one rank used 160 ms of CPU per step" in text
