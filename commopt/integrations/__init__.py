"""Integrations with other training frameworks.

Modules are imported only when asked for, so each framework stays optional:
``commopt.integrations.ddp`` (a DistributedDataParallel communication hook),
``commopt.integrations.backend`` (the ``commopt`` torch.distributed backend: plain DDP
scripts change only the backend name), ``commopt.integrations.horovod`` (compression
adapters for ``hvd.DistributedOptimizer``), ``commopt.integrations.lightning`` (PyTorch
Lightning strategies) and ``commopt.integrations.accelerate`` (commopt's optimizer in a
Hugging Face Accelerate loop).
"""
