"""Staleness study: plain vs compensated double buffering at fp32's schedule, and where each is stable.

Runs in one process (see benchmarks/accuracy_sim.py for the simulated data parallelism) and
appends every finished run to a JSON file, so an interrupted study keeps what it measured.

    python benchmarks/accuracy_study.py remedies --tasks digits,text --out benchmarks/results/accuracy-staleness.json
    python benchmarks/accuracy_study.py lr-map --tasks digits,text --out benchmarks/results/accuracy-lr-map.json

``remedies``: fp32, db, db-lastupd, db-mom and comp for SGD (momentum 0.9) and AdamW at the
fp32-tuned schedule, 3 seeds. ``lr-map``: fp32, db and comp at peak lr x 0.25 .. x 4 (seed 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from commopt.bench import harness

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_sim as sim

REMEDIES = ("fp32", "db", "db-lastupd", "db-mom", "comp")
LR_SCALES = (0.25, 0.5, 1.0, 2.0, 4.0)


def record_run(out: Path, label: str, t, r: dict, **fields) -> None:
    """Append one run (``fields``, the task's steps and metric, ``r``) to ``out``; print it."""
    harness.append_run(out, {**fields, "steps": t.steps, "metric": t.metric, **r})
    fin = r["final"][t.metric] if r["final"] else float("nan")
    print(f"{label}: {t.metric} {fin:.4f} diverged={r['diverged']} ({r['seconds']} s)", flush=True)


def _done(path: Path) -> set:
    if not path.exists():
        return set()
    return {
        (r["task"], r["optimizer"], r["config"], r["seed"], r.get("lr_scale", 1.0))
        for r in json.loads(path.read_text())["runs"]
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("study", choices=("remedies", "lr-map"))
    p.add_argument("--tasks", default="digits,text")
    p.add_argument("--optimizers", default="sgd,adam")
    p.add_argument("--configs", default=None, help="default: the study's list")
    p.add_argument("--seeds", default=None, help="default: 0,1,2 (remedies), 0 (lr-map)")
    p.add_argument(
        "--scales", default=None, help="lr-map: peak-lr multipliers (default 0.25,0.5,1,2,4)"
    )
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    done = _done(out)
    remedies = args.study == "remedies"
    configs = (
        args.configs.split(",")
        if args.configs
        else (REMEDIES if remedies else ("fp32", "db", "comp"))
    )
    seeds = [int(s) for s in (args.seeds or ("0,1,2" if remedies else "0")).split(",")]
    scales = (
        (1.0,)
        if remedies
        else (tuple(float(x) for x in args.scales.split(",")) if args.scales else LR_SCALES)
    )
    for task in args.tasks.split(","):
        for opt in args.optimizers.split(","):
            for scale in scales:
                for config in configs:
                    for seed in seeds:
                        if (task, opt, config, seed, scale) in done:
                            continue
                        t = sim.TASKS[task]
                        lr = t.lr[opt] * scale
                        r = sim.run(t, opt, config, seed=seed, lr=lr, replicas=args.replicas)
                        record_run(
                            out,
                            f"{task} {opt} x{scale} {config} seed {seed}",
                            t,
                            r,
                            task=task,
                            optimizer=opt,
                            config=config,
                            seed=seed,
                            lr=lr,
                            lr_scale=scale,
                            replicas=args.replicas,
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
