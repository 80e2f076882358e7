"""The gradient's path, traced: every commopt call one gradient's reduction makes, by thread.

One rank script per rank (under mpirun, ``--comm mpi``; or ``--comm torch``): a one-tensor
model (one gradient, one bucket), ``create_multi_node_optimizer`` with the synchronous
schedule (overlap on) and ``qsgd4+ef``; after two warm-up steps, one more backward is traced
with ``sys.setprofile``/``threading.setprofile`` on every thread from the gradient's hook to
``backward()`` returning (the averages in ``.grad``). Rank 0 prints a JSON record: each call
(thread, file, function, depth), the distinct files, functions and threads, the single-thread
queues crossed (the driver's and the ``mpi`` transport's workers), and the calls that only
forward (a function whose body, past its docstring, is one call whose result it returns or
discards, optionally inside a ``with``): the method behind docs/design.md's path table.

    mpirun -np 2 python benchmarks/gradient_path.py --comm mpi > path.json
    python benchmarks/gradient_path.py --launch torch > path.json  # 2 gloo ranks, no mpirun
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import threading
from collections import Counter
from pathlib import Path

import torch

import commopt

ROOT = Path(commopt.__file__).resolve().parent
EXCLUDED = ("/profiling.py",)  # the phase timer's context managers: not a hop


def forwards_only(code) -> bool:
    """Whether a function's body (past its docstring) is one call it returns or discards,
    optionally inside a ``with`` (a hop that does no work of its own)."""
    try:
        lines, _ = inspect.getsourcelines(code)
        tree = ast.parse("".join(_dedent(lines)))
    except (OSError, SyntaxError, TypeError):
        return False
    fn = tree.body[0]
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    body = list(fn.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    while len(body) == 1 and isinstance(body[0], ast.With):
        if any(
            isinstance(i.context_expr, ast.Call)
            and getattr(i.context_expr.func, "id", None) == "phase"
            for i in body[0].items
        ):
            return False  # a profiler range: see labels_a_phase
        body = body[0].body
    if len(body) != 1:
        return False
    stmt = body[0]
    call = stmt.value if isinstance(stmt, (ast.Return, ast.Expr)) else None
    if not isinstance(call, ast.Call):
        return False
    # Forwarding: the arguments are the function's own, passed on unchanged (a call that
    # adds or computes an argument adapts, and a ``with`` other than a profiler range counts).
    own = {a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)}
    own |= {a.arg for a in (fn.args.vararg, fn.args.kwarg) if a is not None}
    passed = [*call.args, *(k.value for k in call.keywords)]
    return all(
        (isinstance(a, ast.Name) and a.id in own)
        or (isinstance(a, ast.Starred) and isinstance(a.value, ast.Name) and a.value.id in own)
        for a in passed
    )


def labels_a_phase(code) -> bool:
    """Whether a function's body is a profiler range (``with phase(...)``) around one call:
    the range is its work (``commopt.profiling``)."""
    try:
        lines, _ = inspect.getsourcelines(code)
        fn = ast.parse("".join(_dedent(lines))).body[0]
    except (OSError, SyntaxError, TypeError, IndexError):
        return False
    body = [
        b
        for b in getattr(fn, "body", [])
        if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))
    ]
    return (
        len(body) == 1
        and isinstance(body[0], ast.With)
        and len(body[0].body) == 1
        and isinstance(getattr(body[0].body[0], "value", None), ast.Call)
        and any(
            isinstance(i.context_expr, ast.Call)
            and getattr(i.context_expr.func, "id", None) == "phase"
            for i in body[0].items
        )
    )


def _dedent(lines: list[str]) -> list[str]:
    indent = len(lines[0]) - len(lines[0].lstrip())
    return [line[indent:] if len(line) > indent else line for line in lines]


def trace_one_gradient(comm_name: str) -> dict:
    calls: list[dict] = []
    lock = threading.Lock()
    depth: dict[int, int] = {}
    active = threading.Event()

    def profile(frame, event, arg):
        if not active.is_set() or event not in ("call", "return"):
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(str(ROOT)) or path.endswith(EXCLUDED):
            return
        tid = threading.get_ident()
        with lock:
            d = depth.get(tid, 0)
            if event == "return":
                depth[tid] = max(0, d - 1)
                return
            depth[tid] = d + 1
            calls.append(
                {
                    "thread": threading.current_thread().name,
                    "file": str(Path(path).relative_to(ROOT.parent)),
                    "function": code.co_qualname,
                    "depth": d,
                    "code": code,
                }
            )

    # Threads started from here on (the driver's, the transport's) run the profile too; it
    # records only while ``active`` is set.
    threading.setprofile(profile)
    sys.setprofile(profile)
    comm = commopt.create_communicator(comm_name)
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(512, 256))  # one gradient, one bucket (qsgd4)
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD([weight], lr=0.01), comm, compression="qsgd4+ef"
    )

    def backward(step: int) -> None:
        g = torch.Generator().manual_seed(step * 10 + comm.rank)
        (weight * torch.randn(512, 256, generator=g)).sum().backward()

    for step in range(2):  # warm-up: buffers, kernels, the private communicator's threads
        opt.zero_grad()
        backward(step)
        opt.step()
    opt.zero_grad()
    comm.barrier()
    active.set()
    try:
        backward(2)  # returns with the averages in .grad (overlap: finished at its end)
        opt.wait()
    finally:
        active.clear()
        sys.setprofile(None)
        threading.setprofile(None)
    opt.step()
    opt.close()
    funcs = Counter((c["file"], c["function"]) for c in calls)
    forwarding = sorted({f"{c['file']}:{c['function']}" for c in calls if forwards_only(c["code"])})
    phases = sorted({f"{c['file']}:{c['function']}" for c in calls if labels_a_phase(c["code"])})
    for c in calls:
        del c["code"]
    threads = sorted({c["thread"] for c in calls})
    # The hops in series: the call stack under which the gradient is handed to the driver
    # (the hook's thread) and to the transport (the collectives thread).
    chains = {}
    for target in ("commopt/driver.py:Driver.submit", "MPICommunicator._submit"):
        stack: dict[str, list[str]] = {}
        for c in calls:
            here = stack.setdefault(c["thread"], [])
            del here[c["depth"] :]
            here.append(f"{c['function']}")
            if f"{c['file']}:{c['function']}".endswith(target):
                chains[target.rsplit(":", 1)[-1]] = list(here)
                break
    return {
        "comm": comm_name,
        "ranks": comm.size,
        "calls": len(calls),
        "functions": len(funcs),
        "files": len({f for f, _ in funcs}),
        "threads": threads,
        "queues": [t for t in threads if t.startswith(("commopt-collectives", "commopt-mpi"))],
        "chains": chains,
        "forwarding_only": forwarding,
        "profiler_ranges": phases,
        "by_thread": dict(Counter(c["thread"] for c in calls)),
        "sequence": [
            f"{c['thread']}|{'  ' * c['depth']}{c['file']}:{c['function']}" for c in calls
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comm", default="mpi", choices=("mpi", "torch"))
    parser.add_argument(
        "--launch", choices=("torch",), help="start 2 torch.distributed ranks (gloo) itself"
    )
    args = parser.parse_args()
    if args.launch:
        from commopt.bench import harness

        rank = [sys.executable, str(Path(__file__).resolve()), "--comm", "torch"]
        harness.launch(2, rank, launcher="torch", timeout=600, capture=False)
        return
    record = trace_one_gradient(args.comm)
    if _rank() == 0:
        print(json.dumps(record, indent=1))


def _rank() -> int:
    from commopt.comm.launcher import detect_launcher

    return detect_launcher().rank


if __name__ == "__main__":
    main()
