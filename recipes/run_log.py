"""What a recipe's run reports: JSON lines for machines, a tqdm bar or text lines for people.

Only rank 0 reports; on every other rank each method does nothing. A record is one JSON
object a line: ``event`` (what happened: ``config``, ``train``, ``eval`` ...), ``time`` (Unix
time, to line up the logs of several runs), ``wall`` (seconds since the log was opened), then
the caller's fields. Floats keep 6 significant digits; a value that is not finite (a loss
that diverged) is written as ``null``, so every line is strict JSON.

The progress display follows ``progress``: ``bar`` (tqdm on stderr), ``text`` (plain lines),
``none`` (nothing shown; the records are still written) or ``auto`` (a bar on a terminal,
lines otherwise, so CI logs stay readable).

    >>> import io, json
    >>> out = io.StringIO()
    >>> log = RunLog(rank=0, stream=out, progress="text", out=sys.stdout)
    >>> log.event("valid", echo=True, update=1, loss=2.5000001)  # doctest: +ELLIPSIS
    [valid] wall ... | update 1 | loss 2.5
    >>> log.event("train", update=2, loss=float("nan"))  # a record only
    >>> log.advance(1, "update 2 loss 2.4")  # with no bar, the status is printed
    update 2 loss 2.4
    >>> [(r["event"], r["loss"]) for r in map(json.loads, out.getvalue().splitlines())]
    [('valid', 2.5), ('train', None)]
    >>> RunLog(rank=1, stream=out, progress="text").write("rank 1 says nothing")
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

PROGRESS_MODES = ("auto", "bar", "text", "none")


def _clean(value: Any) -> Any:
    """6 significant digits for floats, ``None`` for inf and NaN (JSON has neither)."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


class RunLog:
    """Rank 0's JSON-lines records (to ``path`` or ``stream``) and progress display.

    ``path`` is opened for appending (its folder is created); ``stream`` is any open text
    file the caller keeps. ``total`` and ``initial`` size the bar (``total`` 0: unknown).
    Text lines go to ``out`` (stderr unless given); while a bar shows they go above it.
    """

    def __init__(
        self,
        *,
        rank: int,
        path: str | Path | None = None,
        stream: IO[str] | None = None,
        progress: str = "auto",
        total: int = 0,
        initial: int = 0,
        unit: str = "step",
        out: IO[str] | None = None,
    ):
        if progress not in PROGRESS_MODES:
            raise ValueError(
                f"progress must be one of {', '.join(PROGRESS_MODES)}, got {progress!r}"
            )
        self.active = rank == 0
        self.start = time.time()
        self._stream = stream if self.active else None
        self._owns_stream = False
        self._show = self.active and progress != "none"
        self._out = out
        self._bar = None
        if not self.active:
            return
        if self._stream is None and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._stream = open(path, "a", encoding="utf-8")
            self._owns_stream = True
        if progress == "bar" or (progress == "auto" and sys.stderr.isatty()):
            try:
                from tqdm import tqdm
            except ImportError as exc:
                if progress == "bar":
                    raise ImportError(
                        "the progress bar needs tqdm: pip install tqdm (or ask for text lines)"
                    ) from exc
                return  # auto: text lines show the progress instead
            self._bar = tqdm(
                total=total or None,
                initial=initial,
                unit=unit,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    @property
    def bar_shown(self) -> bool:
        """Whether a progress bar is up (then the bar, not text lines, shows the progress)."""
        return self._bar is not None

    def event(self, event: str, *, echo: bool = False, **fields: Any) -> None:
        """Append one record; with ``echo`` also show it as a line ``[event] wall ... | k v``."""
        if not self.active:
            return
        record = {
            "event": event,
            "time": round(time.time(), 3),
            "wall": round(time.time() - self.start, 3),
            **_clean(fields),
        }
        if self._stream is not None:
            self._stream.write(json.dumps(record) + "\n")
            self._stream.flush()  # a run that is killed keeps every record written so far
        if echo:
            text = " | ".join(f"{k} {v}" for k, v in record.items() if k not in ("event", "time"))
            self.write(f"[{event}] {text}")

    def advance(self, n: int = 1, status: str = "") -> None:
        """Move the bar ``n`` steps with ``status`` beside it; with no bar, print ``status``."""
        if not self._show:
            return
        if self._bar is not None:
            if status:  # before the update, which redraws the bar with it
                self._bar.set_postfix_str(status, refresh=False)
            self._bar.update(n)
        elif status:
            self.write(status)

    def write(self, text: str) -> None:
        """A line for people: above the bar when one shows, else on ``out``."""
        if not self._show:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stderr)
        else:
            print(text, file=self._out or sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._owns_stream and self._stream is not None:
            self._stream.close()
        self._stream = None

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
