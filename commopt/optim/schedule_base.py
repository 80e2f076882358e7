"""What every schedule holds the same way: the parameters it reduces and the .grad write guard.

:class:`~commopt.optim.synchronous_step.SynchronousSchedule` and
:class:`~commopt.optim.double_buffered_step.DoubleBufferedSchedule` derive from
:class:`ScheduleBase`; what differs between them (when gradients are sent and applied) is
theirs alone.
"""

from __future__ import annotations

from commopt.optim import clipping
from commopt.optim.bucketed_params import BucketedParameters

__all__ = ["ScheduleBase"]


class ScheduleBase:
    """The parameters, buckets and hooks a schedule reduces, and writes to ``.grad`` it refuses."""

    #: the setting named when a write to ``.grad`` before the reduction is refused
    refused_under = ""

    def __init__(self) -> None:
        self._owned: BucketedParameters | None = None
        self.guard = clipping.GradWriteGuard()  # .grad writes before the reduction

    def attach(self, owned: BucketedParameters) -> None:
        """The parameters, buckets and hooks this schedule reduces."""
        self._owned = owned

    @property
    def bucketed(self) -> BucketedParameters:
        """The parameters, buckets and hooks this schedule reduces."""
        if self._owned is None:
            raise RuntimeError("internal: a schedule was used before attach()")
        return self._owned

    def _check_no_local_writes(self) -> None:
        """Refuse a write to ``.grad`` between the end of backward and the reduction."""
        owned = self.bucketed
        written = self.guard.written(owned.params, owned.reducer.names)
        self.guard.clear()
        if written:
            raise clipping.write_before_reduction_error(written, self.refused_under)
