"""Buckets of gradients -> codec -> collective, synchronously or asynchronously.

The reducer fuses the gradients of a fixed list of parameters into flat float32 buckets
(the same buckets, in the same order, on every rank), reduces each bucket with
:func:`commopt.collectives.allreduce` and writes the averages back into ``param.grad``.
It knows no particular codec: per tensor, the per-layer policy picks the compressing codec
or the uncompressed one, and each bucket holds tensors of one kind only, so one collective
carries one codec. In a compressed bucket every tensor starts at a multiple of the codec's
``alignment``: quantisation buckets never straddle two tensors.

    >>> import torch, commopt
    >>> from commopt.reducer import GradientReducer
    >>> comm = commopt.create_communicator("local")
    >>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.full((3,), 2.0)
    >>> reducer = GradientReducer(comm, [w], ["w"])
    >>> step = reducer.start(step=0)
    >>> step.finish()
    >>> result = step.unpack(zero_fill=True)   # waits, then writes param.grad
    >>> w.grad.tolist(), result.nonfinite
    ([2.0, 2.0, 2.0], False)

One step's reduction (:class:`StepReduction`) issues bucket ``i`` only after buckets
``0..i-1``: ranks whose gradients become ready in a different order (unused parameters,
data-dependent graphs) still issue the transport's collectives in the same order. A final
small allreduce (the "trailer") tells every rank which buckets held NaN/Inf on any rank and
which parameters had a gradient on any rank, so all ranks take the same decisions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from commopt import collectives, driver
from commopt.codecs.base import Codec, RngKey
from commopt.comm.base import CompletedWork as _DoneWork
from commopt.comm.base import Communicator, Work

__all__ = ["Slot", "Bucket", "build_buckets", "GradientReducer", "StepReduction", "StepResult"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter's gradient lives in its bucket."""

    param: int  # index into the reducer's parameter list
    offset: int
    numel: int
    padded: int  # numel rounded up to the bucket codec's alignment


@dataclass
class Bucket:
    """A group of gradients reduced by one collective with one codec."""

    index: int
    codec: Codec | None  # None: exact, in ``dtype``
    compressed: bool
    device: torch.device
    dtype: torch.dtype
    slots: list[Slot] = field(default_factory=list)
    numel: int = 0

    @property
    def key(self) -> str:
        # Names the bucket for stateful codecs; the size makes a changed layout a new key.
        return f"b{self.index}:{self.numel}"


def _flat_dtype(p: torch.Tensor) -> torch.dtype:
    if not p.is_floating_point():
        raise TypeError(f"gradients must be floating point; got a parameter of {p.dtype}")
    # Half-precision gradients are summed in fp32; fp64 stays fp64 (exact, uncompressed).
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def build_buckets(
    params: Sequence[torch.Tensor],
    names: Sequence[str],
    *,
    codec: Codec | None,
    plain_codec: Codec | None,
    policy=None,
    bucket_cap_mb: float = 25.0,
) -> list[Bucket]:
    """Assign parameters to buckets, last parameter first (roughly backward order).

    ``codec`` compresses the tensors ``policy.should_compress(name, shape)`` accepts;
    the rest use ``plain_codec`` (None: exact float32). Buckets are homogeneous in
    (device, dtype, codec) and hold up to ``bucket_cap_mb`` MiB of float32 gradient.
    """
    cap = max(1, int(bucket_cap_mb * 2**20))
    buckets: list[Bucket] = []
    open_: dict[tuple, Bucket] = {}
    order: list[tuple] = []  # kinds in the order their current bucket was opened

    def close(kind):
        b = open_.pop(kind)
        order.remove(kind)
        b.index = len(buckets)
        buckets.append(b)

    for i in reversed(range(len(params))):
        p = params[i]
        dtype = _flat_dtype(p)
        compress = (codec is not None and dtype == torch.float32
                    and (policy is None or policy.should_compress(names[i], tuple(p.shape))))
        chosen = codec if compress else (plain_codec if dtype == torch.float32 else None)
        kind = (str(p.device), dtype, compress)
        align = chosen.alignment if chosen is not None else 1
        padded = -(-p.numel() // align) * align
        b = open_.get(kind)
        if b is not None and b.numel and (b.numel + padded) * 4 > cap:
            close(kind)
            b = None
        if b is None:
            b = open_[kind] = Bucket(-1, chosen, compress, p.device, dtype)
            order.append(kind)
        b.slots.append(Slot(i, b.numel, p.numel(), padded))
        b.numel += padded
    for kind in list(order):
        close(kind)
    return buckets


def _slot_view(flat: torch.Tensor, s: Slot, p: torch.Tensor) -> torch.Tensor:
    """The part of a bucket that holds parameter ``p``'s gradient, shaped like ``p``."""
    return flat[s.offset: s.offset + s.numel].view(p.shape)


def _is_view_of(g: torch.Tensor | None, region: torch.Tensor) -> bool:
    """True when ``g`` is exactly ``region`` of a bucket (same memory, same elements)."""
    return (g is not None and g.data_ptr() == region.data_ptr() and g.numel() == region.numel()
            and g.dtype == region.dtype and g.device == region.device and g.is_contiguous())


@dataclass
class StepResult:
    """What every rank agrees on after one step's reduction."""

    nonfinite: bool  # some bucket held NaN/Inf on some rank (or after reduction)
    bad_buckets: list[int]  # indices of those buckets
    present: list[bool]  # per parameter: had a gradient on at least one rank


class GradientReducer:
    """Fixed buckets over ``params``, with ``num_buffers`` sets of flat buffers.

    ``num_buffers=2`` gives double buffering: one set can be in flight while the other
    is filled or read. ``seed`` keys the random numbers of stochastic codecs together
    with the rank, the step and the bucket. ``grad_views=True``: ``unpack`` points
    ``param.grad`` at the bucket instead of copying into it, and ``zero_grads_into`` lets
    backward accumulate straight into a bucket.
    """

    def __init__(
        self,
        comm: Communicator,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        *,
        codec: Codec | None = None,
        plain_codec: Codec | None = None,
        policy=None,
        bucket_cap_mb: float = 25.0,
        algorithm: str = "auto",
        num_buffers: int = 1,
        seed: int = 0,
        grad_views: bool = False,
    ):
        self.comm = comm
        # Hand the averages back as views of the buckets instead of copying them into
        # ``param.grad`` (the optimizer wrapper; the DDP hook must write into DDP's bucket).
        self.grad_views = bool(grad_views)
        self.params = list(params)
        self.names = list(names)
        self.algorithm = algorithm
        self.seed = int(seed)
        self.buckets = build_buckets(self.params, self.names, codec=codec, plain_codec=plain_codec,
                                     policy=policy, bucket_cap_mb=bucket_cap_mb)
        self.bucket_of = [0] * len(self.params)
        for b in self.buckets:
            for s in b.slots:
                self.bucket_of[s.param] = b.index
        # Padding stays zero: only the slots are written, and zeros encode to zeros.
        self.buffers = [
            [torch.zeros(b.numel, dtype=b.dtype, device=b.device) for b in self.buckets]
            for _ in range(num_buffers)
        ]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def start(self, step: int, buffer: int = 0, scale: float = 1.0) -> "StepReduction":
        """Begin reducing this step's gradients into buffer set ``buffer``."""
        return StepReduction(self, step, buffer, scale)

    # -- per bucket -----------------------------------------------------------------------
    def pack(self, bucket: Bucket, flat: torch.Tensor, present: list[bool]) -> torch.Tensor:
        """Copy the bucket's gradients into ``flat`` (zeros for None); local NaN/Inf flag."""
        for s in bucket.slots:
            g = self.params[s.param].grad
            dst = flat[s.offset: s.offset + s.numel]
            if g is None:
                present[s.param] = False
                dst.zero_()
                continue
            if g.is_sparse or g.layout != torch.strided:
                raise RuntimeError(
                    f"parameter {self.names[s.param]!r} has a sparse gradient: commopt reduces "
                    "dense gradients only. Use nn.Embedding(..., sparse=False) (or densify the "
                    "gradient with .to_dense() before step())."
                )
            present[s.param] = True
            if not _is_view_of(g, dst):  # backward accumulated into the bucket: nothing to copy
                dst.copy_(g.reshape(-1))
        for s in bucket.slots:
            if s.padded > s.numel:  # a NaN decoded into the padding must not stay there
                flat[s.offset + s.numel: s.offset + s.padded].zero_()
        # The sum is NaN/Inf iff some element is (short of an fp32 overflow of huge values).
        return ~torch.isfinite(flat.sum())

    def reduce(self, bucket: Bucket, flat: torch.Tensor, step: int, scale: float) -> Work:
        rng = RngKey(self.seed, self.comm.rank, int(step), bucket.index)
        return collectives.allreduce(self.comm, flat, bucket.codec, average=True,
                                     algorithm=self.algorithm, async_op=True, scale=scale,
                                     rng=rng, key=bucket.key)

    def unpack(self, bucket: Bucket, flat: torch.Tensor, keep: list[bool]) -> None:
        """Write the reduced values into ``param.grad`` (None where ``keep`` is False)."""
        for s in bucket.slots:
            p = self.params[s.param]
            if not keep[s.param]:
                p.grad = None
                continue
            src = _slot_view(flat, s, p)
            g = p.grad
            if self._viewable(p, flat):
                # The averages stay in the bucket; param.grad looks at them (no copy).
                if not _is_view_of(g, src):
                    p.grad = src
            elif g is None or g.shape != p.shape or g.is_sparse:
                p.grad = src.to(dtype=p.dtype, copy=True)
            else:
                g.copy_(src)

    def zero_grads_into(self, buffer: int) -> None:
        """Point every eligible ``param.grad`` at its zeroed slot of buffer set ``buffer``.

        The next backward then accumulates straight into the bucket, so neither packing nor
        unpacking copies anything (PyTorch DDP's ``gradient_as_bucket_view``). Parameters
        whose dtype differs from their bucket's (half precision) get ``grad = None``.
        """
        flats = self.buffers[buffer]
        for b in self.buckets:
            flat = flats[b.index]
            flat.zero_()
            for s in b.slots:
                p = self.params[s.param]
                if self._viewable(p, flat):
                    p.grad = _slot_view(flat, s, p)
                else:
                    p.grad = None

    def _viewable(self, p: torch.Tensor, flat: torch.Tensor) -> bool:
        return (self.grad_views and p.dtype == flat.dtype and p.device == flat.device
                and p.layout == torch.strided)

    def codec_states(self) -> dict[str, dict]:
        """State of each distinct codec of the buckets (error-feedback residuals)."""
        out: dict[str, dict] = {}
        for name, codec in self._codecs().items():
            out[name] = codec.state_dict()
        return out

    def load_codec_states(self, states: dict[str, dict]) -> None:
        codecs = self._codecs()
        for name, state in states.items():
            if name in codecs:
                codecs[name].load_state_dict(state)
            elif state:
                raise ValueError(f"checkpoint holds state for codec {name!r}, which this optimizer "
                                 f"does not use (its codecs: {sorted(codecs)})")

    def _codecs(self) -> dict[str, Codec]:
        found: dict[str, Codec] = {}
        for b in self.buckets:
            if b.codec is not None:
                found.setdefault("compressed" if b.compressed else "plain", b.codec)
        return found


class StepReduction:
    """One step's gradients on their way to the average, bucket by bucket, in order."""

    def __init__(self, reducer: GradientReducer, step: int, buffer: int, scale: float):
        self.reducer = reducer
        self.step = step
        self.buffer = buffer
        self.scale = float(scale)
        self.flats = reducer.buffers[buffer]
        n = len(reducer.buckets)
        self._waiting = [len(b.slots) for b in reducer.buckets]
        self._fired = [False] * len(reducer.params)
        self._bad: list[torch.Tensor | None] = [None] * n
        self.present = [False] * len(reducer.params)
        self.issued = 0  # buckets 0..issued-1 are on their way
        self.works: list[Work] = []
        self._trailer: Work | None = None
        self._result: StepResult | None = None
        self.finished = False

    # -- issuing ---------------------------------------------------------------------------
    def mark_ready(self, param: int) -> None:
        """The gradient of ``param`` is final for this step (called from backward hooks)."""
        b = self.reducer.bucket_of[param]
        if self._fired[param]:
            if b < self.issued:
                raise RuntimeError(
                    f"the gradient of {self.reducer.names[param]!r} changed after its bucket was "
                    "sent (a second backward before step()). For gradient accumulation, run "
                    "all but the last backward inside `with optimizer.no_sync():`."
                )
            return
        self._fired[param] = True
        self._waiting[b] -= 1
        while self.issued < len(self._waiting) and self._waiting[self.issued] == 0:
            self._issue(self.issued)

    def _issue(self, i: int) -> None:
        bucket = self.reducer.buckets[i]
        flat = self.flats[i]
        self._bad[i] = self.reducer.pack(bucket, flat, self.present)
        self.works.append(self.reducer.reduce(bucket, flat, self.step, self.scale))
        self.issued = i + 1

    def finish(self) -> None:
        """Issue the buckets not sent yet (unused parameters: zeros) and the trailer."""
        if self.finished:
            return
        while self.issued < len(self.reducer.buckets):
            self._issue(self.issued)
        device = self.flats[0].device if self.flats else None
        self._trailer = driver.then(self.reducer.comm, self._agree, device=device)
        self.finished = True

    def _agree(self) -> None:
        """On the collectives' thread, after every bucket: agree on NaN/Inf and presence."""
        n = len(self.flats)
        local = [float(bool(self._bad[i]) or (self._may_overflow(i)
                                               and not bool(torch.isfinite(flat.sum()))))
                 for i, flat in enumerate(self.flats)]
        local += [float(p) for p in self.present]
        # On the buckets' device: a GPU transport (NCCL) reduces device memory only.
        device = self.flats[0].device if self.flats else torch.device("cpu")
        flags = torch.tensor(local, dtype=torch.float32, device=device)
        self.reducer.comm.allreduce(flags)
        agreed = (flags > 0).tolist()
        bad = [i for i in range(n) if agreed[i]]
        self._result = StepResult(bool(bad), bad, agreed[n:])

    def _may_overflow(self, i: int) -> bool:
        """Whether bucket ``i``'s average can be non-finite when every input was finite.

        An average of finite fp32 (or bf16: the same range) terms, each divided by the
        world size before the sum, stays within the largest input, and so does QSGD with
        max-abs float32 scales; codecs that can overflow (``Codec.can_overflow``: an fp16
        wire, QSGD with l2 norms or float16 scales) or a scale above 1 pay a second pass.
        """
        codec = self.reducer.buckets[i].codec
        return self.scale > 1.0 or (codec is not None and codec.can_overflow)

    @classmethod
    def restored(cls, reducer: GradientReducer, step: int, buffer: int,
                 flats: Sequence[torch.Tensor], result: StepResult) -> "StepReduction":
        """A reduction that already completed (restored from a checkpoint)."""
        red = cls(reducer, step, buffer, 1.0)
        if len(flats) != len(red.flats) or any(a.numel() != b.numel() for a, b in zip(flats, red.flats)):
            raise ValueError("the checkpoint's pending gradients do not match this model's buckets "
                             "(different model, bucket_cap_mb or compression?)")
        for dst, src in zip(red.flats, flats):
            dst.copy_(src)
        red.issued = len(reducer.buckets)
        red.present = list(result.present)
        red._result = result
        red._trailer = _DoneWork()
        red.finished = True
        return red

    # -- completing --------------------------------------------------------------------------
    def done(self) -> bool:
        return self._trailer is not None and self._trailer.is_completed()

    def wait(self) -> StepResult:
        """Wait for every bucket and the trailer (call ``finish`` first)."""
        if not self.finished:
            raise RuntimeError("StepReduction.wait() before finish()")
        for w in self.works:
            w.wait()
        self._trailer.wait()
        return self._result

    def unpack(self, zero_fill: bool) -> StepResult:
        """Write the averaged gradients into ``param.grad``; returns the agreed result.

        ``zero_fill=False`` leaves ``grad`` None for parameters no rank had a gradient for.
        A bucket that held NaN/Inf on any rank is written as NaN on every rank if its
        average came out finite, so anything that inspects gradients (GradScaler) sees it.
        """
        result = self.wait()
        keep = [True] * len(self.present) if zero_fill else result.present
        for i, bucket in enumerate(self.reducer.buckets):
            flat = self.flats[i]
            if i in result.bad_buckets and bool(torch.isfinite(flat).all()):
                for s in bucket.slots:
                    flat[s.offset: s.offset + s.numel].fill_(float("nan"))
            self.reducer.unpack(bucket, flat, keep)
        return result
