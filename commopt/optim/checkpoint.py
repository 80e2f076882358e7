"""What a MultiNodeOptimizer adds to a checkpoint, and the checks that it fits on load.

The optimizer's ``state_dict()`` stores its part under ``"commopt"``: counters, seed, and per
plan part (keyed by the plan's text, ``"plans"``) its reduction number, bucket keys and the
schedule's own state (a pending double-buffered reduction: averaged, the same on every
rank); and *this rank's* codec state per part (error-feedback residuals differ per rank),
with the keys a schedule declares as this rank's own (``own_keys``: compensated double
buffering's predicted weights, local steps' inner state) lifted to the top and listed in
``"rank_keys"`` (``key@plan`` where several parts declare the same key). Nothing is
gathered: each rank saves its own communication state, so a checkpoint does not grow with the
number of ranks and no rank ever holds a peer's residuals (``save_checkpoint`` in
:mod:`commopt.optim.checkpoint_files` writes the per-rank part with
``torch.distributed.checkpoint``).

Earlier formats still load (:func:`upgrade`): version 2's one-plan state (written flat, with
the reduction number as ``"iteration"``) and its several-plan state (keyed
``"compression=..., double_buffering=..."``, where ``True`` meant the plain stale schedule),
and version 1's codec states of every rank.

    >>> extra = {
    ...     "version": STATE_VERSION,
    ...     "rank": 0,
    ...     "world_size": 2,
    ...     "buckets": ["b0"],
    ...     "codec_state": {"compressed": {"residuals": {}}},
    ... }
    >>> check_compatible(extra, ["b0"], rank=0, size=2)
    >>> drop_codec_state({"commopt": extra})["commopt"]["codec_state"]
    {}
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commopt.comm.base import Communicator
    from commopt.optim.apply_step import StepApplier
    from commopt.optim.reduction_counter import ReductionCounter
    from commopt.reducer import GradientReducer

__all__ = [
    "STATE_VERSION",
    "PartState",
    "check_compatible",
    "drop_codec_state",
    "has_codec_state",
    "join_rank_state",
    "load_plans_state",
    "own_codec_state",
    "plans_state",
    "split_rank_state",
    "upgrade",
]

#: 3: every optimizer's parts keyed by plan (``"plans"``), the reduction number saved as
#: ``"reduction"``; 2: each rank's own ``codec_state``; 1: ``codec_states`` of every rank.
STATE_VERSION = 3
_READS = (1, 2, STATE_VERSION)

#: What a plan part saves besides its schedule's state.
REDUCTION = "reduction"
#: Between a schedule's own key and its part's key where several parts save that key.
OWNER = "@"

_RESUME_HINT = (
    "resume with the same number of ranks, each rank loading the state it saved "
    "(commopt.optim.save_checkpoint / load_checkpoint do), or start the residuals afresh "
    "with commopt.optim.drop_codec_state(state_dict) before load_state_dict (error "
    "feedback then restarts from zero residuals: the next steps lose the carried error)"
)


class PartState:
    """One plan part as the checkpoint sees it: its key, counter, reducer, and (when saving)
    its schedule's state and the keys of that state that are this rank's own."""

    def __init__(
        self,
        key: str,
        counter: ReductionCounter,
        reducer: GradientReducer,
        schedule_state: dict[str, Any] | None = None,
        own_keys: Sequence[str] = (),
    ) -> None:
        self.key = key
        self.counter = counter
        self.reducer = reducer
        self.schedule_state = schedule_state
        self.own_keys = tuple(own_keys)


def plans_state(
    *, comm: Communicator, seed: int, applier: StepApplier, parts: Sequence[PartState]
) -> dict[str, Any]:
    """The optimizer's part of its state dict, combined from its components' state dicts.

    ``parts``: per plan part, its schedule's ``state_dict()`` taken first (it completes the
    pending reduction, which may give a skipped step's number back).
    """
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "world_size": comm.size,
        "rank": comm.rank,
        "seed": seed,
        **applier.state_dict(),
        "plans": {},
        "codec_state": {},
        "rank_keys": [],
    }
    declared: dict[str, int] = {}
    for part in parts:
        for k in part.own_keys:
            declared[k] = declared.get(k, 0) + 1
    for part in parts:
        schedule_state = dict(part.schedule_state or {})
        for k in part.own_keys:
            value = schedule_state.pop(k, None)
            # A key one part declares keeps its name; parts that declare the same key (two
            # local-steps parts: each its own residuals and inner state) save it per part.
            name = k if declared[k] == 1 else f"{k}{OWNER}{part.key}"
            state["rank_keys"].append(name)
            state[name] = value
        state["plans"][part.key] = {
            REDUCTION: part.counter.saved(part.reducer),
            "buckets": [b.key for b in part.reducer.buckets],
            **schedule_state,
        }
        state["codec_state"][part.key] = part.reducer.codec_states()  # this rank's own only
    return state


_OLD_KEY = re.compile(r"^compression=(.*), double_buffering=(True|False|compensated)$")
#: What version 2's ``double_buffering`` meant: ``True`` was the plain stale schedule.
_OLD_SCHEDULES = {"False": "synchronous", "True": "stale", "compensated": "compensated"}


def upgrade(extra: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """Version 1 and 2 states in version 3's shape (``keys``: this optimizer's plan keys).

    A one-plan state (no ``"plans"``) becomes the one part of an optimizer with one part; a
    several-plan state's keys are renamed (``double_buffering=True`` was the stale schedule).
    """
    version = extra.get("version")
    if version == STATE_VERSION or version not in _READS:
        return extra
    out: dict[str, Any] = {
        k: extra[k] for k in ("version", "rank", "world_size", "seed") if k in extra
    }
    out.update({k: extra[k] for k in ("applied_steps", "skipped_steps")})
    out["rank_keys"] = ["predicted"]
    out["predicted"] = extra.get("predicted")
    if "plans" not in extra:
        if "compensated" in extra:
            schedule = "compensated"
        elif extra.get("double_buffering"):
            schedule = "stale"
        else:
            schedule = "synchronous"
        if len(keys) != 1:
            raise ValueError(
                f"the checkpoint holds one plan for every parameter (schedule {schedule!r}) "
                f"but this optimizer has {len(keys)} ({'; '.join(keys)}): load it into an "
                "optimizer created with one compression and one schedule for every parameter "
                f"(double_buffering={schedule!r}; the double_buffering=True of the commopt "
                "that wrote it is 'stale' now)"
            )
        part = {REDUCTION: extra["iteration"], "buckets": extra["buckets"]}
        part.update({k: extra[k] for k in ("db_buffer", "pending", "compensated") if k in extra})
        out["plans"] = {keys[0]: part}
        if version == 1:
            out["codec_states"] = extra["codec_states"]
        else:
            out["codec_state"] = {keys[0]: extra.get("codec_state", {})}
        return out
    renamed: dict[str, str] = {}
    for old in extra["plans"]:
        match = _OLD_KEY.match(old)
        if match is None:
            raise ValueError(f"unknown plan key {old!r} in a version {version} checkpoint")
        renamed[old] = f"compression={match[1]}, schedule={_OLD_SCHEDULES[match[2]]}"
    out["plans"] = {}
    for old, new in renamed.items():
        part = dict(extra["plans"][old])
        part[REDUCTION] = part.pop("iteration")
        out["plans"][new] = part
    codec_state = extra.get("codec_state", {})
    out["codec_state"] = {renamed[k]: v for k, v in codec_state.items() if k in renamed}
    return out


def load_plans_state(
    extra: dict[str, Any],
    *,
    comm: Communicator,
    applier: StepApplier,
    parts: Sequence[PartState],
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Restore :func:`plans_state`'s ``extra`` (every part checked first; earlier versions
    upgraded). Returns the saved seed and, per plan key, the state its schedule restores."""
    keys = [part.key for part in parts]
    extra = upgrade(extra, keys)
    saved = _match_parts(extra.get("plans"), keys)
    codec_state = extra.get("codec_state", {})  # DCP drops empty dicts
    per_part = {}
    for part in parts:
        own = {**extra["plans"][saved[part.key]]}
        own.update({k: extra[k] for k in ("version", "rank", "world_size") if k in extra})
        if extra.get("version") == 1:
            own["codec_states"] = extra["codec_states"]
        else:
            own["codec_state"] = codec_state.get(saved[part.key], {})
        check_compatible(own, [b.key for b in part.reducer.buckets], rank=comm.rank, size=comm.size)
        per_part[part.key] = own
    for part in parts:
        own = per_part[part.key]
        part.reducer.load_codec_states(own_codec_state(own, comm.rank))
        part.counter.next = int(own[REDUCTION])
        for k in extra.get("rank_keys", []):
            base, _, owner = k.partition(OWNER)
            if not owner:
                own[k] = extra.get(k)
            elif owner == saved[part.key]:
                own[base] = extra.get(k)
    applier.load_state_dict(extra)
    return int(extra["seed"]), per_part


def _compression_of(key: str) -> str:
    return key.rsplit(", schedule=", 1)[0]


def _match_parts(saved: dict[str, Any] | None, keys: Sequence[str]) -> dict[str, str]:
    """This optimizer's plan key -> the checkpoint's part it loads.

    The same plans, or the same compressions part by part, in order: a part saved under
    another schedule loads when that schedule can take its state (a synchronous part refuses
    pending double-buffered gradients, a part that does not predict refuses predicted weights,
    each naming the schedule to use). Anything else is refused here, naming both.
    """
    if saved is not None and sorted(saved) == sorted(keys):
        return {k: k for k in keys}
    if saved is not None and [_compression_of(k) for k in saved] == [
        _compression_of(k) for k in keys
    ]:
        return dict(zip(keys, saved))
    found = "none" if saved is None else "; ".join(saved)
    count = "none" if saved is None else "several plans" if len(saved) > 1 else "one plan"
    raise ValueError(
        f"the checkpoint holds {count} ({found}) and this optimizer "
        f"{'several' if len(keys) > 1 else 'one'} ({'; '.join(keys)}): load it into an "
        "optimizer created with the same per-group compression and schedule (a default "
        "schedule that leaves some parameters synchronous chooses plans too: "
        "synchronous_embeddings= and synchronous_vectors= as when it was saved)"
    )


def has_codec_state(codec_state: dict[str, Any]) -> bool:
    """Whether a codec state holds anything (error-feedback residuals)."""
    return any(_nonempty(v) for v in codec_state.values())


def _nonempty(state: Any) -> bool:
    if isinstance(state, dict):
        return any(_nonempty(v) for v in state.values())
    return state is not None


def check_compatible(
    extra: dict[str, Any], bucket_keys: list[str], *, rank: int, size: int
) -> None:
    """Raise a ValueError saying what to change when ``extra`` cannot be loaded here."""
    version = extra.get("version")
    if version not in _READS:
        raise ValueError(
            f"unknown commopt state version {version!r} (this commopt reads "
            f"{', '.join(map(str, _READS))}): upgrade commopt"
        )
    if extra["buckets"] != bucket_keys:
        raise ValueError(
            "the checkpoint's gradient buckets differ from this optimizer's: load it into "
            "the same model with the same bucket_cap_mb and compression"
        )
    if version == 1:
        states = extra["codec_states"]
        if any(has_codec_state(s) for s in states) and len(states) != size:
            raise ValueError(
                f"the checkpoint holds codec state (error feedback) of "
                f"{len(states)} ranks but this job has {size}: {_RESUME_HINT}"
            )
        return
    if not has_codec_state(extra.get("codec_state", {})):
        return
    if extra["world_size"] != size:
        raise ValueError(
            f"the checkpoint holds codec state (error feedback) saved by rank "
            f"{extra['rank']} of {extra['world_size']} ranks but this job has {size}: "
            f"{_RESUME_HINT}"
        )
    if extra["rank"] != rank:
        raise ValueError(
            f"rank {rank}: this state dict holds rank {extra['rank']}'s codec state (error "
            f"feedback residuals); each rank must load the state it saved itself: "
            f"{_RESUME_HINT}"
        )


def own_codec_state(extra: dict[str, Any], rank: int) -> dict[str, Any]:
    """The codec state this rank restores (version 1: its entry of every rank's)."""
    if extra.get("version") == 1:
        states = extra["codec_states"]
        own: dict[str, Any] = states[rank] if len(states) > 1 else states[0]
        return own
    saved: dict[str, Any] = extra.get("codec_state", {})  # DCP drops empty dicts
    return saved


def drop_codec_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of an optimizer state dict without codec state: residuals restart at zero.

    For resuming error feedback with another number of ranks (or from one rank's state on
    every rank): everything else (inner optimizer, counters, seed) still restores.
    """
    sd = dict(state_dict)
    extra = dict(sd["commopt"])
    extra.pop("codec_states", None)
    extra["version"] = STATE_VERSION
    extra["codec_state"] = {}
    extra.setdefault("rank", 0)
    sd["commopt"] = extra
    return sd


def split_rank_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(replicated, own)``: what every rank holds alike, and this rank's codec state.

    >>> sd = {"state": {}, "commopt": {"rank": 1, "world_size": 2, "codec_state": {"c": {}}}}
    >>> split_rank_state(sd)
    ({'state': {}, 'commopt': {}}, {'rank': 1, 'world_size': 2, 'codec_state': {'c': {}}})
    >>> join_rank_state(*split_rank_state(sd)) == sd
    True
    """
    replicated = dict(state_dict)
    extra = dict(replicated["commopt"])
    own = {k: extra.pop(k) for k in ("rank", "world_size", "codec_state")}
    for k in extra.get("rank_keys", ["predicted"]):  # e.g. compensated's predicted weights
        if k in extra:
            own[k] = extra.pop(k)
    replicated["commopt"] = extra
    return replicated, own


def join_rank_state(replicated: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_rank_state`."""
    sd = dict(replicated)
    sd["commopt"] = {**replicated["commopt"], **own}
    return sd
