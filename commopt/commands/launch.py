"""`commopt launch`: start N ranks here, or on an emulated cluster of slow links.

    $ commopt launch -n 2 -- python train.py                       # mpirun, this machine
    $ commopt launch -n 4 --launcher torch -- python train.py      # torch.distributed env
    $ commopt launch -n 4 --link 1gbit --ranks-per-host 2 -- python train.py
                                                        # 2 hosts joined by 1 Gbit/s links

Without --link the ranks run here (mpirun with the flags this machine needs: running as root,
more ranks than cores). With --link each host is a network namespace; see docs/testbed.md.
Run under mpirun, srun or torchrun already, it runs COMMAND once, as this rank.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys

from commopt.commands.signals import Terminated, raise_if_signalled, signal_behind

HELP = "run a command on N ranks, here or on an emulated cluster with shaped links"


def launch_argv(nprocs: int, *options: str) -> list[str]:
    """The command line of ``commopt launch -n NPROCS OPTIONS...`` run by this Python.

    >>> launch_argv(2, "--timeout", "60", "--")[1:]
    ['-m', 'commopt', 'launch', '-n', '2', '--timeout', '60', '--']
    """
    return [sys.executable, "-m", "commopt", "launch", "-n", str(nprocs), *options]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = (
        "commopt launch -n N [--link RATE [--ranks-per-host K]] "
        "[--launcher mpi|torch] -- COMMAND..."
    )
    parser.add_argument("-n", "--nprocs", type=int, help="number of ranks")
    parser.add_argument(
        "--link",
        metavar="RATE",
        help="emulate hosts joined by links of RATE, tc style: 1gbit, 100mbit "
        "(needs root; one host per --ranks-per-host ranks)",
    )
    parser.add_argument(
        "--ranks-per-host",
        type=int,
        metavar="K",
        help="ranks per (emulated) host; default 1 with --link. Without --link "
        "the ranks are told they sit on nodes of K (COMMOPT_NODE_NAME)",
    )
    parser.add_argument(
        "--launcher",
        choices=("mpi", "torch"),
        default="mpi",
        help="mpi: mpirun (default); torch: plain processes with "
        "torch.distributed's MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop the job after SECONDS (exit code 124)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command lines instead of running them (without --link)",
    )
    parser.add_argument(
        "--cleanup",
        action="store_true",
        help="remove namespaces left by emulated-cluster runs that were killed, then exit",
    )
    parser.add_argument(
        "command_args", nargs=argparse.REMAINDER, help="the command each rank runs, after --"
    )


def _fail(msg: str) -> int:
    print(f"commopt launch: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (KeyboardInterrupt, Terminated, Exception) as exc:
        # A signal's exception may reach here changed: raised inside ``__set_name__`` during
        # an import, Python turns it into a RuntimeError.
        signum = signal_behind(exc)
        if signum is None:
            raise
        if signum == signal.SIGINT:
            print("commopt launch: interrupted; the job is stopped", file=sys.stderr)
            return 130
        print(
            f"commopt launch: terminated by signal {signum}; the job is stopped",
            file=sys.stderr,
        )
        return 128 + signum


def _run(args: argparse.Namespace) -> int:
    raise_if_signalled()
    command = list(args.command_args or [])
    if command[:1] == ["--"]:
        command = command[1:]
    if args.cleanup:
        from commopt.testbed import cleanup_stale

        removed = cleanup_stale()
        print(
            f"removed {len(removed)} stale namespaces and work directories"
            + (f": {' '.join(removed)}" if removed else "")
        )
        return 0
    if not command:
        return _fail(
            "give the command to run after --, e.g. commopt launch -n 2 -- python train.py"
        )

    from commopt.comm.launcher import detect_launcher

    outer = detect_launcher()
    if outer.name != "none":
        return _run_as_outer_rank(args, outer, command)

    if args.nprocs is None or args.nprocs < 1:
        return _fail("say how many ranks with -n N (N >= 1)")
    from commopt.testbed.mpirun import drop_singleton_variables

    # Started by a process that ran MPI as a singleton (it imported mpi4py): the ranks
    # are a job of their own, not part of that one.
    drop_singleton_variables(os.environ)
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        return _fail("--ranks-per-host must be at least 1")
    if args.link is None:
        return _run_local(args, command)
    if args.dry_run:
        return _fail(
            "--dry-run shows runs without --link only: an emulated cluster's command "
            "lines name namespaces that exist only while it runs"
        )
    return _run_emulated(args, command)


def _run_as_outer_rank(args, outer, command: list[str]) -> int:
    if args.link is not None:
        return _fail(
            f"already running as rank {outer.rank} of {outer.size} under {outer.name}; "
            f"--link must start the ranks itself: run commopt launch outside it"
        )
    if args.nprocs is not None and args.nprocs != outer.size:
        return _fail(
            f"-n {args.nprocs} disagrees with the {outer.size} ranks {outer.name} "
            f"started; drop -n or make them match"
        )
    if args.dry_run:
        print(" ".join(command))
        return 0
    return subprocess.call(command)


def _thread_env(ranks_here: int) -> dict[str, str]:
    # Like torchrun: ranks sharing the cores should not each start a thread per core.
    if "OMP_NUM_THREADS" in os.environ or ranks_here <= 1:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks_here))}


def _run_local(args, command: list[str]) -> int:
    from commopt.testbed.jobs import run_processes

    n, k = args.nprocs, args.ranks_per_host
    env = _thread_env(n)
    if args.launcher == "mpi":
        from commopt.testbed.mpirun import mpirun_local_argv

        argv = mpirun_local_argv(n, command, ranks_per_node=k)
        if args.dry_run:
            print(_shell_line(argv, env))
            return 0
        if shutil.which("mpirun") is None:
            return _fail(
                "mpirun not found: install Open MPI (apt-get install openmpi-bin) "
                "or use --launcher torch"
            )
        return run_processes(
            [argv], envs=[env], names=["mpirun"], timeout=args.timeout, check=raise_if_signalled
        )
    from commopt.testbed.torch_dist import local_rank_specs

    specs = local_rank_specs(n, command, ranks_per_node=k)
    if args.dry_run:
        for s in specs:
            print(_shell_line(s.argv, {**env, **s.env}))
        return 0
    return run_processes(
        [s.argv for s in specs],
        envs=[{**env, **s.env} for s in specs],
        names=[f"rank {s.rank}" for s in specs],
        timeout=args.timeout,
        check=raise_if_signalled,
    )


def _run_emulated(args, command: list[str]) -> int:
    from commopt.testbed import TestbedUnavailable, emulated_cluster, format_rate, parse_rate
    from commopt.testbed.jobs import run_processes
    from commopt.testbed.shaping import FAITHFUL_LIMIT_BITS

    n = args.nprocs
    k = args.ranks_per_host or 1
    try:
        rate = parse_rate(args.link)
    except ValueError as exc:
        return _fail(str(exc))
    if rate > FAITHFUL_LIMIT_BITS:
        print(
            f"commopt launch: warning: above about {format_rate(FAITHFUL_LIMIT_BITS)} the "
            f"CPUs of this machine, not the shaper, may set the speed",
            file=sys.stderr,
        )
    if args.launcher == "mpi" and shutil.which("mpirun") is None:
        return _fail(
            "mpirun not found: install Open MPI (apt-get install openmpi-bin) "
            "or use --launcher torch"
        )
    n_hosts = math.ceil(n / k)
    env = _thread_env(n)
    try:
        with emulated_cluster(n_hosts, rate) as cluster:
            print(
                f"commopt launch: {n} ranks on {n_hosts} emulated hosts ({k} per host), "
                f"links {format_rate(rate)}; data {cluster.data_cidr} on "
                f"{cluster.data_ifname}, run {cluster.slot}",
                file=sys.stderr,
                flush=True,
            )
            if args.launcher == "mpi":
                from commopt.testbed.mpirun import mpirun_cluster_argv

                argv = cluster.head_argv(mpirun_cluster_argv(cluster, n, k, command))
                return run_processes(
                    [argv],
                    envs=[env],
                    names=["mpirun"],
                    timeout=args.timeout,
                    check=raise_if_signalled,
                )
            from commopt.testbed.torch_dist import cluster_rank_specs

            specs = cluster_rank_specs(cluster, n, k, command)
            return run_processes(
                [s.argv for s in specs],
                envs=[{**env, **s.env} for s in specs],
                names=[f"rank {s.rank}" for s in specs],
                timeout=args.timeout,
                check=raise_if_signalled,
            )
    except TestbedUnavailable as exc:
        return _fail(f"cannot emulate a cluster here: {exc}")


def _shell_line(argv: list[str], env: dict[str, str]) -> str:
    import shlex

    return " ".join(
        [f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv]
    )
