"""commopt codecs inside Horovod: compression adapters for ``hvd.DistributedOptimizer``.

    import horovod.torch as hvd
    from commopt.integrations.horovod import Compression
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=Compression.fp16, op=hvd.Average)

Divide before the cast. Horovod sums what ``compress`` returns; its own fp16 compressor
casts first, so n gradients of magnitude g sum to n*g in fp16 and overflow (to Inf) once
n*g > 65504. These adapters encode ``x / n`` with the commopt codec (one rounding, to
nearest even), Horovod sums the n scaled values, which cannot exceed max|x|, and
``decompress`` multiplies by n in float32. The adapter is linear, so both reductions keep
their meaning: ``op=hvd.Sum`` gives the sum and ``op=hvd.Average`` the mean. (With
``op=hvd.Average`` Horovod divides by n once more on the 16-bit wire: magnitudes below
about n x 6.1e-5 then fall into fp16's subnormal range and keep fewer bits. ``op=hvd.Sum``
followed by your own division avoids that rounding.) ``op=hvd.Adasum`` is not linear: do
not combine it with these adapters.

Only linear codecs fit Horovod's compress/sum/decompress scheme (fp16, bf16). Non-linear
codecs (QSGD) need decode-add-re-encode between the transfers: use
``commopt.create_communicator("horovod")`` with commopt's optimizer wrapper, whose
collectives run QSGD over Horovod's alltoall and allgather.

bf16: Horovod 0.28 cannot sum bfloat16 tensors (it has no bf16 data type), so
``Compression.bf16`` raises a ValueError naming the alternatives when first used with
such a Horovod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from commopt.codecs import Codec, get_codec


def _horovod():
    try:
        import horovod.torch as hvd
        from horovod.torch.compression import Compressor
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "commopt.integrations.horovod needs Horovod with PyTorch support: run 'make horovod' "
            f"or pip install 'commopt[horovod]' ({exc})"
        ) from exc
    return hvd, Compressor


def horovod_sums(dtype: torch.dtype) -> bool:
    """True when the installed Horovod can allreduce CPU tensors of ``dtype``."""
    from horovod.torch import mpi_ops

    name = torch.empty(0, dtype=dtype).type().replace(".", "_")
    return hasattr(mpi_ops.mpi_lib, f"horovod_torch_allreduce_async_{name}")


if TYPE_CHECKING:  # Horovod has no type information: its Compressor is Any to the checker
    from horovod.torch.compression import Compressor as _Compressor
else:
    _, _Compressor = _horovod()


class CodecCompressor(_Compressor):
    """A Horovod Compressor over a linear commopt codec, dividing by the world size first.

    ``size``: the number of ranks that sum (default: Horovod's size, or the process set's
    when ``process_set`` is given; read at the first ``compress``, after ``hvd.init()``).
    Tensors that are not float32 pass through unchanged.

        >>> c = CodecCompressor("fp16", size=4)
        >>> wire, ctx = c.compress(torch.tensor([60000.0, -1.0]))
        >>> wire.dtype, wire.tolist()
        (torch.float16, [15000.0, -0.25])
        >>> c.decompress(wire * 4, ctx).tolist()  # Horovod's sum of 4 such wires, back in fp32
        [240000.0, -4.0]
    """

    def __init__(self, codec: str | Codec, *, size: int | None = None, process_set=None):
        self.codec = get_codec(codec)
        if not self.codec.linear or self.codec.wire_dtype is None:
            raise ValueError(
                f"{self.codec!r} is not linear: Horovod sums what compress() returns, which only "
                "works for fp16/bf16 casts. For QSGD use commopt.create_communicator('horovod') "
                "with commopt's optimizer wrapper (scatter-reduce over alltoall/allgather)."
            )
        self._wire_dtype: torch.dtype = self.codec.wire_dtype  # a linear codec's sum dtype
        if size is not None and int(size) < 1:
            raise ValueError(f"size must be a positive number of ranks, got {size}")
        self.size = None if size is None else int(size)
        self.process_set = process_set
        self._checked = False

    def _world(self) -> int:
        if self.size is None:
            hvd, _ = _horovod()
            self.size = self.process_set.size() if self.process_set is not None else hvd.size()
        return self.size

    def _check_transport(self) -> None:
        if self._checked:
            return
        if not horovod_sums(self._wire_dtype):
            raise ValueError(
                f"this Horovod cannot sum {self.codec.wire_dtype} tensors (Horovod 0.28 has no "
                "bfloat16 type). Use Compression.fp16, or commopt.create_communicator('horovod') "
                "whose collectives move bf16 wires with alltoall/allgather and add them in fp32."
            )
        self._checked = True

    def compress(self, tensor: torch.Tensor):
        if tensor.dtype != torch.float32:
            return tensor, None
        self._check_transport()
        n = self._world()
        flat = tensor.detach().reshape(-1).contiguous()
        wire = torch.empty(
            self.codec.encoded_nbytes(flat.numel()), dtype=torch.uint8, device=tensor.device
        )
        self.codec.encode(flat, wire, scale=1.0 / n)  # divide first: the sum of n cannot overflow
        return wire.view(self._wire_dtype).view(tensor.shape), (tensor.shape, n)

    def decompress(self, tensor: torch.Tensor, ctx):
        if ctx is None:
            return tensor
        shape, n = ctx
        out = torch.empty(shape, dtype=torch.float32, device=tensor.device)
        wire = tensor.contiguous().reshape(-1).view(torch.uint8)
        self.codec.decode_scaled(wire, out.view(-1), alpha=float(n))  # undo the 1/n in fp32
        return out

    def __repr__(self) -> str:
        return f"CodecCompressor({self.codec.name}, size={self.size})"


class Compression:
    """Ready-made adapters, like ``horovod.torch.Compression`` (world size read at first use).

    ``Compression.fp16`` and ``Compression.bf16`` are shared instances; make your own
    ``CodecCompressor(codec, process_set=...)`` for a process set.
    """

    fp16 = CodecCompressor("fp16")
    bf16 = CodecCompressor("bf16")
