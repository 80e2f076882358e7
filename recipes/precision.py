"""Mixed precision for the recipes: one code path for CUDA and for CPU autocast.

Both recipes resolve their precision option here and then use only :meth:`autocast`,
:meth:`backward` and :meth:`step`, so the bf16 path a CPU runs (and the tests check) is the
code a GPU runs; only the autocast dtype and the loss scaler differ. float16 needs dynamic
loss scaling (GradScaler) and a CUDA device; bfloat16 has fp32's range and runs without one.

    >>> import torch
    >>> mp = MixedPrecision.resolve("bf16", torch.device("cpu"))
    >>> mp.dtype, mp.scaler is None
    (torch.bfloat16, True)
    >>> with mp.autocast():
    ...     y = torch.nn.Linear(2, 2)(torch.ones(1, 2))
    >>> y.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["PRECISIONS", "MixedPrecision"]

#: What a recipe's precision option may say. ``on``: float16 on CUDA, bfloat16 elsewhere;
#: ``auto``: float16 on CUDA, fp32 elsewhere; ``off``: fp32.
PRECISIONS = ("auto", "on", "off", "fp32", "fp16", "bf16")


@dataclass
class MixedPrecision:
    device: torch.device
    dtype: torch.dtype | None  # the autocast dtype; None: fp32 throughout
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def resolve(cls, precision: str, device: torch.device) -> MixedPrecision:
        """The precision ``precision`` means on ``device`` (ValueError says what to use)."""
        cuda = device.type == "cuda"
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        if precision in ("off", "fp32") or (precision == "auto" and not cuda):
            return cls(device, None)
        if precision == "bf16" or (precision == "on" and not cuda):
            return cls(device, torch.bfloat16)
        if not cuda:
            raise ValueError(
                "float16 mixed precision needs a CUDA device (dynamic loss scaling); "
                "use bf16 (or fp32) on the CPU"
            )
        return cls(device, torch.float16, torch.amp.GradScaler(device.type))

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]

    def autocast(self):
        """The forward pass's context (nothing in fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizer) -> None:
        """The optimizer step, through the loss scaler when there is one."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()
