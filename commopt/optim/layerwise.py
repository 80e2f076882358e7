"""Layer-wise adaptive rate scaling (LARS) for large-batch training.

Two ways to get it:

* ``LARS(params, lr, ...)``: momentum SGD with the MLPerf reference rule (published)::

      trust = eta * ||w|| / (||g|| + wd * ||w|| + eps)     (1 when ||w|| or ||g|| is 0)
      v     = momentum * v + lr * trust * (g + wd * w)
      w     = w - v

  Parameters picked by ``exclude`` (by default those with ``dim <= 1``: biases and
  normalisation weights) get neither the trust ratio nor weight decay:
  ``v = momentum * v + lr * g``.

* ``lars(optimizer, trust_coefficient)``: wraps any optimizer (Adam, SGD, ...) so that each
  gradient is rescaled by its layer's trust ratio before the inner step ("scale" mode), or
  so that the layer's step size is capped at the trust ratio ("clip" mode, ``clip=True``).

No step reads a value back to the host: norms come from ``torch._foreach_norm`` and the
"1 when a norm is 0" rule is a ``torch.where``, so a GPU step never waits on a ``.item()``.

    >>> import torch
    >>> from commopt.optim.layerwise import LARS
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = LARS(model.parameters(), lr=0.1)
    >>> model(torch.randn(8, 4)).sum().backward()
    >>> opt.step()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from commopt.optim._wrapping import init_hook_tables, inner_attribute

__all__ = ["LARS", "LayerwiseAdaptation", "exclude_bias_and_norm", "lars", "trust_ratios"]

ExcludeFn = Callable[[Tensor], bool]


def exclude_bias_and_norm(param: Tensor) -> bool:
    """True for biases and normalisation scales/shifts (tensors with ``dim <= 1``)."""
    return param.dim() <= 1


def excluded(group: dict[str, Any], params: list[Tensor], exclude: ExcludeFn | None) -> list[bool]:
    """Which of ``params`` get no adaptation and no weight decay.

    A group's ``"lars_skip"`` (True/False) overrides the ``exclude`` rule for the whole group.
    """
    forced = group.get("lars_skip")
    if forced is not None:
        return [bool(forced)] * len(params)
    if exclude is None:
        return [False] * len(params)
    return [bool(exclude(p)) for p in params]


def trust_ratios(
    params: list[Tensor],
    grads: list[Tensor],
    trust_coefficient: float,
    weight_decay: float = 0.0,
    eps: float = 0.0,
) -> list[Tensor]:
    """One 0-dim float32 tensor per parameter: ``eta*||w|| / (||g|| + wd*||w|| + eps)``,
    or 1 where ``||w||`` or ``||g||`` is 0. Stays on the device: no host synchronisation.

        >>> w, g = [torch.ones(4)], [torch.ones(4)]
        >>> round(trust_ratios(w, g, 0.5)[0].item(), 4)
        0.5
    """
    out: list[Tensor | None] = [None] * len(params)
    # torch.stack needs one device and dtype: group so each group is a few kernels.
    buckets: dict[tuple[Any, ...], list[int]] = {}
    for i, (p, g) in enumerate(zip(params, grads)):
        buckets.setdefault((p.device, p.dtype, g.dtype), []).append(i)
    for idx in buckets.values():
        w_norm = torch.stack(torch._foreach_norm([params[i] for i in idx])).float()
        g_norm = torch.stack(torch._foreach_norm([grads[i] for i in idx])).float()
        ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
        # where() evaluates both sides; the 0/0 = nan of the untaken side is discarded.
        trust = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
        for i, t in zip(idx, trust.unbind()):
            out[i] = t
    return out  # type: ignore[return-value]


def _check_dense(grads: Iterable[Tensor], who: str) -> None:
    for g in grads:
        if g.is_sparse:
            raise RuntimeError(
                f"{who} does not support sparse gradients; use a dense embedding "
                "(sparse=False) or exclude the parameter from this optimizer"
            )


class LARS(Optimizer):
    """Momentum SGD with layer-wise trust ratios (MLPerf reference rule, see module doc).

    Args:
        params: parameters or parameter groups; a group may set ``"lars_skip": True/False``
            to force exclusion on or off for all its parameters.
        lr: learning rate (inside the momentum, as in the reference: v = m*v + lr*trust*d).
        momentum: momentum factor ``m``.
        weight_decay: L2 factor ``wd`` for adapted parameters (excluded ones get none).
        trust_coefficient: ``eta``.
        eps: added to the trust ratio's denominator.
        exclude: ``exclude(param) -> bool`` picks parameters that are neither adapted nor
            decayed; default: ``dim <= 1`` (biases, batch-norm). ``None`` excludes nothing.

        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2, 2))
        >>> opt = LARS([p], lr=1.0, momentum=0.0, weight_decay=0.0, trust_coefficient=0.5)
        >>> p.grad = torch.full((2, 2), 4.0)  # ||w|| = 2, ||g|| = 8: trust = 0.5 * 2 / 8
        >>> opt.step(); p.data[0, 0].item()
        0.5
    """

    def __init__(
        self,
        params: Any,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        exclude: ExcludeFn | None = exclude_bias_and_norm,
    ):
        if not (isinstance(lr, Tensor) or lr >= 0.0):
            raise ValueError(f"LARS: lr must be >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"LARS: momentum must be >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"LARS: weight_decay must be >= 0, got {weight_decay}")
        if trust_coefficient <= 0.0:
            raise ValueError(f"LARS: trust_coefficient must be > 0, got {trust_coefficient}")
        if eps < 0.0:
            raise ValueError(f"LARS: eps must be >= 0, got {eps}")
        if exclude is not None and not callable(exclude):
            raise TypeError("LARS: exclude must be a function param -> bool, or None")
        self.exclude = exclude
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            lars_skip=None,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            _check_dense(grads, "LARS")
            lr, wd = group["lr"], group["weight_decay"]
            skip = excluded(group, params, self.exclude)
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                bufs.append(state["momentum_buffer"])

            adapt = [i for i, s in enumerate(skip) if not s]
            plain = [i for i, s in enumerate(skip) if s]
            updates: list[Tensor | None] = [None] * len(params)
            if adapt:
                pa = [params[i] for i in adapt]
                ga = [grads[i] for i in adapt]
                trust = trust_ratios(pa, ga, group["trust_coefficient"], wd, group["eps"])
                d = torch._foreach_add(ga, pa, alpha=wd) if wd != 0 else list(ga)
                scales = [(t * lr).to(x.dtype) for t, x in zip(trust, d)]
                for i, u in zip(adapt, torch._foreach_mul(d, scales)):
                    updates[i] = u
            if plain:
                gp = [grads[i] for i in plain]
                for i, u in zip(plain, torch._foreach_mul(gp, lr)):
                    updates[i] = u
            # v = m * v + update;  w = w - v
            torch._foreach_mul_(bufs, group["momentum"])
            torch._foreach_add_(bufs, [u for u in updates if u is not None])  # every index set
            torch._foreach_sub_(params, bufs)
        return loss


class LayerwiseAdaptation(Optimizer):
    """Any optimizer with LARS-style layer-wise gradient adaptation; made by :func:`lars`.

    Before each inner step, for every adapted parameter (see ``exclude``)::

        d = g + wd * w                      # the inner optimizer's weight_decay, folded in
        scale mode: g <- trust * d
        clip mode:  g <- min(trust / lr, 1) * d   (the layer's step size is at most trust)

    and the inner ``step()`` runs with ``weight_decay`` set to 0 (it is restored afterwards),
    so excluded parameters get neither adaptation nor weight decay. ``param_groups``,
    ``state``, ``state_dict()`` and ``load_state_dict()`` are the inner optimizer's, so LR
    schedulers, GradScaler and checkpoints work unchanged.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        trust_coefficient: float = 0.001,
        clip: bool = False,
        eps: float = 0.0,
        exclude: ExcludeFn | None = exclude_bias_and_norm,
    ):
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(
                f"lars() wraps an optimizer with param_groups and step(); "
                f"got {type(optimizer).__name__}"
            )
        if trust_coefficient <= 0.0:
            raise ValueError(f"lars: trust_coefficient must be > 0, got {trust_coefficient}")
        if eps < 0.0:
            raise ValueError(f"lars: eps must be >= 0, got {eps}")
        # No Optimizer.__init__: every piece of state belongs to the inner optimizer.
        self.optimizer = optimizer
        self.trust_coefficient = float(trust_coefficient)
        self.clip = bool(clip)
        self.eps = float(eps)
        self.exclude = exclude
        init_hook_tables(self)

    param_groups = inner_attribute("param_groups", "optimizer")
    state = inner_attribute("state", "optimizer")
    defaults = inner_attribute("defaults", "optimizer")

    def __repr__(self) -> str:
        mode = "clip" if self.clip else "scale"
        return f"lars({self.optimizer!r}, trust_coefficient={self.trust_coefficient}, mode={mode})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @torch.no_grad()
    def _adapt(self) -> list[tuple[dict[str, Any], object]]:
        """Rescale gradients in place; return (group, weight_decay) pairs to restore."""
        saved = []
        for group in self.param_groups:
            wd = group.get("weight_decay", 0.0)
            params = [p for p in group["params"] if p.grad is not None]
            skip = excluded(group, params, self.exclude)
            pa = [p for p, s in zip(params, skip) if not s]
            if pa:
                ga = [p.grad for p in pa]
                _check_dense(ga, "lars()")
                trust = trust_ratios(pa, ga, self.trust_coefficient, wd, self.eps)
                if self.clip:
                    lr = group["lr"]
                    trust = [torch.clamp(t / lr, max=1.0) for t in trust]
                if wd != 0:
                    torch._foreach_add_(ga, pa, alpha=wd)
                torch._foreach_mul_(ga, [t.to(g.dtype) for t, g in zip(trust, ga)])
            if "weight_decay" in group:
                saved.append((group, wd))
                group["weight_decay"] = 0.0
        return saved

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        saved = self._adapt()
        try:
            self.optimizer.step()
        finally:
            for group, wd in saved:
                group["weight_decay"] = wd
        return loss


def lars(
    optimizer: Optimizer,
    trust_coefficient: float = 0.001,
    clip: bool = False,
    *,
    eps: float = 0.0,
    exclude: ExcludeFn | None = exclude_bias_and_norm,
) -> LayerwiseAdaptation:
    """Add layer-wise adaptation to ``optimizer`` (see :class:`LayerwiseAdaptation`).

    ``clip=False`` (scale mode) multiplies each layer's gradient by its trust ratio; with
    momentum SGD and a constant LR this is exactly :class:`LARS`. ``clip=True`` keeps the
    global LR unless the layer's trust ratio is smaller.

        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = lars(torch.optim.Adam(model.parameters(), lr=1e-3), trust_coefficient=0.02)
        >>> model(torch.randn(8, 4)).sum().backward()
        >>> opt.step()
    """
    return LayerwiseAdaptation(optimizer, trust_coefficient, clip, eps, exclude)
