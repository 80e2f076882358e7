"""Checkpoint bytes per rank with error feedback: what each rank holds and writes.

Run under mpirun with N ranks; rank 0 prints one JSON line. ``--label before`` measures a
commopt whose ``state_dict()`` gathers every rank's residuals (the state dict each rank
holds, saved with torch.save); otherwise the per-rank DCP checkpoint of
``commopt.optim.save_checkpoint``. DDP's figure (model + plain optimizer state dict) is
the floor: the model and optimizer state that every rank needs anyway.

    mpirun -np 2 python benchmarks/checkpoint_size.py --out benchmarks/results/checkpoint-size.json
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import torch

import commopt
from commopt.bench import harness
from commopt.codecs import CompressionPolicy
from commopt.optim import create_multi_node_optimizer


def nbytes(obj) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the 4-layer MLP")
    ap.add_argument("--out", help="append the JSON record to this file (a JSON list)")
    args = ap.parse_args()
    comm = commopt.create_communicator("mpi")
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(4)])
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    opt = create_multi_node_optimizer(
        inner, comm, model=model, compression="qsgd4+ef", policy=CompressionPolicy()
    )
    for step in range(2):
        opt.zero_grad()
        model(
            torch.randn(8, w, generator=torch.Generator().manual_seed(step + comm.rank))
        ).sum().backward()
        opt.step()
    ddp = nbytes({"model": model.state_dict(), "opt": inner.state_dict()})
    if args.label == "before":
        held = nbytes({"model": model.state_dict(), "opt": opt.state_dict()})
        written = [held] + [0] * (comm.size - 1)  # saved on rank 0; every rank holds it
        holds = [held] * comm.size
    else:
        from commopt.optim import save_checkpoint
        from commopt.optim.checkpoint_files import checkpoint_bytes

        holds_mine = nbytes({"model": model.state_dict(), "opt": opt.state_dict()})
        tmp = tempfile.mkdtemp(prefix="ckpt-size-") if comm.rank == 0 else None
        tmp = comm.bcast_obj(tmp, root=0)
        save_checkpoint(tmp, model, opt)
        parts = checkpoint_bytes(tmp)
        written = [
            parts.get(f"rank{r}", 0) + (parts["replicated"] if r == 0 else 0)
            for r in range(comm.size)
        ]
        holds = comm.allgather_obj(holds_mine)
    if comm.rank == 0:
        rec = {
            "label": args.label,
            "ranks": comm.size,
            "params": sum(p.numel() for p in model.parameters()),
            "ddp_bytes": ddp,
            "state_held_per_rank_bytes": holds,
            "written_per_rank_bytes": written,
        }
        print(json.dumps(rec))
        if args.out:
            path = Path(args.out)
            records = json.loads(path.read_text()) if path.exists() else []
            harness.write_json(path, records + [rec])


if __name__ == "__main__":
    main()
