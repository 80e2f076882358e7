"""The step profile (commopt.bench.profile_step): phases from frame names, threads' CPU from
their clocks, and one real profiled run of the step benchmark under py-spy."""

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

# Stacks as py-spy writes them (outermost first), trimmed from real profiles of the benchmark.
_STEP = [
    "_run_config (commopt/bench/step/worker.py:165)",
    "train_step (commopt/bench/step/worker.py:117)",
]
_LIBC = "0x7f5cb0ca3f16 (libc.so.6)"


@pytest.mark.parametrize(
    "frames,phase",
    [
        (
            _STEP
            + [
                "MultiNodeOptimizer.step (commopt/optim/multi_node.py:400)",
                "StepReduction.unpack (commopt/reducer.py:410)",
                "at::native::copy_ (libtorch_cpu.so)",
            ],
            "unpack",
        ),
        (
            _STEP
            + [
                "StepReduction._issue (commopt/reducer.py:335)",
                "GradientReducer.pack (commopt/reducer.py:218)",
                "at::native::copy_ (libtorch_cpu.so)",
                "memcpy (libc.so.6)",
            ],
            "pack",
        ),
        (
            _STEP
            + [
                "GradientReducer.pack (commopt/reducer.py:223)",
                "torch::autograd::THPVariable_sum (libtorch_python.so)",
                "at::native::sum_kernel (libtorch_cpu.so)",
            ],
            "NaN check",
        ),
        (
            [
                "Thread.run (threading.py:982)",
                "allreduce (commopt/collectives.py:300)",
                "QSGD.encode (commopt/codecs/qsgd.py:90)",
                "commopt_qsgd_encode (_cpu.cpython-311-x86_64-linux-gnu.so)",
            ],
            "encode",
        ),
        (
            [
                "Thread.run (threading.py:982)",
                "allreduce (commopt/collectives.py:300)",
                "QSGD.decode (commopt/codecs/qsgd.py:120)",
                "commopt_qsgd_decode (_cpu.so)",
            ],
            "decode",
        ),
        (
            [
                "Thread.run (threading.py:982)",
                "_TorchWork.wait (commopt/comm/torch_dist.py:60)",
                "c10d::Work::wait (libtorch_cpu.so)",
            ],
            "wait/poll",
        ),
        (
            [
                "Thread.run (threading.py:982)",
                "send (commopt/comm/torch_dist.py:80)",
                "gloo::transport::tcp::Pair::send (libtorch_cpu.so)",
            ],
            "send/receive",
        ),
        (
            _STEP
            + ["SGD.step (torch/optim/sgd.py:120)", "_single_tensor_sgd (torch/optim/sgd.py:300)"],
            "apply",
        ),
        (
            _STEP
            + [
                "Tensor.backward (torch/_tensor.py:623)",
                "torch::autograd::Engine::thread_main (libtorch_cpu.so)",
                "mkl_sgemm (libtorch_cpu.so)",
            ],
            "backward",
        ),
        (
            _STEP
            + [
                "_call_impl (torch/nn/modules/module.py:1750)",
                "forward (torch/nn/modules/linear.py:125)",
            ],
            "forward",
        ),
        (
            [
                "powerSGD_hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py:600)",
                "at::native::linalg_qr (libtorch_cpu.so)",
            ],
            "encode",
        ),
        (
            [
                "decompress (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py:700)",
                "at::native::mm (libtorch_cpu.so)",
            ],
            "decode",
        ),
        (["<module> (x.py:1)", "somewhere (elsewhere.py:3)"], "other"),
    ],
)
def test_samples_go_to_the_phase_their_frames_name(frames, phase):
    assert ps.classify(frames) == phase


def test_a_thread_asleep_in_a_wait_is_told_from_one_running():
    asleep = _STEP + [
        "FutureWork.wait (commopt/collectives.py:90)",
        "Condition.wait (threading.py:320)",
        "PyThread_acquire_lock_timed (libpython3.11.so.1.0)",
        "0x7f5cb0caed90 (libc.so.6)",
        _LIBC,
    ]
    running = _STEP + [
        "GradientReducer.pack (commopt/reducer.py:218)",
        "at::native::copy_ (libtorch_cpu.so)",
        _LIBC,
    ]
    assert ps.is_blocked(asleep) and not ps.is_blocked(running)
    # an asleep sample counts as time blocked in its phase, never as CPU
    threads = ps.attribute(
        [(7, "MainThread", asleep, 3), (7, "MainThread", running, 1)], {7: ("python", 0.04, 5, 1)}
    )
    assert threads[7]["samples"] == {"pack": 1} and threads[7]["blocked"] == {"wait/poll": 3}
    rows = pr.thread_rows({"steps": 2, "rate": 100, "wall_s": 0.04, "threads": {"7": threads[7]}})
    assert rows["training"]["pack"] == pytest.approx(20.0)  # 40 ms of CPU over 2 steps
    assert rows["training"]["blocked"] == pytest.approx(15.0)  # 3 of 4 samples of a 20 ms step


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
def test_step_bench_profile_runs_py_spy_on_every_rank(tmp_path):
    try:
        ps.pyspy_path()
    except RuntimeError as exc:
        pytest.skip(str(exc))
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
    assert main["cpu_s"] > 0 and sum(main["samples"].values()) + sum(main["blocked"].values()) > 0
    assert "profile of rank 0" in proc.stdout and (tmp_path / "p.png").stat().st_size > 0
    assert raw["rounds"][0]["codec_s"] > 0


def test_a_torch_op_called_from_python_is_not_backward():
    # torch binds every op as torch::autograd::THPVariable_*: that names no phase by itself
    frames = _STEP + [
        "GradientReducer.pack (commopt/reducer.py:218)",
        "torch::autograd::THPVariable_copy_ (libtorch_python.so)",
        "at::native::copy_ (libtorch_cpu.so)",
    ]
    assert ps.classify(frames) == "pack"
    gloo_callback = [
        "0x7f4a0bf278ec (libc.so.6)",
        "c10d::ProcessGroupGloo::runLoop (libtorch_cpu.so)",
        "powerSGD_hook.<locals>.compute_qs (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py:640)",
        "torch::autograd::THPVariable_matmul (libtorch_python.so)",
        "mkl_blas_def_xsgemm (libtorch_cpu.so)",
    ]
    assert ps.classify(gloo_callback) == "encode"


def test_kept_samples_can_be_classified_again_keeping_the_measured_cpu(tmp_path):
    stack = (
        "thread (11): MainThread;train_step (commopt/bench/step/worker.py:117);"
        "GradientReducer.pack (commopt/reducer.py:218);at::native::copy_ (libtorch_cpu.so) 9\n"
    )
    (tmp_path / "mlp-0.json.commopt-qsgd4.rank0.pyspy.txt").write_text(stack)
    old = {
        "name": "MainThread",
        "os_name": "python",
        "role": "training",
        "cpu_s": 0.5,
        "switches": 3,
        "preempted": 1,
        "samples": {"other": 9},
        "blocked": {},
        "unclassified": {},
    }
    report = {
        "models": {
            "mlp": {
                "raw": {
                    "commopt-qsgd4": {
                        "profile": {
                            "0": {"steps": 5, "rate": 100, "wall_s": 1.0, "threads": {"11": old}}
                        }
                    }
                }
            }
        }
    }
    assert pr.reattribute(report, str(tmp_path)) == 1
    new = report["models"]["mlp"]["raw"]["commopt-qsgd4"]["profile"]["0"]["threads"]["11"]
    assert new["samples"] == {"pack": 9} and new["cpu_s"] == 0.5 and new["switches"] == 3
