"""Which launcher started this process, and the rank layout it gives.

Recognises Open MPI's mpirun, MPICH/Hydra's mpiexec, torchrun (and anything that sets
torch.distributed's RANK/WORLD_SIZE), horovodrun's gloo mode, and Slurm's srun.

    >>> from commopt.comm.launcher import detect_launcher
    >>> info = detect_launcher(
    ...     {
    ...         "OMPI_COMM_WORLD_RANK": "1",
    ...         "OMPI_COMM_WORLD_SIZE": "2",
    ...         "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    ...         "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    ...     }
    ... )
    >>> info.name, info.rank, info.size
    ('openmpi', 1, 2)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    name: str  # "openmpi" | "mpich" | "torchrun" | "horovodrun" | "slurm" | "none"
    rank: int
    size: int
    local_rank: int
    local_size: int

    @property
    def is_mpi(self) -> bool:
        return self.name in ("openmpi", "mpich")


# (launcher, rank, size, local rank, local size) variables, in order of precedence:
# torchrun first (it may run inside an allocation that also sets Slurm's variables).
_LAYOUTS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    ("horovodrun", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
    (
        "openmpi",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    ("mpich", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
)


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """The launcher named by the environment, or ``LaunchInfo('none', 0, 1, 0, 1)``."""
    env = os.environ if env is None else env
    for name, rank, size, lrank, lsize in _LAYOUTS:
        if rank in env and size in env:
            r, n = int(env[rank]), int(env[size])
            lr = int(env.get(lrank, r))
            # SLURM_NTASKS_PER_NODE may read "4(x2)"; take the leading count.
            ls_raw = env.get(lsize, str(n)).split("(")[0].split(",")[0]
            return LaunchInfo(name, r, n, lr, int(ls_raw or n))
    return LaunchInfo("none", 0, 1, 0, 1)
