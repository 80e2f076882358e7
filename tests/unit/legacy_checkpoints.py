"""Checkpoints written by an earlier commopt, and what they must continue into.

``tests/unit/legacy_checkpoints/`` holds optimizer state dicts (``torch.save``) and one
``save_checkpoint`` directory written by commopt 0.1.0 as it was before the schedule registry
(state version 2: a one-plan optimizer wrote its part flat, several plans under ``"plans"``;
``double_buffering=True`` meant the plain stale-by-one schedule). Each case also records the
weights after a few more steps from the saved state, so a later commopt shows that it loads
the file *as what it was*: ``tests/unit/test_legacy_checkpoints.py`` builds today's
equivalent optimizer (the old ``True`` under its explicit name, ``"stale"``), loads the file,
takes the same steps and compares the weights bit for bit.

The recording ran with pinned numerics (``tests.unit.optimizer_sequences.PINNED_NUMERICS``),
so the float bits are the same on any x86-64 CPU; the check runs with them too::

    PYTHONPATH=. python -m tests.unit.legacy_checkpoints --check

(``--record`` wrote the files; it is kept for the record and needs the old commopt.)
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
from pathlib import Path

import torch

import commopt

HERE = Path(__file__).with_name("legacy_checkpoints")

#: Each case: the wrapper's arguments then and now (``double_buffering=True`` then is
#: ``"stale"`` now), the inner optimizer, whether the model has groups with their own plans.
CASES: dict[str, dict] = {
    "sync_qsgd_ef": {
        "then": {"compression": "qsgd4+ef"},
        "now": {"compression": "qsgd4+ef"},
        "inner": "sgd",
    },
    "double_buffered_pending": {
        "then": {"double_buffering": True, "compression": "qsgd4+ef"},
        "now": {"double_buffering": "stale", "compression": "qsgd4+ef"},
        "inner": "adam",
    },
    "compensated": {
        "then": {"double_buffering": "compensated", "synchronous_vectors": False},
        "now": {"double_buffering": "compensated", "synchronous_vectors": False},
        "inner": "sgd",
    },
    "two_plans": {
        "then": {"compression": "fp16"},
        "now": {"compression": "fp16"},
        "inner": "sgd",
        "group": {"double_buffering": True},
        "group_now": {"double_buffering": "stale"},
    },
}
SAVED_AFTER = 3  # steps before the checkpoint
CONTINUED = 3  # steps after it, whose weights are recorded


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def _build(case: dict, now: bool):
    model = _model()
    first, last = list(model[0].parameters()), list(model[2].parameters())
    group = dict(case.get("group_now" if now else "group", {}))
    groups = [{"params": first}, {"params": last, **group}]
    if case["inner"] == "sgd":
        inner = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    else:
        inner = torch.optim.Adam(groups, lr=0.01)
    opt = commopt.create_multi_node_optimizer(
        inner,
        commopt.create_communicator("local"),
        model=model,
        seed=11,
        **case["now" if now else "then"],
    )
    return model, opt


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)


def _train(model, opt, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _weights(model, opt) -> list[torch.Tensor]:
    with opt.true_weights():
        return [p.detach().clone() for p in model.parameters()]


def record() -> None:  # pragma: no cover - ran once, with the commopt that wrote the files
    HERE.mkdir(exist_ok=True)
    for name, case in CASES.items():
        model, opt = _build(case, now=False)
        _train(model, opt, range(SAVED_AFTER))
        # (a deep copy: state dicts hold references to tensors the next steps change)
        saved = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
        if name == "double_buffered_pending":
            target = HERE / f"{name}.dcp"
            shutil.rmtree(target, ignore_errors=True)
            commopt.optim.save_checkpoint(target, model, opt, extra={"step": SAVED_AFTER})
        _train(model, opt, range(SAVED_AFTER, SAVED_AFTER + CONTINUED))
        saved["weights_after"] = _weights(model, opt)
        saved["applied_steps"] = opt.applied_steps
        torch.save(saved, HERE / f"{name}.pt")
        opt.close()
        print(f"recorded {name}")


def check(now: bool = True) -> list[str]:
    """Load every recorded case into today's optimizer; the differences, in words.

    ``now=False`` builds the optimizers with the arguments of the commopt that recorded them.
    """
    problems = []
    for name, case in CASES.items():
        saved = torch.load(HERE / f"{name}.pt", weights_only=False)
        sources = ["state_dict"] + (["save_checkpoint"] if (HERE / f"{name}.dcp").is_dir() else [])
        for source in sources:
            model, opt = _build(case, now=now)
            if source == "state_dict":
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optim"])
            else:
                extra = commopt.optim.load_checkpoint(HERE / f"{name}.dcp", model, opt)
                if extra != {"step": SAVED_AFTER}:
                    problems.append(f"{name} ({source}): extra {extra}")
            _train(model, opt, range(SAVED_AFTER, SAVED_AFTER + CONTINUED))
            got = _weights(model, opt)
            if opt.applied_steps != saved["applied_steps"]:
                problems.append(
                    f"{name} ({source}): {opt.applied_steps} steps applied, recorded "
                    f"{saved['applied_steps']}"
                )
            for i, (a, b) in enumerate(zip(got, saved["weights_after"])):
                if not torch.equal(a, b):
                    problems.append(
                        f"{name} ({source}): parameter {i} differs from the recorded run by "
                        f"{(a - b).abs().max().item():.3g}"
                    )
            opt.close()
    return problems


def main() -> None:
    from tests.unit.optimizer_sequences import PINNED_NUMERICS, pinned

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--then", action="store_true", help="check with the old arguments")
    args = parser.parse_args()
    if not pinned():
        os.execve(
            sys.executable,
            [sys.executable, "-m", "tests.unit.legacy_checkpoints", *sys.argv[1:]],
            {**os.environ, **PINNED_NUMERICS},
        )
    torch.set_num_threads(1)
    torch.backends.mkldnn.enabled = False
    if args.record:
        record()
    if args.check:
        problems = check(now=not args.then)
        print("\n".join(problems) if problems else "every legacy checkpoint loaded as recorded")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
