"""The one owner of the trainable parameters, their buckets and their backward hooks.

:class:`BucketedParameters` holds the bucket layout (a
:class:`~commopt.reducer.GradientReducer`: which parameter goes to which bucket, and the
bucket buffers), the backward hooks on those parameters, and the signature of the parameter
set the layout was built for, so that a change (a new group, ``requires_grad`` flipped) is
noticed. The hooks report to two callbacks, ``on_grad_ready(index)`` and
``on_backward_end()``, that the optimizer routes to its schedules.

    >>> import torch, commopt
    >>> from commopt.reducer import GradientReducer
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> seen = []
    >>> owned = BucketedParameters(seen.append, lambda: seen.append("end"))
    >>> owned.install(GradientReducer(commopt.create_communicator("local"), [w], ["w"]), [w])
    >>> (w * 2).sum().backward(); seen
    [0]
    >>> owned.changed([w]), owned.changed([w, torch.nn.Parameter(torch.zeros(1))])
    (False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from commopt.optim.backward_hooks import BackwardHooks
from commopt.reducer import GradientReducer

__all__ = ["BucketedParameters"]


def _signature(params: Sequence[torch.Tensor]) -> tuple[tuple[int, bool], ...]:
    return tuple((id(p), p.requires_grad) for p in params)


class BucketedParameters:
    """The bucket layout of the trainable parameters, and their hooks (see module)."""

    def __init__(
        self, on_grad_ready: Callable[[int], None], on_backward_end: Callable[[], None]
    ) -> None:
        self.hooks = BackwardHooks(on_grad_ready, on_backward_end)
        self._reducer: GradientReducer | None = None
        self._signature: tuple[tuple[int, bool], ...] | None = None

    @property
    def built(self) -> bool:
        return self._reducer is not None

    @property
    def reducer(self) -> GradientReducer:
        """The bucket layout (built before any use)."""
        if self._reducer is None:
            raise RuntimeError("internal: the bucket layout was used before it was built")
        return self._reducer

    @property
    def params(self) -> list[torch.Tensor]:
        """The trainable parameters, in bucket-layout order (the hooks' indices)."""
        return self.reducer.params

    def install(self, reducer: GradientReducer, all_params: Sequence[torch.Tensor]) -> None:
        """Use ``reducer``'s layout, built for ``all_params``; hook its parameters."""
        self._reducer = reducer
        self.hooks.attach(reducer.params)
        self._signature = _signature(all_params)

    def changed(self, all_params: Sequence[torch.Tensor]) -> bool:
        """Whether the parameters (or their ``requires_grad``) differ from the layout's."""
        return _signature(all_params) != self._signature

    def remove_hooks(self) -> None:
        self.hooks.remove()
