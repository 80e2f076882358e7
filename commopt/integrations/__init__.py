"""Integrations with other training frameworks.

Modules are imported only when asked for, so each framework stays optional:
``commopt.integrations.ddp`` (a DistributedDataParallel communication hook) and
``commopt.integrations.horovod`` (compression adapters for ``hvd.DistributedOptimizer``).
"""
