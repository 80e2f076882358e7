"""commopt: communication-efficient data-parallel training for PyTorch.

>>> import commopt
>>> comm = commopt.create_communicator("local")
>>> comm.size
1
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Join",
    "__version__",
    "create_communicator",
    "create_multi_node_optimizer",
    "reuse_freed_memory",
]

# Type checkers and editors follow these; at run time nothing below is imported until first use
# (see __getattr__), so `import commopt` (and every `commopt launch`) does not import torch.
if TYPE_CHECKING:
    # `x as x`: an explicit re-export of the submodules, loaded lazily at run time
    from commopt import codecs as codecs
    from commopt import collectives as collectives
    from commopt import comm as comm
    from commopt import integrations as integrations
    from commopt import kernels as kernels
    from commopt import memory as memory
    from commopt import optim as optim
    from commopt import reducer as reducer
    from commopt import sim as sim
    from commopt.comm import create_communicator
    from commopt.join import Join
    from commopt.memory import reuse_freed_memory
    from commopt.optim import create_multi_node_optimizer

_SUBMODULES = frozenset(
    {
        "comm",
        "codecs",
        "collectives",
        "optim",
        "kernels",
        "sim",
        "integrations",
        "reducer",
        "memory",
    }
)


def __getattr__(name: str) -> Any:
    if name == "create_communicator":
        from commopt.comm import create_communicator

        return create_communicator
    if name == "create_multi_node_optimizer":
        from commopt.optim.multi_node import create_multi_node_optimizer

        return create_multi_node_optimizer
    if name == "Join":
        from commopt.join import Join

        return Join
    if name == "reuse_freed_memory":
        from commopt.memory import reuse_freed_memory

        return reuse_freed_memory
    if name in _SUBMODULES:
        return importlib.import_module(f"commopt.{name}")
    raise AttributeError(f"module 'commopt' has no attribute {name!r}")
