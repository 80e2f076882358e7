"""Every rank's optimizer settings that shape the wire, compared once at construction.

Ranks that disagree on the codec, the uncompressed dtype, the bucket layout, the algorithm,
double buffering or the compression policy issue collectives of different sizes or in a
different order: the transports then hang, truncate, corrupt memory or, worst, run on with
weights that drift apart. One small object allgather when the optimizer (re)builds its
buckets compares them, always (``COMMOPT_DEBUG=1`` still checks every collective for what
can change later), and every rank raises the same :class:`SettingsMismatchError` naming
each differing setting and the ranks on each side.

Built from the wrapper's :class:`~commopt.optim.settings.Settings` and the codecs they
resolve to (never from the optimizer object):

    >>> import commopt
    >>> from commopt.codecs import get_codec
    >>> from commopt.optim.settings import Settings
    >>> settings = Settings.of(compression="qsgd4")
    >>> wire = wire_settings(settings, (get_codec("qsgd4"), get_codec("none"), None), [])
    >>> wire["compression"], wire["double_buffering"]
    ("QSGD(bits=4, bucket_size=128, scale='max')", "'synchronous'")
    >>> check_same_settings(commopt.create_communicator("local"), wire)  # one rank agrees
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commopt.comm.base import Communicator
    from commopt.optim.settings import Settings

__all__ = ["SettingsMismatchError", "check_same_settings", "wire_settings"]


class SettingsMismatchError(ValueError):
    """The ranks created their optimizers with settings that would not meet on the wire."""


def _bucket_layout(buckets: Sequence[Any]) -> list[str]:
    return [
        f"{b.key} {b.dtype} codec={b.codec!r} slots={[(s.param, s.offset, s.numel) for s in b.slots]}"
        for b in buckets
    ]


def wire_settings(
    settings: Settings,
    codecs: tuple[Any, Any, Any],
    buckets: Sequence[Any] | None,
    plans: dict[str, str] | None = None,
) -> dict[str, str]:
    """The settings every rank must share, as text.

    ``codecs``: the default plan's (compressing codec or None, uncompressed codec, policy);
    ``buckets``: the bucket layout being built (None: not built yet, left out); ``plans``: per
    parameter group, its plans (:func:`~commopt.optim.plans.group_plans`).
    """
    codec, plain_codec, policy = codecs
    out = (plans or {}) | {
        "compression": repr(codec) if codec is not None else "None",
        "allreduce_grad_dtype (uncompressed codec)": repr(plain_codec),
        "policy": repr(policy),
        "bucket_cap_mb": repr(float(settings.bucket_cap_mb)),
        "algorithm": repr(settings.algorithm),
        "double_buffering": repr(settings.default_schedule),
    }
    if buckets is not None:
        out["bucket layout"] = "; ".join(_bucket_layout(buckets))
    return out


def check_same_settings(comm: Communicator, mine: dict[str, str]) -> None:
    """Raise :class:`SettingsMismatchError` on every rank unless all ranks' ``mine`` agree.

    A collective call on ``comm`` (one allgather of short strings); a world of one agrees.
    """
    if comm.size == 1:
        return
    _raise_differences(comm, mine)


def _raise_differences(comm: Communicator, mine: dict[str, str]) -> None:
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
