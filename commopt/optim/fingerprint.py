"""Every rank's optimizer settings that shape the wire, compared once at construction.

Ranks that disagree on the codec, the uncompressed dtype, the bucket layout, the algorithm,
double buffering or the compression policy issue collectives of different sizes or in a
different order: the transports then hang, truncate, corrupt memory or, worst, run on with
weights that drift apart. One small object allgather when the optimizer (re)builds its
buckets compares them, always (``COMMOPT_DEBUG=1`` still checks every collective for what
can change later), and every rank raises the same :class:`SettingsMismatchError` naming
each differing setting and the ranks on each side.

    >>> import torch, commopt
    >>> comm = commopt.create_communicator("local")
    >>> opt = commopt.create_multi_node_optimizer(
    ...     torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1), comm, compression="qsgd4"
    ... )
    >>> wire_settings(opt)["compression"]
    "QSGD(bits=4, bucket_size=128, scale='max')"
    >>> check_same_settings(opt, opt.buckets)  # a world of one always agrees
"""

from __future__ import annotations

__all__ = ["SettingsMismatchError", "check_same_plans", "check_same_settings", "wire_settings"]


class SettingsMismatchError(ValueError):
    """The ranks created their optimizers with settings that would not meet on the wire."""


def _bucket_layout(buckets) -> list[str]:
    return [
        f"{b.key} {b.dtype} codec={b.codec!r} slots={[(s.param, s.offset, s.numel) for s in b.slots]}"
        for b in buckets
    ]


def wire_settings(opt, buckets=None, plans: dict[str, str] | None = None) -> dict[str, str]:
    """The settings of ``opt`` (a MultiNodeOptimizer) that every rank must share, as text.

    ``buckets``: the bucket layout being built (default: ``opt.buckets``); ``plans``: per
    parameter group, its plans (:func:`~commopt.optim.plans.group_plans`), when groups differ.
    """
    buckets = opt.buckets if buckets is None else buckets
    return (plans or {}) | {
        "compression": repr(opt.codec) if opt.codec is not None else "None",
        "allreduce_grad_dtype (uncompressed codec)": repr(opt.plain_codec),
        "policy": repr(opt.policy),
        "bucket_cap_mb": repr(opt.bucket_cap_mb),
        "bucket layout": "; ".join(_bucket_layout(buckets)),
        "algorithm": repr(opt.algorithm),
        "double_buffering": repr(opt.schedule.mode),
    }


def check_same_plans(comm, plans: dict[str, str]) -> None:
    """Raise :class:`SettingsMismatchError` on every rank unless all ranks chose the same plan
    for every parameter group (checked before any communicator is created for a plan)."""
    if comm.size == 1:
        return
    _raise_differences(comm, plans)


def check_same_settings(opt, buckets, plans: dict[str, str] | None = None) -> None:
    """Raise :class:`SettingsMismatchError` on every rank unless all ranks' settings agree.

    A collective call on ``opt.comm`` (one allgather of short strings).
    """
    comm = opt.comm
    if comm.size == 1:
        return
    _raise_differences(comm, wire_settings(opt, buckets, plans))


def _raise_differences(comm, mine: dict[str, str]) -> None:
    everyone = comm.allgather_obj(mine)
    problems = []
    for name in dict.fromkeys(k for theirs in everyone for k in theirs):  # any rank's settings
        groups: dict[str, list[int]] = {}
        for r, theirs in enumerate(everyone):
            groups.setdefault(str(theirs.get(name)), []).append(r)
        if len(groups) > 1:
            sides = "; ".join(f"ranks {rs}: {_short(v)}" for v, rs in groups.items())
            problems.append(f"{name} differs ({sides})")
    if problems:
        # A differing layout follows from a differing bucket_cap_mb or codec: name the cause.
        if len(problems) > 1:
            problems = [p for p in problems if not p.startswith("bucket layout")]
        raise SettingsMismatchError(
            f"rank {comm.rank}: the ranks created create_multi_node_optimizer with different "
            f"settings, so their collectives would not match: "
            + "; ".join(problems)
            + ". Pass the same compression, allreduce_grad_dtype, policy, bucket_cap_mb, "
            "algorithm, double_buffering and per-group plans on every rank."
        )


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
