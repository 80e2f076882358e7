"""Compensated double buffering: take each gradient at the weights it will be applied to.

With double buffering the average of step *t*'s gradients arrives one step late, so it is
applied at ``w[t+1]`` although it was computed at ``w[t]``. That delay shrinks the stable
learning rates a lot (momentum SGD at 0.9 on a quadratic: stable for ``lr * h < 0.1``
instead of ``< 3.8``), so plain double buffering needs a retuned schedule.

``LocalStepPrediction`` removes the staleness to first order: after each step it moves the
model to a prediction of the *next* weights, made with the optimizer's own update rule from
this rank's *local* gradient (known at once, while its average is still on the wire). The
next forward and backward then run at (nearly) the weights their average will be applied
to. The true weights are kept aside and restored exactly before the optimizer applies an
average, so every rank's true weights and optimizer state stay bit-identical; only the
point where each rank takes its gradient differs (by its own local step).

Contract, per rank and per double-buffered step (``local`` is this rank's unscaled fp32
gradient of the step, before any codec; the averaged gradient is in ``param.grad``)::

    comp.restore()  # params <- true weights (no-op before the first prediction)
    optimizer.step()  # the stale average, applied at the true weights
    comp.predict(local)  # keep the true weights, params <- predicted next weights
    ...
    comp.restore()  # end of training / evaluation: params <- true weights

On the first step, with no average to apply yet, call ``predict`` only. The prediction
uses the hyper-parameters in force when ``predict`` runs, except the learning rate: a
scheduler changes it after the step, so a rate that rose since the last prediction is
extrapolated one step further (``next_lrs``: exact for a linear warm-up, where the rate
grows by half at step 1, and the steps of a warm-up are the least stable ones); a falling
rate (decay) is used as it is, so a step decay is never overshot. Cost: one
parameter-sized buffer (the true weights) and three buffers the size of the largest
parameter (the step's arithmetic, reused: a prediction allocates nothing once warm) and, per
step, one copy in, one copy out and a few elementwise passes over the gradients and the
optimizer's state (the predicted step, applied parameter by parameter).
``state_dict()`` holds plain tensors; with the model's and the optimizer's state dicts it
restores training exactly. Supported optimizers: ``torch.optim.SGD``, ``Adam``, ``AdamW``
and ``commopt.optim.layerwise.LARS``.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> opt = torch.optim.SGD([w], lr=0.5, momentum=0.0)
    >>> comp = LocalStepPrediction(opt)
    >>> comp.predict([torch.tensor([1.0, -2.0])])  # step 0: nothing applied yet
    >>> w.data.tolist()  # the next step's forward runs here
    [-0.5, 1.0]
    >>> w.grad = torch.tensor([2.0, -2.0])  # the average of step 0 arrives
    >>> comp.restore(); opt.step(); w.data.tolist()  # applied at the true weights (zero)
    [-1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["LocalStepPrediction", "next_lrs", "predicted_step"]


def _params(optimizer: Optimizer) -> list[tuple[dict[str, Any], Tensor]]:
    return [(group, p) for group in optimizer.param_groups for p in group["params"]]


class _Scratch:
    """Buffers for the predicted step's arithmetic: ``take(p, g)`` gives three tensors
    shaped like ``p``, of the local gradient ``g``'s dtype. ``reuse=False``: new ones each time (the step is returned and kept);
    ``reuse=True``: views of three buffers kept across steps, as large as the largest
    parameter (each step is applied before the next parameter's is computed), so a
    prediction allocates nothing once warm."""

    def __init__(self, reuse: bool):
        self.reuse = reuse
        self._flat: list[Tensor] = []

    def take(self, p: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not self.reuse:
            a = torch.empty(p.shape, dtype=g.dtype, device=g.device)
            return a, torch.empty_like(a), torch.empty_like(a)
        n = p.numel()
        if (
            not self._flat
            or self._flat[0].numel() < n
            or self._flat[0].device != g.device
            or self._flat[0].dtype != g.dtype
        ):
            size = max(n, self._flat[0].numel() if self._flat else 0)
            self._flat = [torch.empty(size, dtype=g.dtype, device=g.device) for _ in range(3)]
        a, b, c = (f[:n].view(p.shape) for f in self._flat)
        return a, b, c


def _sgd_step(
    group: dict[str, Any], state: dict[str, Any], p: Tensor, g: Tensor, scratch: _Scratch
) -> Tensor:
    # torch.optim.SGD: d = g + wd*w; buf = m*buf + (1-dampening)*d (buf = d on the first step)
    d, nbuf, out = scratch.take(p, g)
    if group["weight_decay"]:
        torch.add(g, p, alpha=group["weight_decay"], out=d)
    else:
        d.copy_(g)
    m = group["momentum"]
    if m:
        buf = state.get("momentum_buffer")
        if buf is None:
            nbuf.copy_(d)
        else:
            torch.mul(buf, m, out=nbuf).add_(d, alpha=1 - group["dampening"])
        d = torch.add(d, nbuf, alpha=m, out=out) if group["nesterov"] else nbuf
    delta = d.mul_(group["lr"])
    return delta.neg_() if group.get("maximize") else delta


def _adam_step(
    group: dict[str, Any],
    state: dict[str, Any],
    p: Tensor,
    g: Tensor,
    decoupled: bool,
    scratch: _Scratch,
) -> Tensor:
    # torch.optim.Adam / AdamW, the step the next call would take with gradient g
    if group.get("maximize"):
        g = -g
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if wd and not decoupled:
        g = g.add(p, alpha=wd)
    n = float(state["step"]) + 1 if "step" in state else 1.0
    m, v, tmp = scratch.take(p, g)
    # m = exp_avg * b1 + g * (1 - b1); v = exp_avg_sq * b2 + g * g * (1 - b2)
    torch.mul(g, 1 - b1, out=tmp if "exp_avg" in state else m)
    if "exp_avg" in state:
        torch.mul(state["exp_avg"], b1, out=m).add_(tmp)
    torch.mul(g, g, out=tmp).mul_(1 - b2)
    if "exp_avg_sq" in state:
        torch.mul(state["exp_avg_sq"], b2, out=v).add_(tmp)
    else:
        v.copy_(tmp)
    if group.get("amsgrad") and "max_exp_avg_sq" in state:
        torch.maximum(v, state["max_exp_avg_sq"], out=v)
    denom = v.sqrt_().div_(math.sqrt(1 - b2**n)).add_(eps)
    delta = m.div_(denom).mul_(lr / (1 - b1**n))
    if wd and decoupled:
        delta.add_(p, alpha=lr * wd)
    return delta


def _lars_steps(
    optimizer: Any, group: dict[str, Any], params: list[Tensor], grads: list[Tensor]
) -> list[Tensor]:
    from commopt.optim.layerwise import excluded, trust_ratios

    lr, wd, m = group["lr"], group["weight_decay"], group["momentum"]
    skip = excluded(group, params, optimizer.exclude)
    out = []
    for p, g, s in zip(params, grads, skip):
        if s:
            u = g * lr
        else:
            trust = trust_ratios([p], [g], group["trust_coefficient"], wd, group["eps"])[0]
            u = (g.add(p, alpha=wd) if wd else g) * (trust * lr).to(g.dtype)
        buf = optimizer.state[p].get("momentum_buffer")
        out.append(u if buf is None else u.add_(buf, alpha=m))
    return out


def next_lrs(optimizer: Optimizer, last: Sequence[float] | None) -> list[float]:
    """Each group's learning rate expected at the next step, from its rate now and ``last``.

    A rate that rose since ``last`` (the rates at the previous step) is extrapolated
    linearly, at most doubled; a constant or falling one is kept (a decay changes little
    per step, and a step decay must not be extrapolated past its drop).

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.2)
    >>> next_lrs(opt, [0.1]), next_lrs(opt, [0.3]), next_lrs(opt, None)
    ([0.30000000000000004], [0.2], [0.2])
    """
    now = [float(g["lr"]) for g in optimizer.param_groups]
    if last is None or len(last) != len(now):
        return now
    return [lr + min(max(lr - prev, 0.0), lr) for lr, prev in zip(now, last)]


@contextlib.contextmanager
def _rates(optimizer: Optimizer, lrs: Sequence[float] | None) -> Iterator[None]:
    if lrs is None:
        yield
        return
    groups = optimizer.param_groups
    saved = [g["lr"] for g in groups]
    for g, lr in zip(groups, lrs):
        g["lr"] = lr
    try:
        yield
    finally:
        for g, lr in zip(groups, saved):
            g["lr"] = lr


def predicted_step(
    optimizer: Optimizer, local_grads: Sequence[Tensor | None], lrs: Sequence[float] | None = None
) -> list[Tensor | None]:
    """The step ``w - w_next`` that ``optimizer.step()`` would take with ``local_grads``.

    Reads the optimizer's state and hyper-parameters, changes nothing. ``local_grads``
    follows the order of ``optimizer.param_groups``' parameters; ``None`` means no step.
    ``lrs``: each group's learning rate to predict with (default: the groups' own).
    """
    with _rates(optimizer, lrs):
        return _predicted_step(optimizer, local_grads)


def _check_count(local_grads: Sequence[Tensor | None], params: int) -> None:
    if len(local_grads) != params:
        raise ValueError(
            f"predicted_step: {len(local_grads)} gradients for {params} parameters "
            "(pass one per parameter, in param_groups order, None for no gradient)"
        )


def _predicted_step(
    optimizer: Optimizer,
    local_grads: Sequence[Tensor | None],
    scratch: _Scratch | None = None,
    apply: Callable[[Tensor, Tensor], None] | None = None,
) -> list[Tensor | None]:
    """The steps (``apply`` None), or ``apply(param, step)`` called for each as soon as it
    is computed (nothing returned: ``scratch`` may then reuse its buffers)."""
    from commopt.optim.layerwise import LARS

    scratch = _Scratch(reuse=False) if scratch is None else scratch

    pairs = _params(optimizer)
    _check_count(local_grads, len(pairs))
    kind = type(optimizer)
    with torch.no_grad():
        if kind is LARS:
            steps: list[Tensor | None] = [None] * len(pairs)
            index = 0
            for group in optimizer.param_groups:
                idx = [
                    index + i
                    for i, _ in enumerate(group["params"])
                    if local_grads[index + i] is not None
                ]
                index += len(group["params"])
                got = _lars_steps(
                    optimizer,
                    group,
                    [pairs[i][1] for i in idx],
                    [g for i in idx if (g := local_grads[i]) is not None],
                )
                for i, s in zip(idx, got):
                    steps[i] = s
            if apply is not None:
                for (_, p), st in zip(pairs, steps):
                    if st is not None:
                        apply(p, st)
                return []
            return steps
        if kind is torch.optim.SGD:

            def rule(group: dict[str, Any], state: dict[str, Any], p: Tensor, g: Tensor) -> Tensor:
                return _sgd_step(group, state, p, g, scratch)

        elif kind in (torch.optim.Adam, torch.optim.AdamW):
            decoupled = kind is torch.optim.AdamW or bool(
                optimizer.defaults.get("decoupled_weight_decay")
            )

            def rule(group: dict[str, Any], state: dict[str, Any], p: Tensor, g: Tensor) -> Tensor:
                return _adam_step(group, state, p, g, decoupled, scratch)

        else:
            raise TypeError(
                f"compensated double buffering predicts steps of SGD, Adam, AdamW and LARS, "
                f"not {kind.__name__}; use double_buffering='stale' (plain) with this optimizer"
            )
        if apply is not None:
            for (group, p), g in zip(pairs, local_grads):
                if g is not None:
                    apply(p, rule(group, optimizer.state.get(p, {}), p, g))
            return []
        return [
            None if g is None else rule(group, optimizer.state.get(p, {}), p, g)
            for (group, p), g in zip(pairs, local_grads)
        ]


class LocalStepPrediction:
    """Keeps the true weights; moves the model to the weights predicted for the next step.

    ``optimizer`` is the inner optimizer (SGD, Adam, AdamW or LARS) whose ``step()`` applies
    the averaged gradients; see the module docstring for the call order.
    """

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        predicted_step(optimizer, [None] * len(_params(optimizer)))  # unsupported: fail now
        self._weights: list[Tensor] | None = None  # true weights while the model is predicted
        self._last_lrs: list[float] | None = None  # the groups' rates at the last prediction
        self._spare: list[Tensor] | None = None  # the true weights' buffers, between uses
        self._scratch = _Scratch(reuse=True)

    @property
    def predicting(self) -> bool:
        """True while the parameters hold predicted weights (the true ones are kept aside)."""
        return self._weights is not None

    @property
    def weights(self) -> list[Tensor] | None:
        """The true weights while the parameters hold predicted ones (else None)."""
        return self._weights

    def tensors(self) -> list[Tensor]:
        """The parameters, in ``param_groups`` order."""
        return [p for _, p in _params(self.optimizer)]

    @torch.no_grad()
    def restore(self) -> None:
        """Put the true weights back into the parameters (exact copy). Idempotent."""
        if self._weights is not None:
            torch._foreach_copy_(self.tensors(), self._weights)
            self._spare, self._weights = self._weights, None

    @torch.no_grad()
    def predict(self, local_grads: Sequence[Tensor | None], skip: Tensor | None = None) -> None:
        """Keep the true weights and move the parameters by the step ``local_grads`` predicts.

        ``skip``: a 0-dim bool tensor; where True the step is zero (decided on the device).
        """
        if self._weights is not None:
            raise RuntimeError(
                "LocalStepPrediction.predict() twice without restore(): call restore() "
                "before the optimizer applies the averaged gradients"
            )
        params = self.tensors()
        _check_count(local_grads, len(params))
        lrs = next_lrs(self.optimizer, self._last_lrs)
        self._last_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        spare, self._spare = self._spare, None
        if (
            spare is not None
            and len(spare) == len(params)
            and all(
                w.shape == p.shape and w.dtype == p.dtype and w.device == p.device
                for w, p in zip(spare, params)
            )
        ):
            torch._foreach_copy_(spare, [p.detach() for p in params])
            self._weights = spare
        else:
            self._weights = [p.detach().clone() for p in params]

        def apply(p: Tensor, delta: Tensor) -> None:  # w <- w - delta, masked where skipped
            if skip is not None:
                delta = delta.masked_fill_(skip, 0.0)
            p.sub_(delta.to(p.dtype))

        with _rates(self.optimizer, lrs):
            _predicted_step(self.optimizer, local_grads, self._scratch, apply)

    @contextlib.contextmanager
    def true_weights(self) -> Iterator[None]:
        """Evaluate at the true weights inside the block, then go back to the predicted ones."""
        if self._weights is None:
            yield
            return
        params = self.tensors()
        predicted = [p.detach().clone() for p in params]
        with torch.no_grad():
            torch._foreach_copy_(params, self._weights)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, predicted)

    def state_dict(self) -> dict[str, Any]:
        """The true weights (``None`` when the parameters hold them), plain tensors, and the
        learning rates of the last prediction (for the next one's extrapolation)."""
        return {
            "weights": None if self._weights is None else [w.clone() for w in self._weights],
            "last_lrs": None if self._last_lrs is None else list(self._last_lrs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        weights = state.get("weights") if isinstance(state, dict) else None
        if not isinstance(state, dict) or "weights" not in state:
            raise ValueError(
                "LocalStepPrediction.load_state_dict: expected {'weights': [...] or None} "
                "as saved by state_dict()"
            )
        last = state.get("last_lrs")  # absent in checkpoints older than the extrapolation
        self._last_lrs = None if last is None else [float(x) for x in last]
        if weights is None:
            self._weights = None
            return
        params = self.tensors()
        if len(weights) != len(params) or any(w.shape != p.shape for w, p in zip(weights, params)):
            raise ValueError(
                "LocalStepPrediction.load_state_dict: the saved weights do not match the "
                f"optimizer's {len(params)} parameters (shapes differ); load the state "
                "saved with this model"
            )
        self._weights = [w.detach().to(p.device, p.dtype).clone() for w, p in zip(weights, params)]
