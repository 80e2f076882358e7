"""`commopt launch` without --link: command lines, rank environments, CLI errors, job control.

Real multi-rank runs of the plain mode live in tests/distributed/test_launch_local.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from commopt.cli import main
from commopt.testbed.jobs import TIMEOUT_EXIT, run_processes
from commopt.testbed.mpirun import mpirun_local_argv
from commopt.testbed.shaping import format_rate, parse_rate, tbf_command
from commopt.testbed.torch_dist import local_rank_specs

REPO = Path(__file__).resolve().parents[2]


_OUTER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


@pytest.fixture
def launch(monkeypatch, capfd):
    """Run `commopt launch ARGS` in this process; return (exit code, stdout, stderr)."""
    for var in _OUTER_VARS:
        monkeypatch.delenv(var, raising=False)

    def run(*args: str, env: dict | None = None):
        for k, v in (env or {}).items():
            monkeypatch.setenv(k, v)
        code = main(["launch", *args])
        out, err = capfd.readouterr()
        return code, out, err

    return run


# -- rates and shaping -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("2.5Gbit", 25 * 10**8),
        ("125mbps", 10**9),
        ("64kbit", 64_000),
        ("1gibit", 2**30),
        ("5000000", 5_000_000),
    ],
)
def test_parse_rate_reads_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["fast", "1 gigabit", "", "-1gbit", "1kbit"])
def test_parse_rate_rejects_with_an_example(text):
    with pytest.raises(ValueError, match=r"gbit|too slow"):
        parse_rate(text)


def test_format_rate():
    assert format_rate(1e9) == "1 Gbit/s"
    assert format_rate(9.55e8) == "955 Mbit/s"


def test_tbf_bucket_holds_a_millisecond_and_at_least_64k():
    line = tbf_command("d0", 10**9)
    assert line.startswith("qdisc add dev d0 root tbf rate 1000000000bit")
    burst = int(line.split("burst ")[1].split()[0])
    assert 125_000 <= burst <= 2 * 125_000
    slow = int(tbf_command("d0", 10**7).split("burst ")[1].split()[0])
    assert slow == 64 * 1024


# -- command lines -----------------------------------------------------------------------------


def test_mpirun_flags_for_root_and_oversubscription():
    argv = mpirun_local_argv(4, ["python", "t.py"], is_root=True, ncpus=2)
    assert argv[:3] == ["mpirun", "-n", "4"]
    assert "--allow-run-as-root" in argv and "--oversubscribe" in argv
    assert argv[-2:] == ["python", "t.py"]
    plain = mpirun_local_argv(2, ["python", "t.py"], is_root=False, ncpus=2)
    assert "--allow-run-as-root" not in plain and "--oversubscribe" not in plain
    # Every rank is local: TCP stays on loopback.
    i = plain.index("btl_tcp_if_include")
    assert plain[i + 1] == "lo"


def test_mpirun_fake_nodes_one_app_context_per_node():
    argv = mpirun_local_argv(5, ["x"], ranks_per_node=2, is_root=False, ncpus=8)
    contexts = " ".join(argv).split(" : ")
    assert len(contexts) == 3
    assert contexts[0].endswith("-n 2 -x COMMOPT_NODE_NAME=node0 x")
    assert contexts[1] == "-n 2 -x COMMOPT_NODE_NAME=node1 x"
    assert contexts[2] == "-n 1 -x COMMOPT_NODE_NAME=node2 x"


def test_torch_rank_env_matches_torchrun():
    specs = local_rank_specs(4, ["python", "t.py"], ranks_per_node=2, port=1234)
    env = [s.env for s in specs]
    assert [e["RANK"] for e in env] == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in env] == ["0", "1", "0", "1"]
    assert [e["GROUP_RANK"] for e in env] == ["0", "0", "1", "1"]
    assert {e["WORLD_SIZE"] for e in env} == {"4"}
    assert {e["LOCAL_WORLD_SIZE"] for e in env} == {"2"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["GLOO_SOCKET_IFNAME"]) for e in env} == {
        ("127.0.0.1", "1234", "lo")
    }
    assert [e["COMMOPT_NODE_NAME"] for e in env] == ["node0", "node0", "node1", "node1"]
    assert "COMMOPT_NODE_NAME" not in local_rank_specs(2, ["x"], port=1)[0].env


# -- the CLI -----------------------------------------------------------------------------------


def test_dry_run_prints_the_mpirun_line(launch):
    code, out, err = launch("-n", "4", "--dry-run", "--", "python", "train.py", "--lr", "0.1")
    assert code == 0, err
    line = out.strip()
    assert " mpirun -n 4 " in f" {line}" and line.endswith("python train.py --lr 0.1")
    assert ("--allow-run-as-root" in line) == (os.geteuid() == 0)
    assert "--oversubscribe" in line or (os.cpu_count() or 1) >= 4


def test_options_after_the_command_belong_to_it(launch):
    code, out, err = launch(
        "-n", "2", "--launcher", "torch", "--dry-run", "--", "prog", "-n", "7", "--link"
    )
    assert code == 0, err
    assert all(line.endswith("prog -n 7 --link") for line in out.splitlines())
    assert "WORLD_SIZE=2" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "2"], "give the command"),
        (["--", "true"], "-n N"),
        (["-n", "0", "--", "true"], "-n N"),
        (["-n", "2", "--ranks-per-host", "0", "--", "true"], "at least 1"),
        (["-n", "2", "--link", "1gbit", "--dry-run", "--", "true"], "without --link"),
    ],
)
def test_bad_input_gets_a_clear_error(launch, args, message):
    code, _, err = launch(*args)
    assert code == 2
    assert message in err


def test_bad_link_rate_is_explained(launch):
    code, _, err = launch("-n", "2", "--link", "quick", "--", "true")
    assert code == 2 and "1gbit" in err


def test_under_an_outer_launcher_runs_the_command_once(launch):
    outer = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    code, out, err = launch("-n", "2", "--", "sh", "-c", "echo ran", env=outer)
    assert code == 0, err
    assert out == "ran\n"
    code, _, err = launch("-n", "3", "--", "true", env=outer)
    assert code == 2 and "disagrees" in err
    code, _, err = launch("-n", "2", "--link", "1gbit", "--", "true", env=outer)
    assert code == 2 and "outside" in err


def _run_here(argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` in a fresh process on this checkout; its output as text."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=str(REPO), env=env)


def test_entry_point_runs_as_a_module():
    r = _run_here([sys.executable, "-m", "commopt", "launch", "-n", "2", "--dry-run", "--", "true"])
    assert r.returncode == 0, r.stderr
    assert "mpirun -n 2" in r.stdout


# -- job control -------------------------------------------------------------------------------


def test_first_failure_stops_the_others_and_its_code_is_returned():
    t = time.monotonic()
    code = run_processes([["sleep", "30"], ["sh", "-c", "exit 3"]])
    assert code == 3
    assert time.monotonic() - t < 15


def test_timeout_stops_the_job():
    t = time.monotonic()
    assert run_processes([["sleep", "30"]], timeout=0.5) == TIMEOUT_EXIT
    assert time.monotonic() - t < 10


def test_success_and_signals():
    assert run_processes([["true"], ["true"]]) == 0
    assert run_processes([["sh", "-c", "kill -TERM $$"]]) == 128 + 15


def test_missing_program_is_named():
    assert run_processes([["/nonexistent/prog"]]) == 127


def test_emulated_cluster_refuses_clearly_without_root(launch, monkeypatch):
    from commopt.testbed import TestbedUnavailable, emulated_cluster, unavailable_reason

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in unavailable_reason()
    with pytest.raises(TestbedUnavailable, match="needs root"), emulated_cluster(2, "1gbit"):
        pass
    code, _, err = launch("-n", "2", "--link", "1gbit", "--launcher", "torch", "--", "true")
    assert code == 2 and "cannot emulate a cluster here" in err and "root" in err


@pytest.mark.parametrize(
    "typo, fix",
    [
        ("--timout", "--timeout"),
        ("--dryrun", "--dry-run"),
        ("--lnk", "--link"),
        ("--launcer=torch", "--launcher"),
    ],
)
def test_an_unknown_option_before_the_command_is_an_error_with_a_suggestion(
    launch, capfd, typo, fix
):
    with pytest.raises(SystemExit) as info:
        launch("-n", "2", "--dry-run", typo, "60", "--", "echo", "ran")
    err = capfd.readouterr().err
    assert info.value.code == 2
    assert f"did you mean {fix}?" in err and "go after --" in err
    assert "ran" not in capfd.readouterr().out  # nothing was started


def test_an_unknown_option_of_another_subcommand_is_named(capfd):
    with pytest.raises(SystemExit):
        main(["tune", "--dryrun"])
    assert "did you mean --dry-run?" in capfd.readouterr().err


def test_launch_imports_no_torch():
    """`commopt launch` starts without torch (slow, and a Ctrl-C inside it was lost)."""
    r = _run_here(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "commopt",
            "launch",
            "-n",
            "2",
            "--launcher",
            "torch",
            "--dry-run",
            "--",
            "true",
        ]
    )
    assert r.returncode == 0, r.stderr
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if "|" in line]
    # (modules imported with importlib.import_module, as the subcommands are, get no line)
    assert "commopt.testbed.torch_dist" in imported and "torch" not in imported


DROPPED_CTRL_C = """
import os, signal, sys
from commopt.commands.signals import install_signal_handlers, raise_if_signalled

# As started from a terminal: a suite run in the background (`make test &`) hands its
# children SIGINT ignored, which install_signal_handlers rightly keeps.
signal.signal(signal.SIGINT, signal.default_int_handler)
install_signal_handlers()


class SignalledWhileDeleted:
    def __del__(self):  # Python drops an exception raised here ("Exception ignored in ...")
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(10000):
            pass


SignalledWhileDeleted()
print("the KeyboardInterrupt was dropped", flush=True)
raise_if_signalled()
print("lost", flush=True)
"""


def test_a_signal_whose_exception_python_dropped_is_raised_again():
    r = subprocess.run(
        [sys.executable, "-c", DROPPED_CTRL_C],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert "Exception ignored in" in r.stderr, r.stderr  # the first KeyboardInterrupt
    assert r.stdout.splitlines() == ["the KeyboardInterrupt was dropped"], (r.stdout, r.stderr)
    assert "in raise_if_signalled" in r.stderr and r.returncode != 0, r.stderr


LAUNCHER_EXIT = """
import os, signal, sys
from commopt.commands.signals import exit_status, install_signal_handlers

signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from a terminal
install_signal_handlers()


def escapes():  # a Ctrl-C that no handler on the way turned into a status
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10000):
        pass
    return 0


def ends(code):  # a Ctrl-C that comes after the job ended, as the interpreter exits
    def run():
        return code
    status = exit_status(run)
    os.kill(os.getpid(), signal.SIGINT)
    return status


raise SystemExit(exit_status(escapes) if sys.argv[1] == "escapes" else ends(3))
"""


@pytest.mark.parametrize(("case", "status"), [("escapes", 130), ("ends", 3)])
def test_the_launchers_status_is_never_its_death_by_ctrl_c(case, status):
    # Without exit_status, both processes die by SIGINT (status -2): an uncaught
    # KeyboardInterrupt makes the interpreter kill itself with that signal.
    r = subprocess.run(
        [sys.executable, "-c", LAUNCHER_EXIT, case],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert r.returncode == status, (r.returncode, r.stderr)
    assert ("interrupted; the job is stopped" in r.stderr) == (case == "escapes"), r.stderr


def test_a_failing_check_stops_the_processes_already_started():
    calls = []

    def check():
        calls.append(time.monotonic())
        if len(calls) > 3:  # two starts, then the job is running
            raise KeyboardInterrupt

    t = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_processes([["sleep", "29.25"], ["sleep", "29.25"]], check=check)
    assert time.monotonic() - t < 15
    gone = subprocess.run(["pgrep", "-f", "^sleep 29.25$"], capture_output=True, text=True)
    assert gone.stdout == "", f"processes left running: {gone.stdout}"
