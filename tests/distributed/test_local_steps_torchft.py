"""The local-steps schedule against torchft's own ``DiLoCo`` (the peer's implementation).

Two torchft replicas (threads, one lighthouse, gloo, CPU) and two commopt ranks (torch gloo
processes) train the same two-layer model on the same batches with the same inner SGD and
outer Nesterov SGD; torchft's fragments are the two layers, commopt's the two weight tensors
(48 and 24 elements: one in each fragment of near-equal bytes), so both split the model alike. torchft's ``sync_every`` is the per-fragment
interval, ``fragment_sync_delay`` is ``overlap_steps`` and ``fragment_update_alpha`` is
``fragment_alpha``. With ``fragment_alpha=0`` the final weights are bit-identical on each
rank; with 0.5 they agree within float rounding (torchft merges with ``lerp``, commopt with
``alpha * local + (1 - alpha) * anchor``).

Skipped unless torchft imports (``pip install torchft==0.2.0``: it is no dependency of
commopt).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from tests.multirank import run_torch

pytestmark = pytest.mark.distributed


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False)
    )


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def _torchft(sync_every: int, steps: int, fragments: int, tau: int, alpha: float):
    lighthouse_mod = pytest.importorskip("torchft._torchft")
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = lighthouse_mod.LighthouseServer(bind="[::]:0", min_replicas=2)
    models = [_net() for _ in range(2)]  # (before the threads: they share one global RNG)

    def replica(i: int) -> list[list[float]]:
        model = models[i]
        parts = [model[0], model[2]] if fragments == 2 else [model]
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        outer = [
            torch.optim.SGD(p.parameters(), lr=0.7, momentum=0.9, nesterov=True) for p in parts
        ]
        store = torch.distributed.TCPStore(
            host_name="localhost", port=0, is_master=True, wait_for_workers=False
        )
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=30)),
            min_replica_size=2,
            use_async_quorum=False,
            init_sync=False,  # both replicas start from the same weights
            load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=str(i),
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse.address(),
            port=0,
            connect_timeout=timedelta(seconds=30),
            quorum_timeout=timedelta(seconds=30),
            timeout=timedelta(seconds=30),
        )
        with DiLoCo(
            manager,
            parts,
            inner,
            outer,
            sync_every=sync_every,
            backup_device=torch.device("cpu"),
            fragment_sync_delay=tau,
            fragment_update_alpha=alpha,
        ):
            for step in range(steps):
                x, y = _batch(step, i)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                inner.step()
        manager.shutdown(wait=False)
        return [p.detach().flatten().tolist() for p in model.parameters()]

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            return list(pool.map(replica, range(2)))
    finally:
        lighthouse.shutdown()


COMMOPT = r"""
import json, sys, torch, commopt
H, STEPS, P, TAU = (int(a) for a in sys.argv[1:5])
ALPHA = float(sys.argv[5])
comm = commopt.create_communicator("torch")
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(6, 8, bias=False), torch.nn.Tanh(), torch.nn.Linear(8, 3, bias=False))
opt = commopt.create_multi_node_optimizer(
    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), comm, model=model,
    schedule="local_steps", sync_every=H, outer_lr=0.7, outer_momentum=0.9, fragments=P,
    overlap_steps=TAU, fragment_alpha=ALPHA)
for step in range(STEPS):
    g = torch.Generator().manual_seed(1000 * step + comm.rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
print(json.dumps([p.detach().flatten().tolist() for p in model.parameters()]))
"""


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("sync_every", "steps", "fragments", "tau", "alpha"),
    [(4, 12, 1, 0, 0.0), (8, 21, 2, 1, 0.0), (8, 21, 2, 1, 0.5)],
)
def test_local_steps_match_torchft_diloco(sync_every, steps, fragments, tau, alpha):
    pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft==0.2.0)")
    theirs = _torchft(sync_every, steps, fragments, tau, alpha)
    args = [str(sync_every), str(steps), str(fragments), str(tau), str(alpha)]
    outs = run_torch(COMMOPT, 2, args=args, timeout=150)
    for rank in range(2):
        mine = json.loads(outs[rank].strip().splitlines()[-1])
        worst = max(abs(a - b) for m, t in zip(mine, theirs[rank]) for a, b in zip(m, t))
        if alpha == 0.0:
            assert mine == theirs[rank], f"rank {rank}: differs from torchft by {worst}"
        else:
            assert worst < 1e-6, f"rank {rank}: differs from torchft by {worst}"
