"""GradientReducer: the flat buffers of the buckets, and moving gradients through them.

Packs ``param.grad`` into a bucket's buffer (zeros for None, with a local NaN/Inf flag),
reduces the buffer with :func:`commopt.collectives.allreduce`, writes the averages back
(as views of the bucket where it can), and keeps the codecs' state (error feedback).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from commopt import collectives, kernels
from commopt.codecs.base import Codec, RngKey
from commopt.codecs.error_feedback import ErrorFeedback
from commopt.collectives.choice import choose_algorithm
from commopt.collectives.residuals import (
    SAVED_BY_RANKS,
    NotReshardable,
    share,
    summed_residuals,
)
from commopt.comm.base import Communicator, Work
from commopt.profiling import phase
from commopt.reducer.layout import Bucket, build_buckets, is_view_of, slot_view
from commopt.reducer.reduction import StepReduction

__all__ = ["GradientReducer"]

log = logging.getLogger("commopt")


class GradientReducer:
    """Fixed buckets over ``params``, with ``num_buffers`` sets of flat buffers.

    ``num_buffers=2`` gives double buffering: one set can be in flight while the other
    is filled or read. ``seed`` keys the random numbers of stochastic codecs together
    with the rank, the reduction number and the bucket. ``grad_views=True``: ``unpack`` points
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
        policy: Any = None,
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
        self.pending_discards = 0  # skipped steps whose numbers the next start() gives back
        self.buckets = build_buckets(
            self.params,
            self.names,
            codec=codec,
            plain_codec=plain_codec,
            policy=policy,
            bucket_cap_mb=bucket_cap_mb,
        )
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

    def start(
        self, number: int, buffer: int = 0, scale: float | torch.Tensor = 1.0
    ) -> StepReduction:
        """Begin reduction ``number`` of this step's gradients into buffer set ``buffer``.

        ``scale`` multiplies the averages: a number, or a 0-dim tensor on the buckets'
        device (GradScaler's inverse scale), applied there without a host read.

        ``number`` keys the random numbers; each reduction discarded since the last start gives
        its number back (the returned reduction's ``number`` is ``number - pending_discards``),
        so the caller's counter should continue from ``reduction.number + 1``.
        """
        number -= self.pending_discards
        self.pending_discards = 0
        for codec in self._codecs().values():
            begin = getattr(codec, "begin_step", None)  # stateful codecs (error feedback)
            if begin is not None:
                begin()
        return StepReduction(self, number, buffer, scale)

    def discard_step(self) -> None:
        """Undo the codec state of the step every rank agreed to skip (NaN/Inf somewhere).

        Called on the worker by the step's trailer, before any later step starts: residuals
        go back to what they were before the step and its step number is given back, so the
        state is bit-identical to a run in which the step never happened.
        """
        for codec in self._codecs().values():
            discard = getattr(codec, "discard_step", None)
            if discard is not None:
                discard()
        self.pending_discards += 1

    # -- per bucket -----------------------------------------------------------------------
    def pack(self, bucket: Bucket, flat: torch.Tensor, present: list[bool]) -> torch.Tensor | bool:
        """Copy the bucket's gradients into ``flat`` (zeros for None); local NaN/Inf flag."""
        with phase("pack"):
            pieces: list[tuple[torch.Tensor | None, int, int]] = []
            views: list[torch.Tensor] = []
            for s in bucket.slots:
                g = self.params[s.param].grad
                dst = flat[s.offset : s.offset + s.numel]
                if g is None:
                    present[s.param] = False
                    pieces.append((None, s.offset, s.numel))
                    continue
                if g.is_sparse or g.layout != torch.strided:
                    raise RuntimeError(
                        f"parameter {self.names[s.param]!r} has a sparse gradient: commopt reduces "
                        "dense gradients only. Use nn.Embedding(..., sparse=False) (or densify the "
                        "gradient with .to_dense() before step())."
                    )
                present[s.param] = True
                if is_view_of(g, dst):  # backward accumulated into the bucket: nothing to copy
                    views.append(dst)
                else:
                    pieces.append((g.reshape(-1), s.offset, s.numel))
            # a NaN decoded into the padding must not stay there
            pieces += [
                (None, s.offset + s.numel, s.padded - s.numel)
                for s in bucket.slots
                if s.padded > s.numel
            ]
            if (
                flat.device.type == "cpu"
                and not self.comm.stream_ordered  # (a recorded stream trace: the device path)
                and flat.dtype == torch.float32
                and all(
                    src is None or (src.dtype == torch.float32 and src.is_contiguous())
                    for src, _, _ in pieces
                )
            ):
                # One pass copies and checks (the native kernel); views are checked in place.
                bad = kernels.pack_nonfinite(pieces, flat)
                return bad or any(kernels.nonfinite(v) for v in views)
            for src, offset, numel in pieces:
                dst = flat[offset : offset + numel]
                if src is None:
                    dst.zero_()
                else:
                    dst.copy_(src)
            # On the device, without a host sync: the sum is NaN/Inf iff some element is (short
            # of an fp32 overflow of huge values).
            return ~torch.isfinite(flat.sum())

    def reduce(self, bucket: Bucket, flat: torch.Tensor, number: int, scale: float) -> Work:
        rng = RngKey(self.seed, self.comm.rank, int(number), bucket.index)
        return collectives.allreduce(
            self.comm,
            flat,
            bucket.codec,
            average=True,
            algorithm=self.algorithm,
            async_op=True,
            scale=scale,
            rng=rng,
            key=bucket.key,
            shapes=[(s.offset, self.params[s.param].shape) for s in bucket.slots],
        )

    def unpack(self, bucket: Bucket, flat: torch.Tensor, keep: Sequence[bool]) -> None:
        """Write the reduced values into ``param.grad`` (None where ``keep`` is False)."""
        with phase("unpack"):
            for s in bucket.slots:
                p = self.params[s.param]
                if not keep[s.param]:
                    p.grad = None
                    continue
                src = slot_view(flat, s, p)
                g = p.grad
                if self.viewable(p, flat):
                    # The averages stay in the bucket; param.grad looks at them (no copy).
                    if not is_view_of(g, src):
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
                if self.viewable(p, flat):
                    p.grad = slot_view(flat, s, p)
                else:
                    p.grad = None

    def viewable(self, p: torch.Tensor, flat: torch.Tensor) -> bool:
        """Whether ``p.grad`` can be a view of its slot in ``flat`` (``grad_views`` on, same dtype
        and device, strided)."""
        return (
            self.grad_views
            and p.dtype == flat.dtype
            and p.device == flat.device
            and p.layout == torch.strided
        )

    def codec_states(self) -> dict[str, dict[str, Any]]:
        """State of each distinct codec of the buckets (error-feedback residuals)."""
        out: dict[str, dict[str, Any]] = {}
        for name, codec in self._codecs().items():
            out[name] = codec.state_dict()
        return out

    def load_codec_states(self, states: dict[str, dict[str, Any]]) -> None:
        """Restore :meth:`codec_states`. A codec's state may instead hold, under
        ``SAVED_BY_RANKS``, the states every rank of another world size saved: this rank then
        takes its share of them (:meth:`_resharded`)."""
        self.pending_discards = 0  # the checkpoint's reduction number accounts for them
        codecs = self._codecs()
        for name, state in states.items():
            if name in codecs:
                if SAVED_BY_RANKS in state:
                    state = self._resharded(name, codecs[name], state[SAVED_BY_RANKS])
                codecs[name].load_state_dict(state)
            elif state:
                raise ValueError(
                    f"checkpoint holds state for codec {name!r}, which this optimizer "
                    f"does not use (its codecs: {sorted(codecs)})"
                )

    def _resharded(self, name: str, codec: Codec, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's share of the error-feedback residuals that ``len(saved)`` ranks saved
        (:mod:`commopt.collectives.residuals`): their sum at every element of a bucket is kept.
        What cannot be carried over (the hierarchical plan's residuals, a low-rank codec's
        state, a world of one) is dropped, and rank 0 logs what and why."""
        buckets = [
            b
            for b in self.buckets
            if b.codec is not None and ("compressed" if b.compressed else "plain") == name
        ]
        kept = [s.get("residuals", {}) for s in saved]
        if not isinstance(codec, ErrorFeedback):
            if any(any(v for v in s.values()) for s in saved):
                self._log_dropped(
                    name, codec, ["all"], f"{codec.name} keeps state that is not resharded"
                )
            return {}
        algorithm = (
            choose_algorithm(self.comm, codec) if self.algorithm == "auto" else self.algorithm
        )
        residuals: dict[str, torch.Tensor] = {}
        dropped: list[str] = []
        why = ""
        for b in buckets:
            try:
                total = summed_residuals(kept, b.key, numel=b.numel, alignment=codec.alignment)
                if total is not None:
                    residuals.update(
                        share(
                            total,
                            algorithm,
                            rank=self.comm.rank,
                            size=self.comm.size,
                            key=b.key,
                            alignment=codec.alignment,
                        )
                    )
            except NotReshardable as exc:
                dropped.append(b.key)
                why = str(exc)
        ours = {b.key for b in buckets}
        strays = sorted({k.split("/", 1)[0] for s in kept for k in s} - ours - set(dropped))
        if strays:
            dropped += strays
            why = why or "no bucket of this optimizer has these keys"
        if dropped:
            self._log_dropped(name, codec, dropped, why)
        return {"residuals": residuals}

    def _log_dropped(self, name: str, codec: Codec, keys: list[str], why: str) -> None:
        if self.comm.rank == 0:
            log.warning(
                "commopt: error-feedback state of codec %r (%s) saved by another number of "
                "ranks was dropped for bucket(s) %s, which restart at zero: %s",
                name,
                codec.name,
                ", ".join(keys),
                why,
            )

    def _codecs(self) -> dict[str, Codec]:
        found: dict[str, Codec] = {}
        for b in self.buckets:
            if b.codec is not None:
                found.setdefault("compressed" if b.compressed else "plain", b.codec)
        return found
