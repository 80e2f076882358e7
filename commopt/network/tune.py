"""`commopt tune`: sweep environment settings, measure each with `commopt bench allreduce`.

A grid is a list of ``NAME=v1,v2,...`` specs; the points are their cartesian product.
Lower-case names are Open MPI MCA parameters (``btl_tcp_links`` -> ``OMPI_MCA_btl_tcp_links``);
``A+B=...`` gives two variables the same value; sizes take K/M/G suffixes (binary):

    >>> points = parse_grid(["NCCL_SOCKET_NTHREADS=1,2", "NCCL_NSOCKS_PERTHREAD=4"])
    >>> [sorted(p.items()) for p in points]  # doctest: +NORMALIZE_WHITESPACE
    [[('NCCL_NSOCKS_PERTHREAD', '4'), ('NCCL_SOCKET_NTHREADS', '1')],
     [('NCCL_NSOCKS_PERTHREAD', '4'), ('NCCL_SOCKET_NTHREADS', '2')]]
    >>> parse_grid(["btl_tcp_eager_limit+btl_tcp_rndv_eager_limit=64K"])
    [{'OMPI_MCA_btl_tcp_eager_limit': '65536', 'OMPI_MCA_btl_tcp_rndv_eager_limit': '65536'}]

Each point runs the benchmark once (through ``commopt launch`` or a runner command of your
own), points are ranked by their mean bus bandwidth over the large messages (published
practice: socket settings matter above about 1 MB), and the best is written as an env file.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field

from commopt.network.doctor import NCCL_MAX_SOCKET_THREADS, NCCL_MAX_SOCKETS
from commopt.tables import table

# The default sweeps. NCCL over sockets: threads x sockets per thread (64 sockets at most).
# Open MPI over TCP: TCP connections per peer, and the eager/rendezvous switch-over size
# (the first fragment of a large message is at most the eager limit, so they move together).
# btl_tcp_links stops at 4: with 8, Open MPI 4.1.4 hung in the first large allreduce here
# (2 ranks, loopback and the emulated link alike).
DEFAULT_GRIDS = {
    "nccl": ["NCCL_SOCKET_NTHREADS=1,2,4,8", "NCCL_NSOCKS_PERTHREAD=1,2,4,8"],
    "mpi": ["btl_tcp_links=1,2,4", "btl_tcp_eager_limit+btl_tcp_rndv_eager_limit=64K,256K,1M"],
}
_SUFFIX = {"K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_LARGE_FROM = 2**20  # bytes; "large" messages for the ranking


# -- grids ------------------------------------------------------------------------------------
def env_name(name: str) -> str:
    """A grid name as an environment variable: lower-case names are Open MPI MCA parameters."""
    name = name.strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"{name!r} is not a variable name (letters, digits, _)")
    return f"OMPI_MCA_{name}" if name == name.lower() else name


def parse_value(text: str) -> str:
    """'64K' -> '65536' (binary suffixes K, M, G); anything else as written."""
    m = re.fullmatch(r"(\d+)([KMG])(?:i?B)?", text.strip(), re.I)
    return str(int(m.group(1)) * _SUFFIX[m.group(2).upper()]) if m else text.strip()


def _values(text: str) -> list[str]:
    # '|' separates values that themselves contain commas (e.g. lo,docker0|lo).
    parts = text.split("|") if "|" in text else text.split(",")
    out: list[str] = []
    for p in parts:
        m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", p) if "|" not in text else None
        if m and int(m.group(1)) <= int(m.group(2)):
            out += [str(v) for v in range(int(m.group(1)), int(m.group(2)) + 1)]
        elif p.strip():
            out.append(parse_value(p))
    return out


def parse_grid(specs: list[str]) -> list[dict[str, str]]:
    """Grid specs -> the list of points (dicts of environment variables), in sweep order."""
    axes: list[tuple[list[str], list[str]]] = []
    seen: set[str] = set()
    for spec in specs:
        if "=" not in spec:
            raise ValueError(
                f"grid spec {spec!r} needs NAME=v1,v2,... (e.g. NCCL_SOCKET_NTHREADS=1,2,4)"
            )
        names_text, values_text = spec.split("=", 1)
        names = [env_name(n) for n in names_text.split("+")]
        values = _values(values_text)
        if not values:
            raise ValueError(f"grid spec {spec!r} has no values")
        for n in names:
            if n in seen:
                raise ValueError(f"{n} appears twice in the grid")
            seen.add(n)
        axes.append((names, values))
    points = []
    for combo in itertools.product(*(values for _, values in axes)):
        point: dict[str, str] = {}
        for (names, _), value in zip(axes, combo):
            for n in names:
                point[n] = value
        points.append(point)
    return points


def skip_reason(point: dict[str, str]) -> str | None:
    """Why a point is not worth running (the transport would silently change it), or None."""

    def num(name):
        try:
            return int(point[name]) if name in point else None
        except ValueError:
            return None

    nt, ns = num("NCCL_SOCKET_NTHREADS"), num("NCCL_NSOCKS_PERTHREAD")
    if nt is not None and nt > NCCL_MAX_SOCKET_THREADS:
        return f"NCCL caps NCCL_SOCKET_NTHREADS at {NCCL_MAX_SOCKET_THREADS}"
    if nt is not None and ns is not None and nt * ns > NCCL_MAX_SOCKETS:
        return f"{nt} x {ns} sockets: NCCL caps the product at {NCCL_MAX_SOCKETS}"
    eager, rndv = num("OMPI_MCA_btl_tcp_eager_limit"), num("OMPI_MCA_btl_tcp_rndv_eager_limit")
    if eager is not None and rndv is not None and rndv > eager:
        return "Open MPI needs btl_tcp_rndv_eager_limit <= btl_tcp_eager_limit"
    return None


# -- benchmark output ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRow:
    nbytes: int
    busbw: float  # GB/s


_SIZE_KEYS = ("bytes", "nbytes", "size_bytes", "size")
_BUSBW_KEYS = {
    "busbw_gbps": 1.0,
    "busbw_GBps": 1.0,
    "busbw": 1.0,
    "busbw_bytes_per_s": 1e-9,
    "busbw_Bps": 1e-9,
}


def parse_bench_output(text: str) -> list[BenchRow]:
    """Rows (message size, bus bandwidth in GB/s) from `commopt bench allreduce --json` output.

    Takes the last JSON document in ``text`` (launchers may print other lines around it): a
    list of rows, or an object holding them under "results" or "rows". Each row names its
    size in bytes and its bus bandwidth (GB/s, or bytes/s under ``busbw_bytes_per_s``).
    """
    doc = _last_json(text)
    rows = doc.get("results", doc.get("rows")) if isinstance(doc, dict) else doc
    if not isinstance(rows, list) or not rows:
        raise ValueError(
            "benchmark output has no rows (expected a JSON list, or an object with "
            f"'results'); got: {text[-300:]!r}"
        )
    codecs = list(dict.fromkeys(row.get("codec") for row in rows if isinstance(row, dict)))
    if len(codecs) > 1:
        raise ValueError(f"benchmark output mixes codecs {codecs}: rank one codec at a time")
    out = []
    for row in rows:
        size = next((row[k] for k in _SIZE_KEYS if k in row), None)
        key = next((k for k in _BUSBW_KEYS if k in row), None)
        if size is None or key is None:
            raise ValueError(f"benchmark row without a size or busbw: {row}")
        out.append(BenchRow(int(size), float(row[key]) * _BUSBW_KEYS[key]))
    return sorted(out, key=lambda r: r.nbytes)


def _last_json(text: str):
    decoder = json.JSONDecoder()
    last, i = None, 0
    while True:
        starts = [j for j in (text.find("{", i), text.find("[", i)) if j >= 0]
        if not starts:
            break
        j = min(starts)
        try:
            obj, end = decoder.raw_decode(text, j)
        except json.JSONDecodeError:
            i = j + 1
            continue
        if isinstance(obj, (dict, list)) and obj:
            last = obj
        i = end
    if last is None:
        raise ValueError(f"no JSON in the benchmark output: {text[-300:]!r}")
    return last


# -- ranking ---------------------------------------------------------------------------------------
@dataclass
class PointResult:
    point: dict[str, str]
    rows: list[BenchRow] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    run_scores: list[float] = field(default_factory=list)  # one per repeat (merge_runs)

    def score(self, large_from: int = DEFAULT_LARGE_FROM) -> float:
        """Mean bus bandwidth (GB/s) over messages >= large_from (the largest one if none)."""
        if not self.rows:
            return float("nan")
        large = [r for r in self.rows if r.nbytes >= large_from] or [self.rows[-1]]
        return sum(r.busbw for r in large) / len(large)


def rank(results: list[PointResult], large_from: int = DEFAULT_LARGE_FROM) -> list[PointResult]:
    """Measured points, best first (failed points last, in sweep order)."""
    ok = [r for r in results if r.rows and not r.error]
    failed = [r for r in results if not (r.rows and not r.error)]
    return sorted(ok, key=lambda r: -r.score(large_from)) + failed


def describe(point: dict[str, str]) -> str:
    return " ".join(f"{k.removeprefix('OMPI_MCA_')}={v}" for k, v in point.items()) or "(defaults)"


def _size(n: int) -> str:
    for unit, div in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def format_table(ranked: list[PointResult], large_from: int = DEFAULT_LARGE_FROM) -> str:
    """The ranked table: score, ratio to the defaults point, busbw at each large size."""
    sizes = sorted(
        {r.nbytes for res in ranked for r in res.rows if r.nbytes >= large_from}
    ) or sorted({res.rows[-1].nbytes for res in ranked if res.rows})
    base = next((r for r in ranked if not r.point and r.rows), None)
    spread = any(len(r.run_scores) > 1 for r in ranked)
    head = (
        ["#", "setting", "score GB/s"]
        + (["runs min-max"] if spread else [])
        + ["vs defaults"]
        + [f"{_size(s)} GB/s" for s in sizes]
    )
    body = []
    for i, res in enumerate(ranked, 1):
        if res.error or not res.rows:
            body.append([str(i), describe(res.point), "failed", "", (res.error or "no rows")[:60]])
            continue
        by = {r.nbytes: r.busbw for r in res.rows}
        ratio = (
            f"{res.score(large_from) / base.score(large_from):.2f}x"
            if base and base.score(large_from) > 0
            else ""
        )
        runs = (
            [f"{min(res.run_scores):.3g}-{max(res.run_scores):.3g}" if res.run_scores else ""]
            if spread
            else []
        )
        body.append(
            [str(i), describe(res.point), f"{res.score(large_from):.4g}", *runs, ratio]
            + [f"{by[s]:.4g}" if s in by else "" for s in sizes]
        )
    ncols = max(len(row) for row in [head] + body)
    return table(head + [""] * (ncols - len(head)), body, align="l" * ncols)


def env_file_text(
    best: PointResult,
    *,
    command: str,
    large_from: int = DEFAULT_LARGE_FROM,
    baseline: PointResult | None = None,
) -> str:
    """The env file for the best point: `source` it, or pass it to `commopt launch`/docker."""
    score = best.score(large_from)
    lines = [
        "# Written by commopt tune on " + time.strftime("%Y-%m-%d %H:%M:%S"),
        f"# command: {comment_safe(command)}",
        f"# best of the sweep: mean all-reduce bus bandwidth {score:.4g} GB/s over messages "
        f">= {_size(large_from)}"
        + (
            f" ({score / baseline.score(large_from):.2f}x the defaults' "
            f"{baseline.score(large_from):.4g} GB/s)"
            if baseline and baseline.score(large_from) > 0
            else ""
        ),
    ]
    if not best.point:
        lines.append("# the defaults won: nothing to export")
    lines += [f"export {env_name(k)}={shlex.quote(v)}" for k, v in best.point.items()]
    return "\n".join(lines) + "\n"


def comment_safe(text: str) -> str:
    """``text`` on one comment line: a newline in it would end the comment and run as shell.

    >>> comment_safe("python -c 'x\\nrm -rf ~'")
    "python -c 'x\\\\nrm -rf ~'"
    """
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def write_env_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temporary file beside it, then a rename.

    A reader never sees half a file, and a symlink at ``path`` is replaced, not followed.
    """
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # what open(path, "w") would have given, not mkstemp's 0600
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# -- running ----------------------------------------------------------------------------------------
def run_point(
    point: dict[str, str],
    argv: list[str],
    *,
    timeout: float,
    base_env: dict[str, str] | None = None,
) -> PointResult:
    """Run the benchmark command once with ``point`` added to the environment."""
    env = dict(os.environ if base_env is None else base_env)
    env.update(point)
    start = time.monotonic()
    # Its own session, so a timeout stops the launcher and every rank it started.
    proc = subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return PointResult(
            point, error=f"timed out after {timeout:.0f}s", seconds=time.monotonic() - start
        )
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        tail = (err or out).strip().splitlines()[-3:]
        return PointResult(
            point, error=f"exit code {proc.returncode}: {' | '.join(tail)}", seconds=seconds
        )
    try:
        return PointResult(point, rows=parse_bench_output(out), seconds=seconds)
    except ValueError as exc:
        return PointResult(point, error=str(exc), seconds=seconds)


def _stop(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """Interrupt the launcher's whole process group (so it can clean up, e.g. the emulated
    cluster's namespaces), then kill what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue


def merge_runs(runs: list[PointResult], large_from: int = DEFAULT_LARGE_FROM) -> PointResult:
    """One result from repeated runs of a point: the median busbw at each size.

    A failed run fails the point (a setting that sometimes hangs is not a good setting).
    """
    point = runs[0].point
    seconds = sum(r.seconds for r in runs)
    errors = [r.error for r in runs if r.error or not r.rows]
    if errors:
        return PointResult(
            point, error=f"{len(errors)} of {len(runs)} runs failed: {errors[0]}", seconds=seconds
        )
    sizes = sorted({row.nbytes for r in runs for row in r.rows})
    rows = []
    for n in sizes:
        values = sorted(row.busbw for r in runs for row in r.rows if row.nbytes == n)
        mid = len(values) // 2
        median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        rows.append(BenchRow(n, median))
    return PointResult(
        point, rows=rows, seconds=seconds, run_scores=[r.score(large_from) for r in runs]
    )


def sweep(
    points: list[dict[str, str]],
    argv: list[str],
    *,
    timeout: float = 300,
    repeats: int = 1,
    progress=None,
    large_from: int = DEFAULT_LARGE_FROM,
) -> list[PointResult]:
    """Run every point ``repeats`` times; ``progress(i, total, result)`` after each run.

    Repeats go round-robin over the points (all points, then all again), so a slow drift of
    the machine or the network spreads over every point instead of favouring some.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs: list[list[PointResult]] = [[] for _ in points]
    total, done = len(points) * repeats, 0
    for _ in range(repeats):
        for i, point in enumerate(points):
            if any(r.error for r in runs[i]):
                total -= 1  # a point that failed once is not run again
                continue
            res = run_point(point, argv, timeout=timeout)
            runs[i].append(res)
            done += 1
            if progress is not None:
                progress(done, total, res)
    return [merge_runs(r, large_from) for r in runs]
