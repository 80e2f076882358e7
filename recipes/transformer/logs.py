"""What a run reports: a tqdm progress bar on rank 0 for people, JSON lines for machines.

Every record is one JSON object per line with an ``event`` ("config", "train", "valid",
"checkpoint", "final") and the wall time; other ranks log nothing.

    >>> import io, json
    >>> out = io.StringIO()
    >>> log = RunLog(rank=0, json_stream=out, progress=False, total=10)
    >>> log.event("train", update=1, loss=2.5)  # doctest: +ELLIPSIS
    [train] wall ... | update 1 | loss 2.5
    >>> json.loads(out.getvalue())["loss"]
    2.5
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def _clean(value):
    if isinstance(value, float):
        return None if not math.isfinite(value) else float(f"{value:.6g}")  # 6 significant digits
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class RunLog:
    """JSON-lines records plus a progress bar (tqdm) or, without one, a text line per record."""

    def __init__(
        self,
        *,
        rank: int,
        json_path: str | None = None,
        json_stream=None,
        progress: bool | None = True,
        total: int = 0,
        initial: int = 0,
    ):
        self.active = rank == 0
        self.start = time.time()
        self._stream = json_stream
        self._owns_stream = False
        self._bar = None
        if not self.active:
            return
        if self._stream is None and json_path:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            self._stream = open(json_path, "a", encoding="utf-8")
            self._owns_stream = True
        # progress=None: a bar only on a terminal (CI logs stay readable)
        show = sys.stderr.isatty() if progress is None else progress
        if show:
            try:
                from tqdm import tqdm
            except ImportError as exc:
                raise ImportError(
                    "the progress bar needs tqdm: pip install tqdm (or pass --no-progress-bar)"
                ) from exc
            self._bar = tqdm(
                total=total, initial=initial, unit="upd", dynamic_ncols=True, file=sys.stderr
            )

    def event(self, event: str, **fields) -> None:
        if not self.active:
            return
        record = {"event": event, "wall": round(time.time() - self.start, 3), **_clean(fields)}
        if self._stream is not None:
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()
        if self._bar is None or event != "train":
            text = " | ".join(f"{k} {v}" for k, v in record.items() if k != "event")
            self.write(f"[{event}] {text}")

    def progress(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.update(n)
            if postfix:
                self._bar.set_postfix({k: _clean(v) for k, v in postfix.items()}, refresh=False)

    def write(self, text: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._owns_stream:
            self._stream.close()
        self._stream = None
