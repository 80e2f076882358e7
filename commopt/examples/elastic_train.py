"""Training that survives restarts: resume from the latest checkpoint, data order included.

    $ torchrun --standalone --nproc-per-node 2 --max-restarts 3 \\
        -m commopt.examples.elastic_train --checkpoint-dir ckpts --compression qsgd4+ef

When a rank dies, torchrun stops the others and starts every rank again (up to
``--max-restarts`` times); each start runs this script from the top. Under mpirun, a loop
does the same (a scheduler's requeue is the same loop)::

    $ for attempt in 1 2 3 4; do
    >   mpirun -np 2 python -m commopt.examples.elastic_train --comm mpi --checkpoint-dir ckpts && break
    > done

The script resumes from the checkpoint ``ckpts/latest`` names (none: a fresh start), saves
one every ``--every`` steps with :class:`commopt.checkpointing.CheckpointManager` (atomic:
a rank killed mid-save leaves the previous one), and keeps the sampler's position (epoch,
batches consumed) in the checkpoint's ``extra``, so a resumed run sees the same batches in
the same order. A run killed at any step and resumed ends with the weights of a run that
never stopped, bit for bit (tests/distributed/test_elastic_restart.py).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import commopt
from commopt.checkpointing import CheckpointManager


def build(
    comm, *, compression: str | None, double_buffering: bool | str, plans=None, **options: Any
):
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = commopt.create_multi_node_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        comm,
        model=model,
        compression=compression,
        double_buffering=double_buffering,
        plans=plans,  # per-name rules, e.g. [("0.*", {"double_buffering": False})]
        bucket_cap_mb=0.002,  # a few buckets even for this small model
        **options,  # a schedule and its options, e.g. schedule="local_steps", sync_every=4
    )
    return model, opt


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=g)
    return TensorDataset(x, torch.tanh(x[:, :4]) + 0.1 * torch.randn(256, 4, generator=g))


class ElasticRun:
    """A training run that resumes from the latest checkpoint under ``checkpoint_dir``.

    Iterating runs the remaining steps, yielding each step's number after its update (and
    after saving the checkpoint due then); :meth:`weights` is the model's state afterwards.
    """

    def __init__(
        self,
        comm,
        checkpoint_dir: str | Path,
        *,
        steps: int = 20,
        every: int = 5,
        batch: int = 16,
        compression: str | None = None,
        double_buffering: bool | str = False,
        plans=None,
        **options: Any,
    ):
        self.model, self.opt = build(
            comm,
            compression=compression,
            double_buffering=double_buffering,
            plans=plans,
            **options,
        )
        self.steps, self.every = steps, every
        data = dataset()
        self.sampler: DistributedSampler = DistributedSampler(
            data, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0, drop_last=True
        )
        self.loader = DataLoader(data, batch_size=batch, sampler=self.sampler)
        self.ckpts = CheckpointManager(checkpoint_dir, keep=2)
        restored = self.ckpts.load_latest(self.model, self.opt)
        self.step, self.epoch, self.consumed = 0, 0, 0
        if restored is not None:  # the sampler's position is in the checkpoint's extra
            self.step = restored.step
            self.epoch, self.consumed = restored.extra["epoch"], restored.extra["batch"]

    def __iter__(self) -> Iterator[int]:
        model, opt = self.model, self.opt
        while self.step < self.steps:
            self.sampler.set_epoch(self.epoch)  # this epoch's order, as before a restart
            # Skip the batches trained on before the checkpoint (a loader that reads files
            # would rather skip the sampler's indices: the order is the same).
            for x, y in itertools.islice(self.loader, self.consumed, None):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                self.step, self.consumed = self.step + 1, self.consumed + 1
                if self.step % self.every == 0 or self.step == self.steps:
                    self.ckpts.save(
                        self.step, model, opt, extra={"epoch": self.epoch, "batch": self.consumed}
                    )
                yield self.step
                if self.step == self.steps:
                    break
            else:
                self.epoch, self.consumed = self.epoch + 1, 0
        opt.flush()  # double buffering: apply the last pending gradients

    def weights(self) -> dict[str, torch.Tensor]:
        """The model's weights (compensated double buffering: the true ones)."""
        with self.opt.true_weights():
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--comm", default="torch", help="torch under torchrun, mpi under mpirun")
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    p.add_argument("--compression", default=None, help="fp16, qsgd4+ef, ...")
    p.add_argument(
        "--double-buffering", default="off", choices=("off", "on", "stale", "compensated")
    )
    p.add_argument("--out", help="rank 0 saves the final weights here (torch.save)")
    args = p.parse_args(argv)
    comm = commopt.create_communicator(args.comm)
    db: bool | str = {"off": False, "on": True}.get(args.double_buffering, args.double_buffering)
    run = ElasticRun(
        comm,
        args.checkpoint_dir,
        steps=args.steps,
        every=args.every,
        compression=args.compression,
        double_buffering=db,
    )
    start = run.step
    for _ in run:
        pass
    if comm.rank == 0:
        if args.out:
            torch.save(run.weights(), args.out)
        if start:
            print(f"resumed at step {start}")
        print(f"trained {args.steps} steps; checkpoints in {args.checkpoint_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
