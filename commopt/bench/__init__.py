"""Benchmarks behind `commopt bench`: ``allreduce`` (nccl-tests style sweeps over any
communicator and codec) and ``step`` (training steps, PyTorch DDP against commopt, on an
emulated slow link).

    $ commopt launch -n 2 -- commopt bench allreduce --comm mpi -b 1M -e 16M --codec fp32,qsgd4
    $ commopt bench step --models mlp --configs ddp-fp32,commopt-qsgd4-db --rounds 1
"""
