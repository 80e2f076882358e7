"""The step profile (commopt.bench.profile_step): phases from the ranges of a torch.profiler
trace (self-time, nesting, threads), threads' CPU from their clocks, the table and plot, and
one real profiled run of the step benchmark."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from commopt.bench import profile_report as pr
from commopt.bench import profile_step as ps

REPO = Path(__file__).resolve().parents[2]


def ev(name, tid, ts, dur):
    return {"name": name, "tid": tid, "ts": ts, "dur": dur}


# One double-buffered commopt step as its trace records it (microseconds), trimmed: the
# training thread (11) and commopt's collectives thread (12); gloo's loop (13) opens nothing.
STEP = [
    ev("Optimizer.zero_grad#SGD.zero_grad", 11, 0, 10),
    ev("bench.forward", 11, 10, 100),
    ev("aten::linear", 11, 12, 90),
    ev("bench.backward", 11, 110, 400),
    ev("autograd::engine::evaluate_function: AddmmBackward0", 11, 120, 200),
    ev("commopt.pack", 11, 330, 50),
    ev("aten::copy_", 11, 335, 40),
    ev("bench.apply", 11, 520, 300),
    ev("commopt.wait", 11, 525, 150),
    ev("commopt.unpack", 11, 680, 40),
    ev("Optimizer.step#SGD.step", 11, 730, 80),
    ev("commopt.encode", 12, 400, 60),
    ev("commopt.transport", 12, 470, 200),
    ev("gloo:all_reduce", 12, 480, 150),
    ev("commopt.decode", 12, 680, 30),
    ev("commopt.agree", 12, 720, 20),
]


def test_a_phase_is_the_self_time_of_its_ranges_per_thread():
    spent = ps.phase_seconds(STEP)
    us = {tid: {k: round(v * 1e6) for k, v in d.items()} for tid, d in spent.items()}
    # backward's 400 less the 50 of pack nested in it; operators stay with their range
    assert us[11] == {
        "forward": 100,
        "backward": 350,
        "pack": 50,
        # 300 less wait and unpack; torch's Optimizer.step# range inside is apply too: once
        "apply": 110,
        "wait": 150,
        "unpack": 40,
    }
    # gloo's collective nested in commopt's transport: transport either way, never twice
    assert us[12] == {"encode": 60, "transport": 200, "decode": 30, "agree": 20}
    assert 13 not in us


def test_nested_ranges_never_count_twice_and_a_child_is_cut_at_its_parents_end():
    events = [
        ev("commopt.wait", 1, 0, 100),
        ev("commopt.transport", 1, 10, 30),
        ev("commopt.decode", 1, 15, 10),  # three deep
        ev("commopt.unpack", 1, 90, 50),  # ends after its parent: cut at 100
        ev("commopt.pack", 1, 200, 5),  # after the wait, at the top again
    ]
    us = {k: round(v * 1e6) for k, v in ps.phase_seconds(events)[1].items()}
    assert us == {"wait": 60, "transport": 20, "decode": 10, "unpack": 10, "pack": 5}
    assert sum(us.values()) == 105  # the thread's covered time, each microsecond once


def test_ranges_on_different_threads_do_not_nest():
    events = [ev("bench.backward", 1, 0, 100), ev("commopt.encode", 2, 10, 20)]
    us = {t: {k: round(v * 1e6) for k, v in d.items()} for t, d in ps.phase_seconds(events).items()}
    assert us == {1: {"backward": 100}, 2: {"encode": 20}}


def test_torch_ranges_of_ddp_name_their_phases_and_operators_name_none():
    assert ps.phase_of("torch::distributed::reducer::copy_") == "pack"
    assert ps.phase_of("torch.distributed.ddp.reducer::copy_bucket_to_grad") == "unpack"
    assert ps.phase_of("c10d::allreduce_") == ps.phase_of("gloo:all_reduce") == "transport"
    assert ps.phase_of("Optimizer.step#Adam.step") == "apply"
    assert ps.phase_of("DistributedDataParallel.forward") is None  # inside bench.forward
    assert ps.phase_of("aten::mm") is None and ps.phase_of("commopt.nonsense") is None
    with pytest.raises(ValueError, match="no step range"):
        ps.step_range("encode")


def test_attribute_joins_the_trace_to_each_threads_cpu_and_the_table_adds_up():
    cpu = {
        11: ("python", 0.0012, 6, 2),
        12: ("python", 0.0003, 4, 0),
        13: ("gloo_tcp_loop", 0.0001, 40, 1),
        14: ("python", 0.0, 0, 0),  # idle all along: left out
    }
    names = {11: "MainThread", 12: "commopt-collectives_0"}
    threads = ps.attribute(STEP, cpu, names)
    assert sorted(threads) == [11, 12, 13]
    assert threads[11]["role"] == "training" and threads[12]["role"] == "collectives driver"
    assert threads[13]["role"] == "gloo transport" and threads[13]["phase_s"] == {}
    prof = {"steps": 1, "wall_s": 0.001, "threads": {str(k): v for k, v in threads.items()}}
    rows = pr.thread_rows(prof)
    assert list(rows) == ["training", "collectives driver", "gloo transport"]
    train = rows["training"]
    # the training thread's phases and its other add up to the profiled step: 1 ms
    assert sum(train.get(p, 0.0) for p in pr.COLUMNS) == pytest.approx(1.0)
    assert train["other"] == pytest.approx(0.2)  # zero_grad and the 0.18 ms after the apply
    assert train["cpu"] == pytest.approx(1.2) and train["not running"] == 0.0
    # another thread: its ranges, then its CPU beyond them (all of it: no ranges)
    assert rows["collectives driver"]["other"] == 0.0  # 0.3 ms of CPU inside 0.31 of ranges
    assert rows["gloo transport"]["other"] == pytest.approx(0.1)
    text = pr.profile_table([("x", prof, {})])
    assert "x: all threads" in text and "not running" in text


def test_a_sampled_profile_still_renders_in_the_current_columns():
    old = {
        "steps": 2,
        "rate": 100,
        "wall_s": 0.2,
        "threads": {
            "1": {
                "role": "training",
                "cpu_s": 0.1,
                "samples": {"backward": 3, "NaN check": 1},
                "blocked": {"wait/poll": 16},
            },
            "2": {"role": "gloo transport", "cpu_s": 0.02, "samples": {}, "blocked": {}},
        },
    }
    rows = pr.thread_rows(old)
    assert rows["training"]["backward"] == pytest.approx(37.5)
    assert rows["training"]["pack"] == pytest.approx(12.5)  # the NaN check is in pack now
    assert rows["training"]["not running"] == pytest.approx(50.0)
    assert rows["gloo transport"]["other"] == pytest.approx(10.0)


def test_the_plot_draws_a_traced_and_a_sampled_profile(tmp_path):
    pytest.importorskip("matplotlib")
    cpu = {11: ("python", 0.0012, 6, 2), 12: ("python", 0.0003, 4, 0)}
    traced = ps.attribute(STEP, cpu, {11: "MainThread", 12: "commopt-collectives_0"})
    prof = {
        "steps": 1,
        "wall_s": 0.001,
        "plain_step_times": [0.0009],
        "threads": {str(k): v for k, v in traced.items()},
    }
    old = {
        "steps": 1,
        "wall_s": 0.001,
        "threads": {"1": {"role": "training", "cpu_s": 0.001, "samples": {"backward": 1}}},
    }
    pr.plot_profile([("a", prof, {"step_s": 0.0008}), ("b", old, {})], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_trace_events_reads_a_chrome_trace_torch_profiler_wrote(tmp_path):
    import torch

    from commopt import profiling

    cpu_only = [torch.profiler.ProfilerActivity.CPU]
    prof = profiling.profile(activities=cpu_only)
    with prof, ps.step_range("forward"), profiling.phase("pack"):
        torch.ones(64).sum()
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = ps.trace_events(tmp_path / "t.json")
    mine = [e for e in events if e["tid"] == threading.get_native_id()]
    assert {"bench.forward", "commopt.pack", "aten::sum"} <= {e["name"] for e in mine}
    spent = ps.phase_seconds(events)[threading.get_native_id()]
    assert set(spent) == {"forward", "pack"} and spent["pack"] > 0


def test_thread_cpu_reads_each_threads_own_clock():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, name="spinner")
    sleeper = threading.Thread(target=stop.wait, name="sleeper")
    spinner.start(), sleeper.start()
    before = ps.thread_cpu()
    time.sleep(0.3)
    after = ps.thread_cpu()
    stop.set()
    spinner.join(), sleeper.join()
    delta = ps.cpu_delta(before, after)
    spun, slept = delta[spinner.native_id][1], delta[sleeper.native_id][1]
    assert spun > 0.005 and slept < spun / 2, (spun, slept)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_step_bench_profile_traces_every_rank(tmp_path):
    out = tmp_path / "r.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commopt",
            "bench",
            "step",
            "--models",
            "tiny",
            "--configs",
            "commopt-qsgd4",
            "--no-link",
            "--rounds",
            "1",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--profile",
            "--profile-steps",
            "3",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
            "--profile-plot",
            str(tmp_path / "p.png"),
        ],
        capture_output=True,
        text=True,
        timeout=220,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    raw = json.loads(out.read_text())["models"]["tiny"]["raw"]["commopt-qsgd4"]
    assert sorted(raw["profile"]) == ["0", "1"]  # each rank profiled itself
    prof = raw["profile"]["0"]
    roles = {t["role"] for t in prof["threads"].values()}
    assert {"training", "collectives driver"} <= roles, roles
    main = next(t for t in prof["threads"].values() if t["role"] == "training")
    assert main["cpu_s"] > 0
    # the step's parts from the benchmark's ranges, commopt's from its own
    assert {"forward", "backward", "apply", "pack", "unpack"} <= set(main["phase_s"]), main
    driver = next(t for t in prof["threads"].values() if t["role"] == "collectives driver")
    assert {"encode", "transport", "decode"} <= set(driver["phase_s"]), driver
    assert len(prof["plain_step_times"]) == len(prof["step_times"]) == 3
    assert prof["cpu_s"] > 0 and prof["plain_cpu_s"] > 0
    assert "the same steps without the profiler" in proc.stdout
    assert (Path(tmp_path) / "work" / prof["trace"]).stat().st_size > 0  # kept for Perfetto
    assert "profile of rank 0" in proc.stdout and (tmp_path / "p.png").stat().st_size > 0
    assert raw["rounds"][0]["codec_s"] > 0
