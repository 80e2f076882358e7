"""What a MultiNodeOptimizer adds to a checkpoint: the version, and every rank's codec state.

The optimizer's ``state_dict()`` stores its part under ``"commopt"`` (counters, seed,
bucket keys, the pending double-buffered reduction, codec states); this module gathers
the codec states of every rank (error-feedback residuals differ per rank) without hanging
when a rank never joins, and checks a checkpoint fits the optimizer it is loaded into.

    >>> import commopt
    >>> gather_codec_states(commopt.create_communicator("local"), {"compressed": {}})
    [{'compressed': {}}]
"""
from __future__ import annotations

import os
import threading
from typing import Any

from commopt.comm.base import Communicator

__all__ = ["STATE_VERSION", "STATE_TIMEOUT_ENV", "gather_codec_states", "codec_states_of_rank",
           "check_compatible"]

STATE_VERSION = 1
#: seconds a collective ``state_dict()`` waits for the other ranks before failing.
STATE_TIMEOUT_ENV = "COMMOPT_STATE_DICT_TIMEOUT"


def gather_codec_states(comm: Communicator, codec_states: dict) -> list:
    """Every rank's codec states (a collective call) when any are kept, else just ours."""
    if comm.size > 1 and any(codec_states.values()):
        return _allgather_with_timeout(comm, codec_states)
    return [codec_states]


def check_compatible(extra: dict[str, Any], bucket_keys: list[str], comm: Communicator) -> None:
    """Raise a ValueError saying what to change when ``extra`` cannot be loaded here."""
    if extra.get("version") != STATE_VERSION:
        raise ValueError(f"unknown commopt state version {extra.get('version')!r}")
    if extra["buckets"] != bucket_keys:
        raise ValueError(
            "the checkpoint's gradient buckets differ from this optimizer's: load it into "
            "the same model with the same bucket_cap_mb and compression"
        )
    states = extra["codec_states"]
    if any(states[0].values()) and len(states) != comm.size:
        raise ValueError(
            f"the checkpoint holds codec state (error feedback) of {len(states)} ranks but "
            f"this job has {comm.size}: resume with the same number of ranks"
        )


def codec_states_of_rank(extra: dict[str, Any], rank: int) -> dict:
    """This rank's codec states (the only entry when they were not gathered per rank)."""
    states = extra["codec_states"]
    return states[rank] if len(states) > 1 else states[0]


def _allgather_with_timeout(comm: Communicator, obj) -> list:
    """``comm.allgather_obj`` that fails, instead of hanging, when a rank never joins."""
    timeout = float(os.environ.get(STATE_TIMEOUT_ENV, "300"))
    box: dict[str, Any] = {}

    def run():
        try:
            box["out"] = comm.allgather_obj(obj)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            box["err"] = exc

    t = threading.Thread(target=run, name="commopt-state-dict", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise RuntimeError(
            f"rank {comm.rank}: state_dict() waited {timeout:.0f}s for the other ranks. With "
            "error feedback it gathers every rank's residuals: call opt.state_dict() on every "
            f"rank and save it on rank 0 (timeout: ${STATE_TIMEOUT_ENV})"
        )
    if "err" in box:
        raise box["err"]
    return box["out"]

