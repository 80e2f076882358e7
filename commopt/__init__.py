"""commopt: communication-efficient data-parallel training for PyTorch.

    >>> import commopt
    >>> comm = commopt.create_communicator("local")
    >>> comm.size
    1
"""
__version__ = "0.1.0"

__all__ = ["__version__", "create_communicator", "create_multi_node_optimizer", "reuse_freed_memory"]


def __getattr__(name):
    # Everything loads on first use: `import commopt` (and so every `commopt launch`) must
    # not pay for importing torch.
    if name == "create_communicator":
        from commopt.comm import create_communicator

        return create_communicator
    if name == "create_multi_node_optimizer":
        from commopt.optim.multi_node import create_multi_node_optimizer

        return create_multi_node_optimizer
    if name == "reuse_freed_memory":
        from commopt.memory import reuse_freed_memory

        return reuse_freed_memory
    if name in ("comm", "codecs", "collectives", "optim", "kernels", "sim", "integrations", "reducer",
                "memory"):
        import importlib

        return importlib.import_module(f"commopt.{name}")
    raise AttributeError(f"module 'commopt' has no attribute {name!r}")
