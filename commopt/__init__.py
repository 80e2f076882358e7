"""commopt: communication-efficient data-parallel training for PyTorch.

    >>> import commopt
    >>> comm = commopt.create_communicator("local")
    >>> comm.size
    1
"""
__version__ = "0.1.0"

from commopt.comm import create_communicator  # noqa: E402

__all__ = ["create_communicator", "__version__"]


def __getattr__(name):
    # Heavier parts load on first use so `import commopt` stays cheap.
    if name == "create_multi_node_optimizer":
        from commopt.optim.multi_node import create_multi_node_optimizer

        return create_multi_node_optimizer
    if name in ("codecs", "collectives", "optim", "kernels", "sim", "integrations"):
        import importlib

        return importlib.import_module(f"commopt.{name}")
    raise AttributeError(f"module 'commopt' has no attribute {name!r}")
