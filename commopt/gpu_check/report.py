"""The device check's markdown report, rendered from its result file (or from none yet).

docs/benchmarks-gpu.md is this page for the recorded result, benchmarks/results/gpu-check.json
(``python3 -m commopt.gpu_check --docs`` writes it).

    >>> "No GPU run has been recorded" in render(None)
    True
"""

from __future__ import annotations

COMMAND = "bash scripts/gpu_check.sh"
RECORDED = "benchmarks/results/gpu-check.json"
#: what was found about the recorded run after it (fixes, reruns), appended to the page.
NOTES = "benchmarks/results/gpu-check-notes.md"

RUNNING = f"""\
## Running the check

On a machine with a CUDA GPU, as it comes (its `python3`, no network), from the repository's
root:

    OUT=/tmp/gpu-check {COMMAND}

It uses the `python3` on the PATH (or `$GPU_CHECK_PYTHON`) with this tree on `PYTHONPATH`,
finishes within 8 minutes (a preflight of up to 45 s, then a 420 s budget the stages share)
and rewrites `gpu-check.json`, `gpu-check.md` and `gpu-check-logs.txt` in `$OUT` after every
stage, so a run stopped from outside keeps what it finished. The preflight records the
interpreter, `nvidia-smi`, each package (`mpi4py.MPI` too), CUDA, the compiler and which MPI's
`mpirun` is on the PATH; a machine whose `nvidia-smi` lists a GPU that torch cannot use fails
its GPU stages rather than running their CPU stand-ins. mpi4py installs without an MPI
library: where none loads, the runs that need MPI say "not run: no MPI library" and the rest
run (`pure_nccl` needs none in a world of one). To bring MPI along, put the mpich wheel in
`.whl/` (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
manylinux_2_28_x86_64 -d .whl mpich`): the script then serves MPI singletons from its
`libmpi.so.12` (`MPI4PY_LIBMPI`). An MPICH `mpirun` gets MPICH's flags. Copy
`gpu-check.json` to `{RECORDED}` and render this page (with the notes in `{NOTES}`):

    python3 -m commopt.gpu_check --docs

Without a GPU, `python3 -m commopt.gpu_check --rehearse` runs the same stages with CPU
stand-ins (CI does), and `bash scripts/gpu_rehearsal.sh` does so on the GPU image's versions
(Python 3.12, torch 2.11.0, triton 3.6.0, NumPy 2.5, mpi4py), with and without an MPI library.
"""

SCOPE = """\
## What one GPU proves, and what needs several

The check runs on one machine with one GPU, as it comes (the image's `python3`, no network).
It proves:

- the Triton codec kernels, compiled for that GPU, write the reference's bits (every bit
  width and rounding mode, both encode paths, the casts, ragged sizes, and one buffer above
  2^31 bytes when the memory allows), and how fast they run against a device copy;
- `pure_nccl` and `torch` with the nccl backend run every codec through the collectives on
  CUDA tensors, in a world of one (one rank: NCCL runs, but no byte crosses a link);
- CUDA tensors reduce correctly between two ranks over gloo (and MPI where `mpirun` exists),
  both ranks sharing the one GPU, including a buffer filled late on a side stream;
- the double-buffered and the overlapped training steps make no host synchronisation (torch's
  `set_sync_debug_mode`), and torch's stream sanitizer finds no race in them (world of one);
- the Transformer recipe's fp16 (dynamic loss scaling) and bf16 steps train on the GPU.

Only a machine with several GPUs can show:

- NCCL between two or more ranks (`pure_nccl` or torch's nccl backend): NCCL refuses two
  ranks on one device, so every NCCL transfer between ranks, its stream ordering across ranks
  and the hierarchical (intra-node, inter-node) plans need one GPU per rank
  (tests/gpu/test_pure_nccl.py: `test_pure_nccl_two_gpus`, `test_pure_nccl_hierarchical_four_gpus`);
- overlap of communication with computation across real links, and the time per step, since a
  world of one moves no byte;
- a dead or slow peer during an NCCL collective.
"""


def docs_page(root) -> str:
    """docs/benchmarks-gpu.md: the recorded result's report, then the notes kept beside it."""
    import json
    from pathlib import Path

    recorded, notes = Path(root) / RECORDED, Path(root) / NOTES
    text = render(json.loads(recorded.read_text()) if recorded.exists() else None)
    if notes.exists():
        text = text.rstrip("\n") + "\n\n" + notes.read_text()
    return text


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(result: dict | None) -> str:
    """The report of one result file's contents; with None, the page before any GPU run.
    Paths into the checkout the check ran from are shown relative to it."""
    return _relative(_render(result))


def _relative(text: str) -> str:
    r"""Tracebacks' paths into a checkout, relative to it (the machine's folders say nothing).

    >>> _relative('File "/srv/x/commopt/gpu_check/runner.py", line 3')
    'File "commopt/gpu_check/runner.py", line 3'
    """
    import re

    return re.sub(r'"/[^"\s]*?/((?:commopt|tests|benchmarks|recipes|scripts)/)', r'"\1', text)


def _render(result: dict | None) -> str:
    lines = ["# GPU check", ""]
    if result is None:
        lines += ["No GPU run has been recorded yet.", "", RUNNING, SCOPE]
        return "\n".join(lines)
    env = result.get("environment") or {}
    where = env.get("device") or "no GPU"
    if result.get("rehearse"):
        lines += ["A rehearsal on a machine without a GPU: CPU stand-ins, no GPU figures.", ""]
    lines += [
        f"Device: {where}; torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda') or '-'}), "
        f"triton {env.get('triton') or '-'}, CuPy {env.get('cupy') or '-'}, NCCL "
        f"{env.get('nccl') or '-'}, python {env.get('python', '?')}; mpirun "
        f"{'found' if env.get('mpirun') else 'not found'}; host {env.get('host', '?')}.",
        "",
        f"Command: `{result['command']}`, {result['started']}; {result['wall_s']:.0f} s of a "
        f"{result['budget_s']:.0f} s budget. Result: {result['verdict']}.",
        "",
        "| stage | status | s | notes |",
        "|---|---|---|---|",
    ]
    for stage in result["stages"]:
        lines.append(
            f"| {stage['title']} | {stage['status']} | {stage['wall_s']:.1f} | {_note(stage)} |"
        )
    for stage in result["stages"]:
        body = _SECTIONS.get(stage["name"], _generic)(stage)
        if body:
            lines += ["", f"## {stage['title']}", "", *body]
    lines += ["", RUNNING, SCOPE]
    return "\n".join(lines)


def _note(stage: dict) -> str:
    """What ran and what did not: the reason, the runs made, the runs left out and why."""
    parts = [stage.get("reason") or ""]
    standin = stage.get("standin")
    if standin:
        parts.append(f"stand-in {standin['status']}")
        if standin.get("reason"):
            parts[-1] += f" ({standin['reason']})"
    details = _details(stage)
    runs = details.get("runs")
    if isinstance(runs, dict) and runs:
        parts.append("ran " + ", ".join(runs))
    if details.get("not_run"):
        parts.append(details["not_run"])
    note = "; ".join(p for p in parts if p)
    return note.replace("|", "/").replace("\n", " ")[:400]


def _details(stage: dict) -> dict:
    if stage.get("standin"):
        return stage["standin"].get("details") or {}
    return stage.get("details") or {}


def _generic(stage: dict) -> list[str]:
    out = []
    if stage.get("traceback"):
        out += ["```", stage["traceback"].strip()[-1500:], "```"]
    return out


def _triton(stage: dict) -> list[str]:
    d = _details(stage)
    cases = d.get("cases") or []
    if not cases:
        return _generic(stage)
    ok = sum(1 for c in cases if c.get("ok"))
    out = [
        f"{ok} of {len(cases)} cases bit-exact ({d.get('planned', '?')} planned); "
        f"{_fmt(d.get('compiled_variants'))} kernel specialisations compiled.",
        "",
        "| case | result | s |",
        "|---|---|---|",
    ]
    for c in cases:
        verdict = "exact" if c.get("ok") else (c.get("skipped") or c.get("error") or "differs")
        out.append(f"| {c['case']} | {verdict} | {_fmt(c.get('s'), 2)} |")
    if d.get("first_traceback"):
        out += ["", "The first error:", "", "```", d["first_traceback"].strip()[-1500:], "```"]
    return out + _generic(stage)


def _throughput(stage: dict) -> list[str]:
    d = _details(stage)
    sizes = d.get("sizes") or []
    if not sizes:
        return _generic(stage)
    target = d.get("target", 0.7)
    timing = sizes[0].get("timing", "best of the calls launched alone")
    out = [
        f"GB/s of float32 input; the copy is `dst.copy_(src)` of the same buffer, measured in "
        f"the same run (benchmarks/gpu_bench.py's measurement; {timing}). Target: encode >= "
        f"{target:.0%} of the copy at 64 MiB and above (reported, not a failure of the check). "
        "`limit`: the encode's best share of the copy at equal memory bandwidth (the copy moves "
        "8 bytes per element; an encode reads 4 and writes its wire; error feedback also reads "
        "and writes the residual). `alone`: one call launched with nothing queued.",
        "",
    ]
    # the rows come from the benchmark's own table (benchmarks/gpu_bench.py codec_table)
    return out + list(d.get("table") or []) + _generic(stage)


def _runs(stage: dict) -> list[str]:
    d = _details(stage)
    runs = d.get("runs") or {}
    out = [f"Not run: {d['not_run']}.", ""] if d.get("not_run") else []
    for label, run in runs.items():
        out.append(
            f"- {label} ({run['launcher']} launcher, {run['wall_s']:.1f} s): "
            + ("; ".join(run.get("failures", [])) or "passed")
        )
        if "sanitizer_reports" in run:
            out.append(f"  - sanitizer reports: {run['sanitizer_reports']}")
        if "printed_host_syncs" in run:
            out.append(
                f"  - host syncs torch printed (outside Python calls): {run['printed_host_syncs']}"
            )
        out += [
            f"  - rank {rank}: {line}"
            for rank, details in enumerate(run.get("ranks") or [])
            for line in _rank_lines(details or {})
        ]
        for tb in run.get("tracebacks") or []:
            out += ["", "```", tb.strip()[-1500:], "```"]
    return out + _generic(stage)


def _rank_lines(d: dict) -> list[str]:
    lines = []
    bad = [f"{c['codec']}/{c['algorithm']}" for c in d.get("codecs", []) if not c.get("ok")]
    if d.get("codecs"):
        worst = max((c["rel_error"] for c in d["codecs"] if c["rel_error"] is not None), default=0)
        lines.append(
            f"{len(d['codecs'])} codec reductions, largest relative error {worst:.3g}"
            + (f", out of bounds: {', '.join(bad)}" if bad else ", all within bounds")
        )
    lines += [d[key] for key in ("side_stream", "double_buffered_loop") if key in d]
    for loop in d.get("loops", []):
        if "error" in loop:
            lines.append(f"{loop['loop']}: {loop['error']}")
            continue
        em = loop.get("error_mode")
        mode = ""
        if em is not None:
            mode = f"; error mode: {'raised at step ' + str(em['at_step']) if em['raised'] else 'no error'}"
        sites = ", ".join(f"{k} x{v}" for k, v in loop.get("sync_sites", {}).items())
        if loop.get("counted") is False:
            lines.append(
                f"{loop['loop']}: {loop['steps_counted']} steps (host syncs not counted here)"
            )
            continue
        lines.append(
            f"{loop['loop']}: {loop['host_syncs_total']} host syncs in {loop['steps_counted']} "
            f"steps {loop.get('host_syncs') or ''}{mode}" + (f"; at {sites}" if sites else "")
        )
    lines += [
        f"{run['precision']} {run['options']}: {run['updates']} updates on {run['device']}, "
        f"valid loss {run['valid_loss']:.3f}, loss scale {_fmt(run['loss_scale'])}"
        for run in d.get("runs", [])
    ]
    return lines


def _recipe(stage: dict) -> list[str]:
    return [f"- {line}" for line in _rank_lines(_details(stage))] + _generic(stage)


_SECTIONS = {
    "triton_exact": _triton,
    "throughput": _throughput,
    "world_of_one": _runs,
    "two_ranks": _runs,
    "host_syncs": _runs,
    "sanitizer": _runs,
    "recipe_amp": _recipe,
}
