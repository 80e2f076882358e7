"""torchft's ``DiLoCo`` as a peer configuration of the benchmarks (``torchft-diloco16``).

torchft (``pip install torchft==0.2.0``) is no dependency of commopt: it is imported here,
lazily, when a torchft configuration is built. Where it does not import, building the
configuration raises :class:`TorchftUnavailable`, whose message starts with ``unavailable:``
and names the pip command; the benchmark records that in the configuration's row and goes on.

Each rank of the benchmark's job is one torchft replica group of one process: rank 0 starts
the lighthouse (torchft's quorum server) and every rank its own store and ``Manager``, which
advertises this host's address (the one that reaches ``MASTER_ADDR``: on the emulated hosts,
the address on the shaped link). The inner optimizer is the benchmark's; the outer optimizer
is SGD with Nesterov momentum (momentum 0.9; the learning rate the benchmark gives commopt's
local-steps configurations, else 0.7, commopt's default); the whole model
is one fragment, synchronised every ``sync_every`` steps with fp32 outer gradients, which
torchft averages with an allreduce over the replicas.

    >>> try:
    ...     require_torchft()
    ... except TorchftUnavailable as exc:
    ...     assert str(exc).startswith("unavailable:") and "pip install torchft==0.2.0" in str(exc)
"""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from typing import Any

__all__ = ["PIP", "TorchftDiLoCo", "TorchftUnavailable", "require_torchft"]

#: The command that installs the peer (the version checked against commopt's schedule).
PIP = "pip install torchft==0.2.0"


class TorchftUnavailable(RuntimeError):
    """torchft does not import here; the message says why and how to install it."""


def require_torchft() -> Any:
    """The ``torchft`` module, or :class:`TorchftUnavailable` naming the import error and the
    pip command."""
    try:
        import torchft
        import torchft.local_sgd
    except Exception as exc:  # ImportError, or a broken native extension
        raise TorchftUnavailable(
            f"unavailable: torchft does not import ({type(exc).__name__}: {exc}); install "
            f"it with `{PIP}` (it is no dependency of commopt)"
        ) from None
    return torchft


def _own_address() -> str:
    """This host's address on the route to ``MASTER_ADDR`` (127.0.0.1 without one)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return s.getsockname()[0]


class TorchftDiLoCo:
    """torchft's ``DiLoCo`` around ``inner`` on this rank (a context manager: enter it around
    the training loop, then :meth:`close`). ``comm``: the benchmark's communicator (its
    ``allgather_obj`` shares the lighthouse's address); ``cfg``: a torchft StepConfig."""

    def __init__(
        self,
        model,
        inner,
        comm,
        cfg,
        seed: int,
        timeout_s: float = 120.0,
        outer_lr: float | None = None,
    ) -> None:
        torchft = require_torchft()
        import torch
        from torchft._torchft import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        if cfg.fragments != 1 or cfg.overlap_steps:
            raise ValueError(f"{cfg.name}: the torchft peer is configured with one fragment")
        host = _own_address()
        self.lighthouse = None
        if comm.rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=comm.size)
        port = self.lighthouse.address().rsplit(":", 1)[1].strip("/") if self.lighthouse else ""
        lighthouse_addr = f"http://{comm.allgather_obj(host)[0]}:{comm.allgather_obj(port)[0]}"
        self.store = torch.distributed.TCPStore(
            host_name=host, port=0, is_master=True, wait_for_workers=False
        )
        limit = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=limit),
            min_replica_size=comm.size,
            use_async_quorum=False,
            init_sync=False,  # every replica starts from the same weights (same seed)
            load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            replica_id=f"bench{seed}_{comm.rank}",
            store_addr=host,
            store_port=self.store.port,
            rank=0,
            world_size=1,
            hostname=host,
            lighthouse_addr=lighthouse_addr,
            port=0,
            connect_timeout=limit,
            quorum_timeout=limit,
            timeout=limit,
        )
        outer = torch.optim.SGD(
            model.parameters(),
            lr=0.7 if outer_lr is None else outer_lr,
            momentum=0.9,
            nesterov=True,
        )
        self.diloco = DiLoCo(
            self.manager,
            [model],
            inner,
            outer,
            sync_every=cfg.sync_every,
            backup_device=torch.device("cpu"),
        )
        self.version = getattr(torchft, "__version__", "0.2.0")
        #: fp32 outer gradients of every parameter, once per synchronisation
        self.wire_bytes_per_sync = sum(
            4 * math.prod(p.shape) for p in model.parameters() if p.requires_grad
        )

    def __enter__(self) -> TorchftDiLoCo:
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.diloco.__exit__(*exc)

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
