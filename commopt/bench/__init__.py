"""Benchmarks behind `commopt bench`: ``allreduce`` (nccl-tests style sweeps over any
communicator and codec); ``step`` (a training step) comes later.

    $ commopt launch -n 2 -- commopt bench allreduce --comm mpi -b 1M -e 16M --codec fp32,qsgd4
"""
