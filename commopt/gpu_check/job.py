"""One rank's result file in the device check's child processes (see commopt.gpu_check.jobs)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class Job:
    """One rank's result file, written as the job goes."""

    def __init__(self, result_dir: Path, params: dict):
        from commopt.comm.launcher import detect_launcher

        self.params = params
        self.rank = detect_launcher().rank
        self.path = Path(result_dir) / f"rank{self.rank}.json"
        self.details: dict[str, Any] = {}
        self._end = time.monotonic() + float(params.get("deadline_s", 60.0))
        self.save(ok=False, error="did not finish (killed at its time limit?)")

    @property
    def device(self) -> str:
        return self.params.get("device", "cpu")

    def time_left(self) -> float:
        return self._end - time.monotonic()

    def save(self, *, ok: bool, error: str | None = None, tb: str | None = None) -> None:
        record = {"ok": ok, "details": self.details, "error": error, "traceback": tb}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1, default=str))
        tmp.replace(self.path)


def sync_device(device: str) -> None:
    """Wait for the work queued on the device (nothing to wait for on the CPU)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
