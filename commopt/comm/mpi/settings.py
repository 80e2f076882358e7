"""The pipelined-transfer settings of the mpi communicator: options, environment, defaults.

Pure functions (no MPI started): which path a collective takes (:func:`transfer_path`) and
how large its segments are (:func:`pipeline_settings`, :func:`default_segment_bytes`).
"""

from __future__ import annotations

import os

from commopt.units import parse_bytes

__all__ = [
    "DEFAULT_PIPELINE_MIN_BYTES",
    "OMPI_TCP_EAGER_DEFAULT",
    "PIPELINE_ENV",
    "PIPELINE_MIN_ENV",
    "POLL_SLEEP_ENV",
    "SEGMENT_ENV",
    "WAIT_ENV",
    "default_segment_bytes",
    "pipeline_settings",
    "transfer_path",
    "wait_settings",
]

PIPELINE_ENV = "COMMOPT_MPI_PIPELINE"  # auto (default), on, off
SEGMENT_ENV = "COMMOPT_MPI_SEGMENT_BYTES"  # default: from the eager limit
PIPELINE_MIN_ENV = "COMMOPT_MPI_PIPELINE_MIN_BYTES"  # default: DEFAULT_PIPELINE_MIN_BYTES
WAIT_ENV = "COMMOPT_MPI_WAIT"  # paced (default), polled, spin
POLL_SLEEP_ENV = "COMMOPT_MPI_POLL_SLEEP_US"  # longest sleep between polls (200)
_WAIT_MODES = ("paced", "polled", "spin")
#: Open MPI's TCP eager limit (bytes, header included) when nothing else says otherwise.
OMPI_TCP_EAGER_DEFAULT = 64 * 1024
#: Below this a buffer goes to MPI's own collective: few segments, nothing to pipeline.
DEFAULT_PIPELINE_MIN_BYTES = 256 * 1024
_HEADER_SLACK = 1024  # room for the PML/BTL headers, which count against the eager limit
_PIPELINE_MODES = {
    "auto": "auto",
    "on": "on",
    "1": "on",
    "true": "on",
    "yes": "on",
    "off": "off",
    "0": "off",
    "false": "off",
    "no": "off",
}


def pipeline_settings(
    pipeline=None, segment_bytes=None, min_bytes=None, environ=None
) -> tuple[str, int, int]:
    """(mode, segment bytes, smallest pipelined buffer) from the options, else the environment.

    >>> pipeline_settings("on", "1M", 0, environ={})
    ('on', 1048576, 0)
    >>> pipeline_settings(environ={"COMMOPT_MPI_PIPELINE": "off"})[0]
    'off'
    """
    environ = os.environ if environ is None else environ
    if pipeline is None:
        pipeline = environ.get(PIPELINE_ENV, "auto")
    if isinstance(pipeline, bool):
        pipeline = "on" if pipeline else "off"
    mode = _PIPELINE_MODES.get(str(pipeline).strip().lower())
    if mode is None:
        raise ValueError(
            f"pipeline={pipeline!r}: use 'auto', 'on' or 'off' (option or {PIPELINE_ENV})"
        )
    if segment_bytes is None:
        segment_bytes = environ.get(SEGMENT_ENV) or default_segment_bytes(environ)
    if min_bytes is None:
        min_bytes = environ.get(PIPELINE_MIN_ENV) or DEFAULT_PIPELINE_MIN_BYTES
    seg = parse_bytes(segment_bytes, "segment_bytes")
    if seg < 8:
        raise ValueError(
            f"segment_bytes={segment_bytes!r} is too small: give at least 8 bytes "
            f"(just under the transport's eager limit is best, e.g. 60K)"
        )
    return mode, seg, parse_bytes(min_bytes, "pipeline_min_bytes")


def transfer_path(mode: str, nbytes: int, *, size: int, inter_size: int, min_bytes: int) -> str:
    """How a collective of ``nbytes`` runs (the same answer on every rank).

    ``"pipelined"``: segmented point-to-point transfers (buffers of at least ``min_bytes``);
    ``"polled"``: MPI's own nonblocking collective, completed by polling with short sleeps
    (smaller buffers); ``"blocking"``: MPI's own blocking collective. ``auto`` uses the first
    two between nodes, where TCP carries the bytes, and the last within a node, where MPI's
    shared memory transport has no such problem; ``on`` uses them everywhere; ``off`` never.

        >>> transfer_path("auto", 64 << 20, size=2, inter_size=2, min_bytes=256 << 10)
        'pipelined'
        >>> transfer_path("auto", 4096, size=2, inter_size=2, min_bytes=256 << 10)
        'polled'
        >>> transfer_path("auto", 64 << 20, size=2, inter_size=1, min_bytes=256 << 10)
        'blocking'
    """
    if mode == "off" or size == 1 or (mode == "auto" and inter_size == 1):
        return "blocking"
    return "pipelined" if nbytes >= max(1, min_bytes) else "polled"


def default_segment_bytes(environ=None) -> int:
    """Segment size for pipelined transfers: just under the TCP eager limit.

    mpirun passes ``--mca btl_tcp_eager_limit`` to the ranks as
    ``OMPI_MCA_btl_tcp_eager_limit`` (``commopt launch`` sets 1 MiB); without it, Open MPI's
    default (64 KiB) applies.

        >>> default_segment_bytes({})
        61440
        >>> default_segment_bytes({"OMPI_MCA_btl_tcp_eager_limit": "1048576"})
        1044480
    """
    environ = os.environ if environ is None else environ
    limit = environ.get("OMPI_MCA_btl_tcp_eager_limit")
    limit = parse_bytes(limit, "OMPI_MCA_btl_tcp_eager_limit") if limit else OMPI_TCP_EAGER_DEFAULT
    return max(4096, (limit - _HEADER_SLACK) // 4096 * 4096)


def wait_settings(environ=None) -> tuple[str, float]:
    """(how the worker thread waits for a request, longest sleep between polls in seconds).

    ``paced`` (default): a segment's receive first naps through the previous segment's
    wait (each nap half of what remains of it, at most 1 ms), then polls as ``polled`` does
    (a third of the wake-ups, a quarter less processor time at 1 Gbit/s: see
    docs/benchmarks-allreduce.md); ``polled``: sleeps that double from 10 us up to the
    longest sleep between polls; ``spin``: MPI_Wait (Open MPI spins in its progress
    loop; a longest sleep of 0 means the same).

        >>> wait_settings({})
        ('paced', 0.0002)
        >>> wait_settings({"COMMOPT_MPI_WAIT": "polled", "COMMOPT_MPI_POLL_SLEEP_US": "0"})
        ('spin', 0.0)
    """
    environ = os.environ if environ is None else environ
    mode = str(environ.get(WAIT_ENV, "paced")).strip().lower()
    if mode not in _WAIT_MODES:
        raise ValueError(f"{WAIT_ENV}={mode!r}: use one of {', '.join(_WAIT_MODES)}")
    text = environ.get(POLL_SLEEP_ENV, "200")
    try:
        sleep_us = float(text)
    except ValueError:
        sleep_us = -1.0
    if not 0 <= sleep_us <= 1e6:
        raise ValueError(
            f"{POLL_SLEEP_ENV}={text!r}: give microseconds between 0 and 1000000, "
            f"e.g. 200 (0 waits in MPI_Wait)"
        )
    return ("spin" if sleep_us == 0 else mode), sleep_us / 1e6
