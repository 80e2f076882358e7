"""Data-parallel training simulated exactly in one process, for the accuracy studies.

``replicas`` model replicas each take the gradient of their share of the global batch; the
shares are reduced with the configuration's arithmetic and applied by one optimizer:

* ``fp32``: the plain average;
* a codec (``fp16``, ``bf16``, ``qsgd4``, ``qsgd4+ef``, ``qsgd8``...): linear (cast) codecs
  encode each replica's share pre-scaled by 1/n and sum in the wire dtype, as the native
  allreduce does; the others encode every share (error feedback per replica), add in fp32,
  re-encode the sum (error feedback per owner) and decode, as the scatter-reduce/allgather
  path does (there the owner's own chunk enters exactly: the simulation is slightly harsher);
* ``db``: double buffering, i.e. the average of step t applied at step t+1 (one-step-stale
  gradients; the final average is applied at the end, as ``flush()`` does);
* ``comp``: compensated double buffering (``commopt.optim.staleness``): each replica takes
  its gradient at the weights predicted from its own last local gradient (with the
  learning rate extrapolated through a warm-up, as ``LocalStepPrediction`` does);
* ``comp-default``: compensated double buffering as the wrapper runs it by default: the
  tensors its default rule picks (``commopt.optim.plans.default_synchronous``:
  ``nn.Embedding`` weights and the parameters tied to them, and the 1-D tensors, biases and
  norms' scales) reduce synchronously (step t's average applied at step t, never
  predicted), the others as in ``comp``; ``comp-emb``: the embedding tables only;
* ``db-lastupd`` (gradient at ``w + (w - w_prev)``) and ``db-mom`` (momentum/beta1 0.9 ->
  0.8) are the remedies compared in docs/accuracy.md.

Labels combine with ``+``: ``db+qsgd4+ef``, ``comp+qsgd4+ef``.

    >>> r = run(TASKS["digits"], "sgd", "fp32", seed=0, steps=4, eval_every=2, replicas=2)
    >>> sorted(r)[:4], len(r["curve"])
    (['config', 'curve', 'diverged', 'final'], 3)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from commopt.codecs import RngKey, get_codec
from commopt.optim.staleness import next_lrs, predicted_step

MODES = (
    "db",
    "comp",
    "comp-default",
    "comp-emb",
    "comp-mix",
    "comp-avg",
    "comp-half",
    "db-lastupd",
    "db-mom",
)
DIVERGED_LOSS = 50.0


@dataclass
class Task:
    name: str
    make_model: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple]  # (seed, step) -> (x, y) global batch
    loss: Callable[[nn.Module, object, object], torch.Tensor]
    evaluate: Callable[[nn.Module], dict]  # -> {"loss": ..., maybe "accuracy"}
    metric: str  # the reported validation metric
    steps: int
    lr: dict  # optimizer -> fp32-tuned peak lr
    global_batch: int


def _text_task() -> Task:
    from recipes.text_lm.data import char_corpus, train_batch, valid_batches
    from recipes.text_lm.model import CharTransformer

    corpus = char_corpus()
    context, batch = 64, 32
    vx, vy = valid_batches(corpus.valid, context, 128)

    def make_model():
        return CharTransformer(corpus.vocab_size, d_model=64, layers=2, heads=4, context=context)

    def get_batch(seed, step):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        return train_batch(corpus.train, batch, context, g)

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    @torch.no_grad()
    def evaluate(model):
        nats = loss(model, vx, vy).item()
        return {"loss": nats, "bpc": nats / math.log(2)}

    return Task(
        "text",
        make_model,
        get_batch,
        loss,
        evaluate,
        "bpc",
        steps=600,
        lr={"sgd": 0.3, "adam": 3e-3, "lars": 1.0},
        global_batch=batch,
    )


def _digits_task() -> Task:
    from recipes.digits_parity import load_digits_split, small_cnn

    xtr, ytr, xte, yte = load_digits_split()
    batch = 64

    def get_batch(seed, step):
        per_epoch = len(ytr) // batch
        epoch, k = divmod(step, per_epoch)
        perm = torch.randperm(
            len(ytr), generator=torch.Generator().manual_seed(seed * 7919 + epoch)
        )
        idx = perm[k * batch : (k + 1) * batch]
        return xtr[idx], ytr[idx]

    def loss(model, x, y):
        return nn.functional.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(model):
        out = model(xte)
        return {
            "loss": nn.functional.cross_entropy(out, yte).item(),
            "accuracy": (out.argmax(1) == yte).float().mean().item(),
        }

    return Task(
        "digits",
        small_cnn,
        get_batch,
        loss,
        evaluate,
        "loss",
        steps=220,
        lr={"sgd": 0.1, "adam": 1e-2, "lars": 1.0},
        global_batch=batch,
    )


class _LazyTasks(dict):
    makers: ClassVar[dict] = {"text": _text_task, "digits": _digits_task}

    def __missing__(self, key):
        if key not in self.makers:
            raise KeyError(f"unknown task {key!r}; choose from {sorted(self.makers)}")
        self[key] = self.makers[key]()
        return self[key]


TASKS = _LazyTasks()


def make_optimizer(name: str, params, lr: float, *, momentum: float = 0.9):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=1e-4)
    if name == "adam":
        return torch.optim.AdamW(params, lr=lr, betas=(momentum, 0.999), weight_decay=0.01)
    if name == "lars":
        from commopt.optim.layerwise import LARS

        return LARS(params, lr=lr, momentum=momentum, weight_decay=1e-4, trust_coefficient=0.02)
    raise ValueError(f"unknown optimizer {name!r}: sgd, adam or lars")


def lr_at(step: int, steps: int, peak: float) -> float:
    """The fp32 schedule: linear warm-up over the first 5% of steps, then cosine to 0."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def parse(label: str) -> tuple[str, str]:
    """'comp+qsgd4+ef' -> ('comp', 'qsgd4+ef'); 'fp16' -> ('sync', 'fp16')."""
    head, _, rest = label.partition("+")
    if head in MODES:
        return head, rest or "fp32"
    return "sync", label


class _Reducer:
    """Average replica gradients (flat fp32) through a codec, keeping per-replica EF state."""

    def __init__(self, spec, replicas: int, seed: int):
        self.n, self.seed = replicas, seed
        make = spec if callable(spec) else (lambda: get_codec(spec))  # spec: name or codec factory
        self.plain = spec in ("fp32", "none", "")
        if not self.plain:
            self.send = [make() for _ in range(replicas)]  # one codec (EF state) per rank
            self.owner = make()

    def __call__(self, flats: list[torch.Tensor], step: int) -> torch.Tensor:
        if self.plain:
            return torch.stack(flats).mean(0)
        codec = self.send[0]
        n = flats[0].numel()
        if codec.linear:
            acc = None
            for r, f in enumerate(flats):
                wire = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
                self.send[r].encode(f, wire, scale=1.0 / self.n, key="b")
                typed = wire.view(codec.wire_dtype)
                acc = typed.clone() if acc is None else acc.add_(typed)
            out = torch.empty(n)
            codec.decode(acc.view(torch.uint8), out)
            return out
        total = torch.zeros(n)
        for r, f in enumerate(flats):
            wire = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
            self.send[r].encode(
                f, wire, scale=1.0 / self.n, rng=RngKey(self.seed, r, step, 0), key="rs"
            )
            codec.decode(wire, total, accumulate=True)
        wire = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
        self.owner.encode(total, wire, rng=RngKey(self.seed, self.n, step, 1), key="ag")
        out = torch.empty(n)
        self.owner.decode(wire, out)
        return out


def run(
    task: Task,
    optimizer: str,
    label: str,
    *,
    seed: int,
    steps: int | None = None,
    lr: float | None = None,
    replicas: int = 4,
    eval_every: int | None = None,
    codec_factory: Callable | None = None,
) -> dict:
    """Train once; returns the validation curve, the final metrics and whether it diverged.

    ``codec_factory`` (a function returning a Codec) replaces the label's codec, e.g. to
    check that a faulty codec is caught.
    """
    mode, codec = parse(label)
    codec = codec_factory or codec
    steps = steps or task.steps
    peak = lr if lr is not None else task.lr[optimizer]
    eval_every = eval_every or max(1, steps // 10)
    torch.manual_seed(seed)
    model = task.make_model()
    params = list(model.parameters())
    sync = [False] * len(params)
    if mode in ("comp-default", "comp-emb"):
        from commopt.optim.plans import default_synchronous

        chosen = default_synchronous(model, params, vectors=mode == "comp-default")
        sync = [id(p) in chosen for p in params]
    opt = make_optimizer(optimizer, params, peak, momentum=0.8 if mode == "db-mom" else 0.9)
    reduce = _Reducer(codec, replicas, seed)
    delayed = mode != "sync"
    pending = None
    predicted: list[list[torch.Tensor] | None] = [None] * replicas  # per-replica offsets w - w_hat
    prev_w = None
    last_lrs = None  # the rates of the last prediction, as LocalStepPrediction keeps them
    curve, diverged = [], False
    start = time.perf_counter()

    def apply(avg: torch.Tensor | None, fresh: torch.Tensor | None = None) -> None:
        """Step with ``avg``; the synchronous tensors (if any) take ``fresh``, step t's average.

        A tensor whose source is None gets no gradient, which torch's optimizers leave alone
        (the double-buffered tensors on the first step, the synchronous ones at the flush).
        """
        if avg is None and (fresh is None or not any(sync)):
            return
        offset = 0
        for p, s in zip(params, sync):
            k = p.numel()
            src = fresh if s else avg
            p.grad = None if src is None else src[offset : offset + k].view_as(p).clone()
            offset += k
        opt.step()

    def record(step: int) -> None:
        m = task.evaluate(model)
        curve.append({"step": step, **m})

    record(0)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, peak)
        x, y = task.batch(seed, step)
        xs, ys = x.chunk(replicas), y.chunk(replicas)
        true_w = [p.detach().clone() for p in params]
        flats, locals_ = [], []
        losses = []
        for r in range(replicas):
            with torch.no_grad():
                if mode.startswith("comp") and predicted[r] is not None:
                    moved = [(p, d) for p, d in zip(params, predicted[r]) if d is not None]
                    torch._foreach_sub_([p for p, _ in moved], [d for _, d in moved])
                elif mode == "db-lastupd" and prev_w is not None:
                    torch._foreach_add_(params, torch._foreach_sub(true_w, prev_w))
            for p in params:
                p.grad = None
            loss = task.loss(model, xs[r], ys[r])
            loss.backward()
            losses.append(loss.item())
            grads = [p.grad.detach().clone() for p in params]
            locals_.append(grads)
            flats.append(torch.cat([g.flatten() for g in grads]))
            with torch.no_grad():
                torch._foreach_copy_(params, true_w)
        if not all(math.isfinite(v) and v < DIVERGED_LOSS for v in losses):
            diverged = True
            break
        avg = reduce(flats, step)
        prev_w = true_w
        fresh = avg
        if delayed:
            pending, avg = avg, pending
        apply(avg, fresh)
        if mode.startswith("comp"):
            # the next average, estimated from this rank's own gradient (comp, the component's
            # rule); the variants: own share exact and the last average for the others'
            # (comp-mix), the last average only (comp-avg), half the own gradient (comp-half)
            w_own = {
                "comp": 1.0,
                "comp-default": 1.0,
                "comp-emb": 1.0,
                "comp-mix": 1.0 / replicas,
                "comp-avg": 0.0,
                "comp-half": 1.0,
            }[mode]
            if avg is None:
                w_own = 1.0
            if mode == "comp-half":
                estimates = [[x * 0.5 for x in g] for g in locals_]
            else:
                estimates = [
                    g
                    if w_own == 1.0
                    else [a.lerp(x, w_own) for a, x in zip((p.grad for p in params), g)]
                    for g in locals_
                ]
            lrs = next_lrs(opt, last_lrs)  # a rising (warm-up) rate, extrapolated
            last_lrs = [float(g["lr"]) for g in opt.param_groups]
            if any(sync):  # compensation predicts only the double-buffered tensors
                estimates = [[None if s else x for s, x in zip(sync, g)] for g in estimates]
            predicted = [predicted_step(opt, g, lrs) for g in estimates]
        if (step + 1) % eval_every == 0 and step + 1 < steps:
            record(step + 1)
    if not diverged and pending is not None:  # flush(): the last average
        apply(pending)  # the synchronous tensors have nothing pending
    if not diverged:
        record(steps)
        final = curve[-1]
        diverged = not math.isfinite(final["loss"]) or final["loss"] > DIVERGED_LOSS
    return {
        "config": label,
        "curve": curve,
        "diverged": diverged,
        "final": None if diverged else curve[-1],
        "seconds": round(time.perf_counter() - start, 1),
    }
