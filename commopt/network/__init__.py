"""Network set-up checks and tuning: `commopt doctor` and `commopt tune`.

    >>> from commopt.network import diagnose
    >>> snap = {"env": {"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "8"}}
    >>> [f.code for f in diagnose(snap)]
    ['nccl-socket-limit']

Modules: ``probe`` (collects a snapshot of this machine), ``doctor`` (pure checks over a
snapshot), ``nccl_vars`` (what each NCCL version reads), ``profiles`` (per-cloud
environments), ``tune`` (sweeps environment settings with ``commopt bench``).
"""

from commopt.network.doctor import Finding, diagnose

__all__ = ["Finding", "diagnose"]
