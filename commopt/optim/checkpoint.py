"""What a MultiNodeOptimizer adds to a checkpoint, and the checks that it fits on load.

The optimizer's ``state_dict()`` stores its part under ``"commopt"``: counters, seed,
bucket keys, the pending double-buffered reduction (averaged: the same on every rank) and
*this rank's* codec state (error-feedback residuals differ per rank). Nothing is gathered:
each rank saves its own communication state, so a checkpoint does not grow with the
number of ranks and no rank ever holds a peer's residuals (``save_checkpoint`` in
:mod:`commopt.optim.checkpoint_files` writes the per-rank part with
``torch.distributed.checkpoint``).

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

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from commopt.comm.base import Communicator
    from commopt.optim.apply_step import StepApplier
    from commopt.optim.reduction_counter import ReductionCounter
    from commopt.reducer import GradientReducer

__all__ = [
    "STATE_VERSION",
    "check_compatible",
    "commopt_state",
    "drop_codec_state",
    "has_codec_state",
    "join_rank_state",
    "load_commopt_state",
    "load_plans_state",
    "own_codec_state",
    "plans_state",
    "split_rank_state",
]

#: 2: each rank's own ``codec_state`` (1: ``codec_states`` of every rank, still loadable).
STATE_VERSION = 2

_RESUME_HINT = (
    "resume with the same number of ranks, each rank loading the state it saved "
    "(commopt.optim.save_checkpoint / load_checkpoint do), or start the residuals afresh "
    "with commopt.optim.drop_codec_state(state_dict) before load_state_dict (error "
    "feedback then restarts from zero residuals: the next steps lose the carried error)"
)


def commopt_state(
    *,
    comm: Communicator,
    seed: int,
    counter: ReductionCounter,
    applier: StepApplier,
    schedule_state: dict[str, Any],
    reducer: GradientReducer,
) -> dict[str, Any]:
    """The optimizer's part of its state dict, combined from its components' state dicts.

    ``schedule_state``: the schedule's ``state_dict()``, taken first (it completes the
    pending reduction, which may give a skipped step's number back).
    """
    state = {
        "version": STATE_VERSION,
        "world_size": comm.size,
        "rank": comm.rank,
        "seed": seed,
        "iteration": counter.saved(reducer),
        **applier.state_dict(),
        **{k: schedule_state[k] for k in ("double_buffering", "db_buffer")},
        "buckets": [b.key for b in reducer.buckets],
        "codec_state": reducer.codec_states(),  # this rank's own only
    }
    state.update({k: v for k, v in schedule_state.items() if k not in state})
    return state


def load_commopt_state(
    extra: dict[str, Any],
    *,
    comm: Communicator,
    counter: ReductionCounter,
    applier: StepApplier,
    reducer: GradientReducer,
) -> int:
    """Restore :func:`commopt_state`'s ``extra`` into the components (checked first).

    Returns the saved seed; the schedule restores its own part afterwards.
    """
    if "plans" in extra:
        raise ValueError(
            f"the checkpoint holds several plans ({'; '.join(sorted(extra['plans']))}) but "
            "this optimizer has one plan for every parameter: load it into an optimizer "
            "created with the same per-group compression and double_buffering"
        )
    rank = comm.rank
    check_compatible(extra, [b.key for b in reducer.buckets], rank=rank, size=comm.size)
    reducer.load_codec_states(own_codec_state(extra, rank))
    seed = int(extra["seed"])
    reducer.seed = seed
    counter.next = int(extra["iteration"])
    applier.load_state_dict(extra)
    return seed


def plans_state(
    *,
    comm: Communicator,
    seed: int,
    applier: StepApplier,
    parts: list[tuple[str, ReductionCounter, GradientReducer, dict[str, Any]]],
) -> dict[str, Any]:
    """:func:`commopt_state` for an optimizer with several plans: each plan's part keyed by
    the plan (``"plans"``), this rank's codec state keyed alike (``"codec_state"``).

    ``parts``: per plan, its key, counter, reducer and schedule state (taken first).
    """
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "world_size": comm.size,
        "rank": comm.rank,
        "seed": seed,
        **applier.state_dict(),
        "plans": {},
        "codec_state": {},
    }
    for key, counter, reducer, schedule_state in parts:
        state["plans"][key] = {
            "iteration": counter.saved(reducer),
            "buckets": [b.key for b in reducer.buckets],
            **{k: v for k, v in schedule_state.items() if k != "predicted"},
        }
        state["codec_state"][key] = reducer.codec_states()  # this rank's own only
        if schedule_state.get("predicted") is not None:  # (one compensated plan at most)
            state["predicted"] = schedule_state["predicted"]
    return state


def load_plans_state(
    extra: dict[str, Any],
    *,
    comm: Communicator,
    applier: StepApplier,
    parts: list[tuple[str, ReductionCounter, GradientReducer]],
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Restore :func:`plans_state`'s ``extra`` (every plan checked first).

    Returns the saved seed and, per plan key, the state its schedule restores.
    """
    keys = [key for key, _, _ in parts]
    saved = extra.get("plans")
    if saved is None or sorted(saved) != sorted(keys):
        found = "one plan for every parameter" if saved is None else "; ".join(sorted(saved))
        raise ValueError(
            f"the checkpoint's plans ({found}) differ from this optimizer's "
            f"({'; '.join(keys)}): load it into an optimizer created with the same "
            "per-group compression and double_buffering (under double_buffering="
            "'compensated' the default rule chooses plans too: synchronous_embeddings= and "
            "synchronous_vectors= as when it was saved)"
        )
    codec_state = extra.get("codec_state", {})  # DCP drops empty dicts
    per_part = {}
    for key, _, reducer in parts:
        per_part[key] = {
            **{k: extra[k] for k in ("version", "rank", "world_size") if k in extra},
            **saved[key],
            "codec_state": codec_state.get(key, {}),
        }
        check_compatible(
            per_part[key], [b.key for b in reducer.buckets], rank=comm.rank, size=comm.size
        )
    for key, counter, reducer in parts:
        reducer.load_codec_states(per_part[key]["codec_state"])
        counter.next = int(per_part[key]["iteration"])
        per_part[key]["predicted"] = extra.get("predicted")
    applier.load_state_dict(extra)
    return int(extra["seed"]), per_part


def has_codec_state(codec_state: dict) -> bool:
    """Whether a codec state holds anything (error-feedback residuals)."""
    return any(_nonempty(v) for v in codec_state.values())


def _nonempty(state) -> bool:
    if isinstance(state, dict):
        return any(_nonempty(v) for v in state.values())
    return state is not None


def check_compatible(
    extra: dict[str, Any], bucket_keys: list[str], *, rank: int, size: int
) -> None:
    """Raise a ValueError saying what to change when ``extra`` cannot be loaded here."""
    version = extra.get("version")
    if version not in (1, STATE_VERSION):
        raise ValueError(
            f"unknown commopt state version {version!r} (this commopt reads 1 "
            f"and {STATE_VERSION}): upgrade commopt"
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


def own_codec_state(extra: dict[str, Any], rank: int) -> dict:
    """The codec state this rank restores (version 1: its entry of every rank's)."""
    if extra.get("version") == 1:
        states = extra["codec_states"]
        return states[rank] if len(states) > 1 else states[0]
    return extra.get("codec_state", {})  # DCP drops empty dicts


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
    if "predicted" in extra:  # compensated double buffering: this rank's predicted weights
        own["predicted"] = extra.pop("predicted")
    replicated["commopt"] = extra
    return replicated, own


def join_rank_state(replicated: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`split_rank_state`."""
    sd = dict(replicated)
    sd["commopt"] = {**replicated["commopt"], **own}
    return sd
