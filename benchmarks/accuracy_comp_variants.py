"""Variants of compensated double buffering in the one-process simulation (the SGD-text gap study).

Each run is one training of ``benchmarks/accuracy_sim.py``'s task with 4 simulated replicas and
fp32 averaging, and is appended to OUT (a JSON ``{"runs": [...]}``)::

    python benchmarks/accuracy_comp_variants.py TASK OPTIMIZER VARIANT SEED STEPS OUT

VARIANT is ``-``-joined: ``fp32`` (synchronous) or ``comp`` (the local-step prediction), and
modifiers: ``nextlr`` (predict with the next step's scheduled rate, given exactly), ``m<mu>``
(momentum/beta1 ``mu`` instead of 0.9, for every configuration it is put on), ``c<k>`` (the
local gradient scaled by ``k`` in the prediction), ``x<k>`` (the prediction's gradient is
``k * local + (1 - k) * the average just applied``), ``r<n>`` (``n`` replicas, default 4). Diagnostics that
no real rank can run (they use this step's average, still on the wire there): ``oall``,
``oemb``, ``oattn``, ``o1d``, ``oembonly`` predict the whole model, the embedding and
position tables, the attention input projections, the 1-D tensors, or the embedding table
with the average instead of the local gradient. ``e0``, ``eavg``, ``ex0.5``: the embedding
and position tables predicted without a gradient, with the last average, or with half
local half last average. ``sembonly``: the token-embedding table reduced synchronously
(its average applied at once), every other tensor double-buffered; ``sembpos``: the token
and position tables so. Results: docs/accuracy.md.
"""

import math
import sys
import time
from pathlib import Path

import torch

from commopt.bench import harness
from commopt.optim.staleness import predicted_step

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy_sim as sim


def run(task, optimizer, variant, seed, steps, replicas=4):
    # variant: fp32 | comp | comp-nextlr | comp-c<coef> (local gradient scaled) | comp-nextlr-c<coef>
    steps = steps or task.steps
    peak = task.lr[optimizer]
    torch.manual_seed(seed)
    model = task.make_model()
    params = list(model.parameters())
    mom = 0.9
    for part in variant.split("-"):
        if part.startswith("m") and part[1:].replace(".", "").isdigit():
            mom = float(part[1:])
    opt = sim.make_optimizer(optimizer, params, peak, momentum=mom)
    delayed = not variant.startswith("fp32")
    # sembonly: the token-embedding table reduced synchronously, the rest double-buffered
    parts = variant.split("-")
    sync_names = (
        {"embed.weight"}
        if "sembonly" in parts
        else {"embed.weight", "pos"}
        if "sembpos" in parts
        else set()
    )
    nextlr = "nextlr" in variant
    coef = 1.0
    for part in variant.split("-"):
        if part.startswith("c") and part[1:].replace(".", "").isdigit():
            coef = float(part[1:])
    pending = None
    predicted = [None] * replicas
    curve = []
    diverged = False
    start = time.perf_counter()

    def apply(avg):
        off = 0
        for p in params:
            k = p.numel()
            p.grad = avg[off : off + k].view_as(p).clone()
            off += k
        opt.step()

    curve.append({"step": 0, **task.evaluate(model)})
    ev = max(1, steps // 10)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = sim.lr_at(step, steps, peak)
        x, y = task.batch(seed, step)
        xs, ys = x.chunk(replicas), y.chunk(replicas)
        true_w = [p.detach().clone() for p in params]
        flats, locs, losses = [], [], []
        for r in range(replicas):
            with torch.no_grad():
                if delayed and predicted[r] is not None:
                    moved = [(p, d) for p, d in zip(params, predicted[r]) if d is not None]
                    torch._foreach_sub_([p for p, _ in moved], [d for _, d in moved])
            for p in params:
                p.grad = None
            loss = task.loss(model, xs[r], ys[r])
            loss.backward()
            losses.append(loss.item())
            gr = [p.grad.detach().clone() for p in params]
            locs.append(gr)
            flats.append(torch.cat([g.flatten() for g in gr]))
            with torch.no_grad():
                torch._foreach_copy_(params, true_w)
        if not all(math.isfinite(v) and v < 50 for v in losses):
            diverged = True
            break
        avg = torch.stack(flats).mean(0)
        if sync_names:  # these tensors reduced synchronously: their fresh average, now
            fresh_now, old = avg, pending
            pending = avg
            off = 0
            for n, p in model.named_parameters():
                k = p.numel()
                src = fresh_now if n in sync_names else old
                p.grad = None if src is None else src[off : off + k].view_as(p).clone()
                off += k
            opt.step()  # SGD: a tensor without a gradient is left alone
            avg = old
        else:
            if delayed:
                pending, avg = avg, pending
            if avg is not None:
                apply(avg)
        if delayed:
            if nextlr:
                for g in opt.param_groups:
                    g["lr"] = sim.lr_at(step + 1, steps, peak)
            mix = None
            for part in variant.split("-"):
                if part.startswith("x"):
                    mix = float(part[1:])
            if mix is not None and avg is not None:
                prev = [p.grad for p in params]  # the average just applied
                ests = [[a.lerp(x, mix) for a, x in zip(prev, gl)] for gl in locs]
            else:
                ests = [[x * coef for x in gl] for gl in locs]
            oracle = [x for x in variant.split("-") if x in ("oall", "oemb", "oattn", "o1d")]
            if oracle:  # diagnostic only: the fresh average (unknown to a real rank) for a subset
                fresh, off = [], 0
                for p in params:
                    fresh.append(pending[off : off + p.numel()].view_as(p))
                    off += p.numel()
                names = [n for n, _ in model.named_parameters()]
                pick = {
                    "oall": lambda n, p: True,
                    "oemb": lambda n, p: n in ("pos", "embed.weight"),
                    "oattn": lambda n, p: "in_proj_weight" in n,
                    "o1d": lambda n, p: p.dim() == 1,
                }[oracle[0]]
                ests = [
                    [f if pick(n, p) else x for n, p, f, x in zip(names, params, fresh, e)]
                    for e in ests
                ]
            emb = [x for x in variant.split("-") if x in ("e0", "eavg", "ex0.5", "oembonly")]
            if emb:  # embedding and position tables: no local gradient, last average, mix, oracle
                names = [n for n, _ in model.named_parameters()]
                prev = [p.grad for p in params]
                fresh, off = [], 0
                for p in params:
                    fresh.append(pending[off : off + p.numel()].view_as(p))
                    off += p.numel()

                def sub(n, a, f, x, kind=emb[0]):
                    if kind == "oembonly":
                        return f if n == "embed.weight" else x
                    if n not in ("pos", "embed.weight") or a is None:
                        return x
                    return {"e0": x * 0.0, "eavg": a, "ex0.5": a.lerp(x, 0.5)}[kind]

                ests = [
                    [sub(n, a, f, x) for n, a, f, x in zip(names, prev, fresh, e)] for e in ests
                ]
            if sync_names:
                names = [n for n, _ in model.named_parameters()]
                ests = [[None if n in sync_names else x for n, x in zip(names, e)] for e in ests]
            predicted = [predicted_step(opt, e) for e in ests]
        if (step + 1) % ev == 0 and step + 1 < steps:
            curve.append({"step": step + 1, **task.evaluate(model)})
    if not diverged and pending is not None:
        for g in opt.param_groups:
            g["lr"] = sim.lr_at(steps, steps, peak)  # lr 0 at end anyway
        if sync_names:  # flush: the delayed tensors' last average only
            off = 0
            for n, p in model.named_parameters():
                k = p.numel()
                p.grad = None if n in sync_names else pending[off : off + k].view_as(p).clone()
                off += k
            opt.step()
        else:
            apply(pending)
    if not diverged:
        curve.append({"step": steps, **task.evaluate(model)})
    return {
        "config": variant,
        "curve": curve,
        "diverged": diverged,
        "final": None if diverged else curve[-1],
        "seconds": round(time.perf_counter() - start, 1),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    task, opt, variant, seed, steps, out = sys.argv[1:7]
    t = sim.TASKS[task]
    reps = [int(x[1:]) for x in variant.split("-") if x.startswith("r") and x[1:].isdigit()]
    r = run(t, opt, variant, int(seed), int(steps), replicas=reps[0] if reps else 4)
    rec = {
        "task": task,
        "optimizer": opt,
        "seed": int(seed),
        "steps": int(steps),
        "lr": t.lr[opt],
        **r,
    }
    harness.append_run(out, rec)
    fin = r["final"][t.metric] if r["final"] else float("nan")
    print(
        task,
        opt,
        variant,
        seed,
        steps,
        fin,
        r["seconds"],
        [round(c[t.metric], 3) for c in r["curve"]],
        flush=True,
    )
