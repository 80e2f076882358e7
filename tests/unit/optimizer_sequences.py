"""Random sequences of optimizer calls, traced: the optimizer's behaviour as data.

Each sequence builds a small model and a ``MultiNodeOptimizer`` in one mode (schedule,
overlap, zero_fill, codec, clipping, inner optimizer) on the local communicator, then makes
random calls (backward, NaN backward, partial backward, ``no_sync`` backward, ``step``,
``step(closure)``, ``synchronize``, ``skip_synchronize`` steps, ``zero_grad``, ``flush``,
``true_weights``, GradScaler steps, a checkpoint round trip, ``add_param_group``...). After
every call the trace keeps a short digest of the weights, the gradients, the exception (type
and message) and the counters. ``tests/unit/test_optimizer_sequences.py`` replays the
recorded sequences and compares digests call by call.

The digests are of float bits, and floating-point sums come out differently on CPUs with
other vector units (AVX2 against AVX-512 kernels in ATen, MKL's per-CPU code paths). So
sequences are recorded and replayed with pinned numerics (``PINNED_NUMERICS``: ATen's
portable kernels, MKL's compatible code path, one thread, no oneDNN): the same bits on any
x86-64 CPU. ``main()`` restarts itself with them when they are not set.

Record (only when a behaviour change is intended, and say so in the commit)::

    PYTHONPATH=. python -m tests.unit.optimizer_sequences --record --sequences 220 --length 35

Replay one quarter of the fixture (what the test runs, in a process of its own)::

    PYTHONPATH=. python -m tests.unit.optimizer_sequences --replay 0 --of 4
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import sys
import warnings
from pathlib import Path

import torch

import commopt

FIXTURE = Path(__file__).with_name("optimizer_sequences.json")
#: Environment for CPU-independent float results; it must be set before torch is imported.
PINNED_NUMERICS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
CALLS = (
    "backward",
    "backward",
    "backward",
    "backward_nan",
    "backward_partial",
    "backward_no_sync",
    "step",
    "step",
    "step",
    "step_closure",
    "synchronize",
    "skip_synchronize_step",
    "clip_then_step",
    "zero_grad_none",
    "zero_grad_zero",
    "zero_grad_none",
    "flush",
    "true_weights",
    "scaler_backward",
    "scaler_step",
    "checkpoint_round_trip",
    "add_param_group",
    "wait",
)


def mode_of(rng: random.Random) -> dict:
    """One random mode (every combination is reachable)."""
    return {
        "double_buffering": rng.choice([False, True, "compensated"]),
        "overlap": rng.choice([True, False]),
        "zero_fill": rng.choice([True, False]),
        "compression": rng.choice([None, None, "qsgd4+ef", "fp16"]),
        "clip_grad_norm": rng.choice([None, 0.5]),
        "inner": rng.choice(["sgd", "adam"]),
        "bucket_cap_mb": rng.choice([0.0001, 25.0]),
    }


def _digest(*tensors_or_none) -> str:
    h = hashlib.sha256()
    for t in tensors_or_none:
        if t is None:
            h.update(b"N")
        else:
            h.update(t.detach().to(torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


class _Run:
    def __init__(self, seed: int, mode: dict):
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        self.model = torch.nn.ModuleDict(
            {
                "a": torch.nn.Linear(4, 6),
                "b": torch.nn.Linear(6, 3),
                "side": torch.nn.Linear(4, 3),
            }
        )
        self.extra = torch.nn.Parameter(torch.randn(3))
        self.added = False
        main = [p for n, p in self.model.named_parameters() if not n.startswith("side")]
        side = list(self.model["side"].parameters())
        if mode["inner"] == "sgd":
            inner = torch.optim.SGD(
                [{"params": main}, {"params": side, "lr": 0.05}], lr=0.1, momentum=0.9
            )
        else:
            inner = torch.optim.Adam([{"params": main}, {"params": side}], lr=0.01)
        # The sequences were recorded when double_buffering=True meant the plain schedule,
        # "stale" since; they replay under that name.
        schedule = "stale" if mode["double_buffering"] is True else mode["double_buffering"]
        self.opt = commopt.create_multi_node_optimizer(
            inner,
            commopt.create_communicator("local"),
            double_buffering=schedule,
            zero_fill=mode["zero_fill"],
            compression=mode["compression"],
            overlap=mode["overlap"],
            bucket_cap_mb=mode["bucket_cap_mb"],
            model=self.model,
            seed=7,
            clip_grad_norm=mode["clip_grad_norm"],
            # The recorded compensated sequences predate the default rule's 1-D part (its
            # plans are tested in test_per_group_plans.py); without it they replay as recorded.
            synchronous_vectors=False,
        )
        self.scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)

    def loss(self, partial: bool = False, nan: bool = False) -> torch.Tensor:
        x = torch.randn(5, 4)
        out = self.model["b"](torch.tanh(self.model["a"](x)))
        if not partial:
            out = out + self.model["side"](x)
        if self.added:
            out = out * self.extra
        loss = (out - 0.5).pow(2).mean()
        if nan:
            loss = loss * float("nan")
        return loss

    def call(self, name: str) -> None:
        opt = self.opt
        if name == "backward":
            self.loss().backward()
        elif name == "backward_nan":
            self.loss(nan=True).backward()
        elif name == "backward_partial":
            self.loss(partial=True).backward()
        elif name == "backward_no_sync":
            with opt.no_sync():
                self.loss().backward()
        elif name == "step":
            opt.step()
        elif name == "step_closure":

            def closure():
                opt.zero_grad()
                loss = self.loss()
                loss.backward()
                return loss

            opt.step(closure)
        elif name == "synchronize":
            opt.synchronize()
        elif name == "skip_synchronize_step":
            with opt.skip_synchronize():
                opt.step()
        elif name == "clip_then_step":
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.1)
            opt.step()
        elif name == "zero_grad_none":
            opt.zero_grad()
        elif name == "zero_grad_zero":
            opt.zero_grad(set_to_none=False)
        elif name == "flush":
            opt.flush()
        elif name == "true_weights":
            with opt.true_weights():
                self.seen = _digest(*self.model.parameters())
        elif name == "scaler_backward":
            self.scaler.scale(self.loss()).backward()
        elif name == "scaler_step":
            self.scaler.step(opt)
            self.scaler.update()
        elif name == "checkpoint_round_trip":
            sd = opt.state_dict()
            opt.load_state_dict(sd)
        elif name == "add_param_group":
            if not self.added:
                self.added = True
                opt.add_param_group({"params": [self.extra], "lr": 0.02})
        elif name == "wait":
            opt.wait()
        else:  # pragma: no cover
            raise ValueError(name)

    def observe(self, error: BaseException | None) -> str:
        opt = self.opt
        params = list(self.model.parameters()) + [self.extra]
        fields = [
            "W" + _digest(*params),
            "G" + _digest(*(p.grad for p in params)),
            f"{opt.applied_steps}/{opt.skipped_steps}/{int(opt.last_step_skipped)}",
        ]
        if opt.last_grad_norm is not None:
            fields.append(f"n{opt.last_grad_norm:.6g}")
        if error is not None:
            message = str(error).splitlines()[0] if str(error) else ""
            fields.append(
                f"E{type(error).__name__}:" + hashlib.sha256(message.encode()).hexdigest()[:8]
            )
        return " ".join(fields)


def short(observation: str) -> str:
    """The fixture's digest of one observation (the full text is shown when one differs)."""
    return hashlib.sha256(observation.encode()).hexdigest()[:10]


def run_sequence(seed: int, length: int) -> dict:
    """One sequence: its mode, its calls, and the trace (an observation after every call)."""
    rng = random.Random(seed)
    mode = mode_of(rng)
    calls = [rng.choice(CALLS) for _ in range(length)]
    run = _Run(seed, mode)
    trace = []
    log = logging.getLogger("commopt")
    level, log.level = log.level, logging.ERROR
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in calls:
            error: BaseException | None = None
            try:
                run.call(name)
            except Exception as e:  # (IndexError included: recorded as it is)
                error = e
            trace.append(run.observe(error))
        with contextlib.suppress(Exception):
            run.opt.close()
    log.setLevel(level)
    return {"seed": seed, "mode": mode, "calls": calls, "trace": trace}


def pinned() -> bool:
    return all(os.environ.get(k) == v for k, v in PINNED_NUMERICS.items())


def replay(chunk: int, of: int) -> list[str]:
    """Replay every ``of``-th recorded sequence from ``chunk``; the mismatches, in words."""
    recorded_all = json.loads(FIXTURE.read_text())
    problems = []
    for recorded in recorded_all["runs"][chunk::of]:
        run = run_sequence(recorded["seed"], recorded_all["length"])
        where = f"sequence seed={recorded['seed']} mode={recorded['mode']}"
        if run["mode"] != recorded["mode"] or short(" ".join(run["calls"])) != recorded["calls"]:
            problems.append(f"{where}: the mode or the call draw changed")
            continue
        for i, (got, want) in enumerate(zip(run["trace"], recorded["trace"].split())):
            if short(got) != want:
                problems.append(
                    f"{where}: call {i} ({run['calls'][i]}) now gives {got!r}; "
                    f"calls so far: {run['calls'][: i + 1]}"
                )
                break
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write " + FIXTURE.name)
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--length", type=int, default=30)
    parser.add_argument("--replay", type=int, metavar="CHUNK", help="replay this chunk")
    parser.add_argument("--of", type=int, default=4, help="chunks (default 4)")
    args = parser.parse_args()
    if not pinned():  # torch is imported already: start again with the pinned numerics
        os.execve(
            sys.executable,
            [sys.executable, "-m", "tests.unit.optimizer_sequences", *sys.argv[1:]],
            {**os.environ, **PINNED_NUMERICS},
        )
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    if args.replay is not None:
        problems = replay(args.replay, args.of)
        print("\n".join(problems) if problems else "replayed identically")
        sys.exit(1 if problems else 0)
    runs = [run_sequence(seed, args.length) for seed in range(args.sequences)]
    if args.record:
        for run in runs:
            kinds = [t.split(" E")[1].split(":")[0] for t in run["trace"] if " E" in t]
            run["errors"] = {k: kinds.count(k) for k in sorted(set(kinds))}
            run["trace"] = " ".join(short(t) for t in run["trace"])
            run["calls"] = short(" ".join(run["calls"]))  # (drawn again from the seed)
        text = ",\n".join(json.dumps(run, separators=(",", ":")) for run in runs)
        FIXTURE.write_text(f'{{"length": {args.length}, "runs": [\n{text}\n]}}\n')
        print(f"recorded {len(runs)} sequences x {args.length} calls in {FIXTURE}")


if __name__ == "__main__":
    main()
