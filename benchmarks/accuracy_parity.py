"""Accuracy parity on real tasks: every communication configuration against fp32, 3 seeds.

Tasks (both offline): ``text``, a character-level Transformer LM on Python's help topics
(validation bits per character), and ``digits``, a small CNN on scikit-learn's load_digits
(validation cross-entropy and accuracy). Data parallelism over 4 replicas is simulated
exactly in one process (benchmarks/accuracy_sim.py); each finished run is appended to the
JSON file, so an interrupted grid keeps its results and a rerun skips them.

    python benchmarks/accuracy_parity.py --tasks digits,text --out benchmarks/results/accuracy-parity.json
    python benchmarks/accuracy_report.py     # writes docs/accuracy.md and docs/plots/accuracy-*.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_sim as sim
from accuracy_study import _done, record_run

CONFIGS = (
    "fp32",
    "fp16",
    "bf16",
    "qsgd4",
    "qsgd4+ef",
    "qsgd8",
    "db",
    "db+qsgd4+ef",
    "comp",
    "comp+qsgd4+ef",
)
OPTIMIZERS = {"digits": ("sgd", "adam", "lars"), "text": ("sgd", "adam")}


def check(
    task: str,
    optimizer: str,
    configs,
    *,
    steps: int,
    seeds=(0,),
    tolerance: float,
    codec_factories: dict | None = None,
    replicas: int = 4,
) -> dict:
    """Short parity check: each configuration's mean final metric within ``tolerance``
    (relative) of fp32's. ``codec_factories`` maps extra labels to codec factories.

    Returns ``{label: {"final": mean, "relative": mean / fp32 - 1, "ok": bool}}``.
    """
    t = sim.TASKS[task]
    factories = dict(codec_factories or {})
    finals = {}
    for label in ["fp32", *configs, *factories]:
        vals = []
        for seed in seeds:
            r = sim.run(
                t,
                optimizer,
                "fp32" if label in factories else label,
                seed=seed,
                steps=steps,
                eval_every=steps,
                replicas=replicas,
                codec_factory=factories.get(label),
            )
            vals.append(float("inf") if r["diverged"] else r["final"][t.metric])
        finals[label] = sum(vals) / len(vals)
    base = finals["fp32"]
    return {
        k: {"final": v, "relative": v / base - 1, "ok": v / base - 1 <= tolerance}
        for k, v in finals.items()
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="digits,text")
    p.add_argument("--optimizers", default=None, help="default: sgd,adam (+lars on digits)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/accuracy-parity.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    done = _done(out)
    seeds = [int(s) for s in args.seeds.split(",")]
    for task in args.tasks.split(","):
        opts = args.optimizers.split(",") if args.optimizers else OPTIMIZERS[task]
        for seed in seeds:  # seed-major: a partial grid has every configuration
            for opt in opts:
                for config in args.configs.split(","):
                    if (task, opt, config, seed, 1.0) in done:
                        continue
                    t = sim.TASKS[task]
                    r = sim.run(t, opt, config, seed=seed, replicas=args.replicas)
                    record_run(
                        out,
                        f"{task} {opt} {config} seed {seed}",
                        t,
                        r,
                        task=task,
                        optimizer=opt,
                        config=config,
                        seed=seed,
                        lr=t.lr[opt],
                        lr_scale=1.0,
                        replicas=args.replicas,
                    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
