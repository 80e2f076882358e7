"""PowerSGD: low-rank compression of whole gradient matrices, with warm start and error feedback.

Each tensor of a bucket is viewed as a matrix ``M`` (``shape[0]`` rows, the other dimensions
flattened into columns, as a convolution's ``out x (in*kh*kw)``). With a rank ``r`` and a
matrix ``Q`` (``cols x r``) kept from the previous step:

1. ``M = x * factor + e`` (``e``: this rank's residual, error feedback);
2. ``P = M @ orth(Q)``, summed over the ranks (the first allreduce);
3. ``Q = M.T @ orth(P)``, summed over the ranks (the second allreduce);
4. the result is ``orth(P) @ Q.T``, the projection of the summed ``M`` on ``orth(P)``'s
   columns; ``e = M - result / size`` is kept for the next step, and so is ``Q``.

Warm-up: with ``start_iter=N`` the reductions numbered below ``N`` (the optimizer's
reduction number, saved in its checkpoints) are plain float32 allreduces of the whole
buffer, as torch's hook does for ``start_powerSGD_iter``; the codec's state is left alone
and compression starts at reduction ``N``, from the first ``Q`` and a zero residual.

A matrix of rank <= ``r`` is reproduced exactly (up to float rounding) once ``Q`` is
warm: the first step starts from a random ``Q`` and is as accurate as that ``Q`` is aligned
with the matrix's rows (one power iteration per step). What travels per matrix is
``(rows + cols) * r`` float32 values instead of ``rows * cols``. The tensors the codec does
not compress (vectors, or matrices too small for ``rank`` to save a factor
``min_compression_rate``) travel exactly, in the first allreduce.

The sums arrive from the peers and are untrusted: given as a buffer of their own
(``after_p_sum(summed)``, ``after_q_sum(summed)``) a size other than the placement's raises
``ValueError``; a NaN/Inf in a matrix's summed ``P`` makes the orthogonalisation zero that
column, and one in ``Q`` or in a value sent exactly reaches the result, which the
reduction re-checks (``can_overflow``): the step's NaN/Inf agreement then skips the step on
every rank, and :meth:`PowerSGD.discard_step` puts the ``Q`` and residual back. No NaN/Inf
is ever kept in them.

This is not an encode/decode codec: it needs the tensors' shapes and two allreduces with
math in between. :func:`commopt.collectives.allreduce` runs it with its own plan
(``algorithm="lowrank"``) when given ``shapes=`` (the reducer passes every bucket's); the
plan calls :meth:`PowerSGD.start` and the stages of the returned :class:`LowRankReduction`.

Every step of the math runs on the tensors' device with tensor operations only: no value
is read back by the host (the orthogonalisation handles zero columns with ``torch.where``).
The first ``Q`` of a bucket comes from a CPU generator seeded with ``seed`` and the
bucket's key, so every rank starts from the same one; after that ``Q`` is the result of an
allreduce, the same on every rank. A column of ``Q`` that is exactly zero (a layer whose
gradient was zero) is replaced by the bucket's first ``Q`` column, so it comes back to life.

    >>> import torch
    >>> from commopt.codecs import PowerSGD
    >>> codec = PowerSGD(rank=1)
    >>> m = torch.outer(torch.arange(1.0, 5.0), torch.tensor([1.0, -1.0, 2.0, 0.5, 3.0]))
    >>> flat = m.reshape(-1).clone()
    >>> job = codec.start(flat, [(0, (4, 5))], key="b0", factor=1.0, size=1)
    >>> q = job.after_p_sum()  # a single rank: nothing to add up
    >>> job.after_q_sum()
    >>> torch.allclose(flat.view(4, 5), m, atol=1e-5), codec.residual("b0").abs().max() < 1e-5
    (True, tensor(True))
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commopt.codecs.base import Codec, RngKey

__all__ = ["DEPENDENT", "LowRankReduction", "PowerSGD", "orthogonalize_"]

#: ``(offset, shape)`` of each tensor in a flat buffer.
Shapes = Sequence[tuple[int, Sequence[int]]]


#: A column whose length after the projections is at most this fraction of its length before
#: them is (numerically) a combination of the previous columns: what is left is rounding
#: noise without a direction of its own, so the column becomes zero. A direction kept so
#: close to the others would be known to a relative 1/64 at best anyway.
DEPENDENT = 64 * torch.finfo(torch.float32).eps


def orthogonalize_(a: torch.Tensor, fallback: torch.Tensor | None = None) -> None:
    """Make the columns of ``a`` (``k x r``, ``r <= k``) orthonormal, in place.

    Gram-Schmidt with a second projection pass ("twice is enough"). Each column is first
    scaled by a power of two (exact) to a largest entry in [0.5, 1), so its length neither
    underflows nor overflows. A column that is zero, or (numerically) dependent on the
    previous ones (:data:`DEPENDENT`), becomes zero: no division by zero, no host read.
    With ``fallback`` (same shape), a column of ``a`` that is zero on entry is first
    replaced by ``fallback``'s.
    """
    if fallback is not None:
        zero = torch.linalg.vector_norm(a, dim=0, keepdim=True) == 0
        a.copy_(torch.where(zero, fallback, a))
    one = torch.ones((), dtype=a.dtype, device=a.device)
    for i in range(a.shape[1]):
        col = a[:, i : i + 1]
        if col.numel():
            col.mul_(torch.ldexp(one, -torch.frexp(col.abs().amax()).exponent))
        before = torch.linalg.vector_norm(col)
        if i:
            prev = a[:, :i]
            for _ in range(2):
                col.sub_(prev @ (prev.T @ col))
        norm = torch.linalg.vector_norm(col)
        keep = norm > DEPENDENT * before
        col.copy_(torch.where(keep, col / torch.where(keep, norm, one), 0.0))


@dataclass(frozen=True)
class _Matrix:
    offset: int
    rows: int
    cols: int
    rank: int
    p_at: int  # where its P starts in the P buffer
    q_at: int  # where its Q starts in the Q buffer


@dataclass(frozen=True)
class _Placement:
    matrices: tuple[_Matrix, ...]
    rest: tuple[tuple[int, int], ...]  # (lo, hi) ranges sent exactly
    p_numel: int  # the P's, then the exact ranges
    q_numel: int


class PowerSGD(Codec):
    """Low-rank compression of rank ``rank`` (``"powersgd4"``: rank 4, error feedback on).

    ``min_compression_rate``: a matrix is compressed when ``(rows + cols) * r`` times this
    is below ``rows * cols`` (``r = min(rank, rows, cols)``); the others travel exactly.
    ``seed`` keys the first ``Q`` of every bucket (the same on every rank).
    ``start_iter``: the reductions numbered below it travel uncompressed (warm-up; the name
    ``"powersgd4-start1000"`` is ``PowerSGD(4, start_iter=1000)``).
    """

    linear = False
    wire_dtype = None
    alignment = 1
    stochastic = False
    #: The sums arrive from the peers: a damaged P or Q can spell NaN/Inf (or values whose
    #: product overflows), so reductions through PowerSGD re-check their result and the step's
    #: NaN/Inf agreement skips the step on every rank (:meth:`discard_step` puts the state back).
    can_overflow = True

    def __init__(
        self,
        rank: int = 1,
        *,
        error_feedback: bool = True,
        min_compression_rate: float = 2.0,
        seed: int = 0,
        start_iter: int = 0,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be an integer >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(
                f"start_iter must be an integer >= 0 (the first reduction compressed), got "
                f"{start_iter!r}"
            )
        if not min_compression_rate >= 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate!r}")
        self.rank = rank
        self.error_feedback = bool(error_feedback)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self.start_iter = start_iter
        self.name = (
            f"powersgd{rank}"
            + ("" if self.error_feedback else "-noef")
            + (f"-start{start_iter}" if start_iter else "")
        )
        self._qs: dict[Hashable, torch.Tensor] = {}
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._first_q: dict[Hashable, torch.Tensor] = {}  # not state: derived from the seed
        self._placements: dict[tuple[Any, ...], _Placement] = {}
        # The step whose updates discard_step() undoes, and each key's state before it.
        self._open_step: int | None = None
        self._undo: dict[Hashable, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self._spare: dict[Hashable, torch.Tensor] = {}  # final steps' old residuals, reused

    # -- the flat-codec interface does not apply ------------------------------------------------
    def _flat_use(self) -> TypeError:
        return TypeError(
            f"{self.name} compresses whole matrices: it has no flat encode/decode or wire size "
            "per element. Reduce with commopt.collectives.allreduce(..., shapes=[(offset, "
            "shape), ...]) (the reducer and the optimizer wrapper pass them), or use "
            "wire_numel(shapes) for its wire size."
        )

    def encoded_nbytes(self, numel: int) -> int:
        raise self._flat_use()

    def encode(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        *,
        scale: float = 1.0,
        rng: RngKey | None = None,
        key: Hashable | None = None,
    ) -> None:
        raise self._flat_use()

    def decode(self, wire: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False) -> None:
        raise self._flat_use()

    # -- placement: where each matrix and exact range sits in the buffers ------------------------
    def placement(self, numel: int, shapes: Shapes) -> _Placement:
        """Which tensors are compressed (as matrices), which ranges travel exactly, and where
        each sits in the P and Q buffers."""
        norm = tuple(sorted((int(off), tuple(int(d) for d in shape)) for off, shape in shapes))
        cache_key = (numel, norm)
        found = self._placements.get(cache_key)
        if found is not None:
            return found
        matrices: list[_Matrix] = []
        rest: list[tuple[int, int]] = []
        p_at = q_at = 0
        at = 0  # first element not yet assigned
        for off, shape in norm:
            n = math.prod(shape)
            if n == 0:
                continue
            if off < at or off + n > numel:
                raise ValueError(
                    f"{self.name}: tensor of shape {shape} at offset {off} overlaps another or "
                    f"runs past the buffer of {numel} elements; shapes must describe disjoint "
                    "regions of the flat buffer"
                )
            if off > at:
                rest.append((at, off))
            rows = shape[0] if shape else 1
            cols = n // rows if rows else 0
            r = min(self.rank, rows, cols)
            if len(shape) >= 2 and r > 0 and (rows + cols) * r * self.min_compression_rate < n:
                matrices.append(_Matrix(off, rows, cols, r, p_at, q_at))
                p_at += rows * r
                q_at += cols * r
            elif n:
                rest.append((off, off + n))
            at = off + n
        if at < numel:
            rest.append((at, numel))
        merged: list[tuple[int, int]] = []
        for lo, hi in rest:
            if merged and merged[-1][1] == lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        p_numel = p_at + sum(hi - lo for lo, hi in merged)
        found = _Placement(tuple(matrices), tuple(merged), p_numel, q_at)
        self._placements[cache_key] = found
        return found

    def wire_numel(self, numel: int, shapes: Shapes) -> int:
        """float32 values each rank sends (both allreduces) for a buffer of these tensors."""
        lay = self.placement(numel, shapes)
        return lay.p_numel + lay.q_numel

    # -- one reduction ---------------------------------------------------------------------------
    def warming_up(self, reduction: int | None) -> bool:
        """True when reduction number ``reduction`` travels uncompressed (``< start_iter``)."""
        if not self.start_iter:
            return False
        if reduction is None:
            raise ValueError(
                f"{self.name} compresses from reduction {self.start_iter} on and needs each "
                "reduction's number: pass rng=RngKey(seed, rank, reduction) to allreduce (the "
                "reducer and the optimizer wrapper do)"
            )
        return reduction < self.start_iter

    def begin_uncompressed(self, reduction: int) -> None:
        """A warm-up reduction begins (in issue order, as :meth:`start` would): the previous
        reduction is final, and this one updates nothing (:meth:`discard_step` after it has
        nothing to put back)."""
        self._close_step(reduction)

    def _close_step(self, reduction: int | None) -> None:
        """Reduction number ``reduction`` begins: the previous one, if another, is final."""
        if reduction is None or reduction != self._open_step:
            for key_, (_, old_res) in self._undo.items():  # the previous step is final
                if old_res is not None:
                    self._spare[key_] = old_res
            self._undo = {}
            self._open_step = reduction

    def start(
        self,
        flat: torch.Tensor,
        shapes: Shapes,
        *,
        key: Hashable,
        factor: float,
        size: int,
        reduction: int | None = None,
    ) -> LowRankReduction:
        """Begin reducing ``flat`` (its tensors at ``shapes``): adds the residual, forms P.

        ``factor`` multiplies the gradient before anything else (``1/size`` for a mean);
        ``size`` is the number of ranks whose contributions are summed. ``reduction`` is the
        reduction's number (:meth:`discard_step` undoes the updates of the latest one).
        """
        if flat.dtype != torch.float32 or flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(f"{self.name}: needs a contiguous 1-D float32 buffer")
        if size < 1:
            raise ValueError(f"{self.name}: size must be >= 1, got {size}")
        self._close_step(reduction)
        return LowRankReduction(self, flat, self.placement(flat.numel(), shapes), key, factor, size)

    def _initial_q(self, key: Hashable, lay: _Placement, device: torch.device) -> torch.Tensor:
        first = self._first_q.get(key)
        if first is None or first.numel() != lay.q_numel or first.device != device:
            gen = torch.Generator().manual_seed(
                (self.seed * 1_000_003 + zlib.crc32(repr(key).encode())) % (2**63)
            )
            first = torch.randn(lay.q_numel, generator=gen)
            if device.type == "cuda":  # an asynchronous copy: the host does not wait for it
                first = first.pin_memory().to(device, non_blocking=True)
            else:
                first = first.to(device)
            self._first_q[key] = first
        return first

    def state_for(
        self, key: Hashable, lay: _Placement, flat: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(first Q, Q to start from, residual or None) of ``key``, checked against ``lay``."""
        first = self._initial_q(key, lay, flat.device)
        q = self._qs.get(key)
        if q is None:
            q = first
        elif q.numel() != lay.q_numel:
            raise ValueError(
                f"{self.name}: key {key!r} had a Q of {q.numel()} values and its tensors now "
                f"need {lay.q_numel}; give each bucket its own key (or call reset())"
            )
        res = self._residuals.get(key) if self.error_feedback else None
        if res is not None and res.numel() != flat.numel():
            raise ValueError(
                f"{self.name}: key {key!r} had a residual of {res.numel()} elements and now "
                f"{flat.numel()}; give each bucket its own key (or call reset())"
            )
        return first, q.to(flat.device), (None if res is None else res.to(flat.device))

    def residual_buffer(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """A buffer for ``key``'s new residual: a final step's old one when it fits."""
        spare = self._spare.pop(key, None)
        if spare is None or spare.shape != like.shape or spare.device != like.device:
            return torch.empty_like(like)
        return spare

    def commit(self, key: Hashable, q: torch.Tensor, res: torch.Tensor | None) -> None:
        if key not in self._undo:
            self._undo[key] = (self._qs.get(key), self._residuals.get(key))
        self._qs[key] = q
        if res is not None:
            self._residuals[key] = res

    # -- state -----------------------------------------------------------------------------
    def residual(self, key: Hashable | None = None) -> torch.Tensor | None:
        """The residual kept for ``key`` (None before its first reduction)."""
        return self._residuals.get(key)

    def q(self, key: Hashable | None = None) -> torch.Tensor | None:
        """The warm-start Q kept for ``key``: each matrix's ``cols x r`` block, row-major,
        in the order of the matrices' offsets (None before its first reduction)."""
        return self._qs.get(key)

    def discard_step(self) -> None:
        """Put back the Q and residual of every key the latest step updated."""
        for key, (q, res) in self._undo.items():
            for store, old in ((self._qs, q), (self._residuals, res)):
                if old is None:
                    store.pop(key, None)
                else:
                    store[key] = old
        self._undo = {}
        self._open_step = None

    def reset(self, key: Hashable | None = ..., /) -> None:
        """Forget the state of ``key``, or of every key when called without one."""
        keys = list(self._qs) + list(self._residuals) if key is ... else [key]
        for k in keys:
            self._qs.pop(k, None)
            self._residuals.pop(k, None)
            self._undo.pop(k, None)
            self._spare.pop(k, None)

    def state_dict(self) -> dict[str, Any]:
        return {"qs": dict(self._qs), "residuals": dict(self._residuals)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"qs", "residuals"}
        if unknown:
            raise ValueError(f"{self.name}: unexpected state keys {sorted(unknown)}")
        loaded = {}
        for part in ("qs", "residuals"):
            values = state.get(part, {})
            if not isinstance(values, dict):
                raise TypeError(f"{self.name}: state {part!r} must be a dict of tensors")
            for key, value in values.items():
                if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                    raise TypeError(f"{self.name}: {part} {key!r} must be a float32 tensor")
            loaded[part] = {k: v.detach().clone().view(-1) for k, v in values.items()}
        self._qs, self._residuals = loaded["qs"], loaded["residuals"]
        self._undo = {}
        self._spare = {}
        self._open_step = None

    def __repr__(self) -> str:
        ef = "" if self.error_feedback else ", error_feedback=False"
        warm = f", start_iter={self.start_iter}" if self.start_iter else ""
        return f"PowerSGD(rank={self.rank}{ef}{warm})"


class LowRankReduction:
    """One bucket's reduction in three stages, with the two sums (allreduces) between them.

    ``p`` is the first buffer to sum over the ranks (every matrix's P, then the exact
    values); :meth:`after_p_sum` returns the second (every matrix's Q);
    :meth:`after_q_sum` writes the result into ``flat`` and keeps the codec's state.
    """

    def __init__(
        self,
        codec: PowerSGD,
        flat: torch.Tensor,
        lay: _Placement,
        key: Hashable,
        factor: float,
        size: int,
    ):
        self.codec, self.flat, self.lay, self.key, self.size = codec, flat, lay, key, size
        first, q_start, res = codec.state_for(key, lay, flat)
        self._res = res
        dev = flat.device
        self.p = torch.empty(lay.p_numel, dtype=torch.float32, device=dev)
        self.q = torch.empty(lay.q_numel, dtype=torch.float32, device=dev)
        for m in lay.matrices:
            mat = self._matrix(m)
            if res is not None:  # M = residual + factor * gradient, in one pass
                own = res[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
                torch.add(own, mat, alpha=factor, out=mat)
            elif factor != 1.0:
                mat.mul_(factor)
            q = self._q(m)
            q.copy_(q_start[m.q_at : m.q_at + m.cols * m.rank].view(m.cols, m.rank))
            orthogonalize_(q, first[m.q_at : m.q_at + m.cols * m.rank].view(m.cols, m.rank))
            torch.mm(mat, q, out=self._p(m))
        at = lay.p_numel - sum(hi - lo for lo, hi in lay.rest)
        for lo, hi in lay.rest:
            torch.mul(flat[lo:hi], factor, out=self.p[at : at + hi - lo])
            at += hi - lo

    def _matrix(self, m: _Matrix) -> torch.Tensor:
        return self.flat[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)

    def _p(self, m: _Matrix) -> torch.Tensor:
        return self.p[m.p_at : m.p_at + m.rows * m.rank].view(m.rows, m.rank)

    def _q(self, m: _Matrix) -> torch.Tensor:
        return self.q[m.q_at : m.q_at + m.cols * m.rank].view(m.cols, m.rank)

    def _receive(self, buf: torch.Tensor, summed: torch.Tensor | None, what: str) -> None:
        """Copy a sum that arrived elsewhere into ``buf`` (``p`` or ``q``), size checked."""
        if summed is None:
            return
        name, key = self.codec.name, self.key
        if summed.dim() != 1 or summed.dtype not in (torch.uint8, torch.float32):
            raise TypeError(
                f"{name}: the summed {what} of bucket {key!r} must be a 1-D uint8 (bytes) or "
                f"float32 tensor, got {summed.dtype} of shape {tuple(summed.shape)}"
            )
        raw = summed.dtype == torch.uint8
        need = buf.numel() * (4 if raw else 1)
        if summed.numel() != need:
            unit = "bytes" if raw else "float32 values"
            raise ValueError(
                f"{name}: the summed {what} of bucket {key!r} is {summed.numel()} {unit}; this "
                f"bucket's placement needs {need} {unit} ({buf.numel()} float32 values: "
                f"{len(self.lay.matrices)} compressed matrices at rank <= {self.codec.rank}"
                + (", then the values sent exactly)" if what == "P" else ")")
            )
        (buf.view(torch.uint8) if raw else buf).copy_(summed)

    def after_p_sum(self, summed: torch.Tensor | None = None) -> torch.Tensor:
        """``p`` holds the sum over the ranks: write the exact values, form Q (to sum next).

        ``summed``: the sum as it arrived in another buffer (float32 values or their bytes),
        copied into ``p`` first; a size other than ``p``'s raises ``ValueError``.
        """
        self._receive(self.p, summed, "P")
        lay = self.lay
        at = lay.p_numel - sum(hi - lo for lo, hi in lay.rest)
        for lo, hi in lay.rest:
            self.flat[lo:hi].copy_(self.p[at : at + hi - lo])
            at += hi - lo
        for m in lay.matrices:
            p = self._p(m)
            orthogonalize_(p)
            torch.mm(self._matrix(m).T, p, out=self._q(m))
        return self.q

    def after_q_sum(self, summed: torch.Tensor | None = None) -> None:
        """``q`` holds the sum over the ranks: the result into ``flat``; keep Q and residual.

        ``summed``: as for :meth:`after_p_sum`, the sum of the Q's as it arrived elsewhere.
        """
        self._receive(self.q, summed, "Q")
        codec, lay = self.codec, self.lay
        new_res = None
        if codec.error_feedback:
            new_res = codec.residual_buffer(self.key, self.flat)
            for lo, hi in lay.rest:  # sent exactly: nothing to carry
                new_res[lo:hi].zero_()
        for m in lay.matrices:
            mat, p, q = self._matrix(m), self._p(m), self._q(m)
            if new_res is not None:  # residual = M - (P @ Q.T) / size, in one pass over M
                res = new_res[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
                torch.addmm(mat, p, q.T, alpha=-1.0 / self.size, out=res)
            torch.mm(p, q.T, out=mat)
        torch.nan_to_num_(self.q, nan=0.0, posinf=0.0, neginf=0.0)
        if new_res is not None:
            torch.nan_to_num_(new_res, nan=0.0, posinf=0.0, neginf=0.0)
        codec.commit(self.key, self.q, new_res)
