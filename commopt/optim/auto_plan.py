"""``compression="auto"``: a per-tensor plan chosen from sizes, the link's rate and compute time.

:class:`AutoPlanner` is the decision alone, with no communicator: given each tensor's name and
shape (and whether the policy lets it be compressed, and whether its plan is double-buffered),
the link's rate and the measured compute time, it returns an :class:`AutoPlan`, one codec name
per tensor, which serialises to JSON. The optimizer wrapper measures, asks rank 0's planner,
broadcasts the JSON and turns it into ``plans=`` rules (one per tensor).

The cost model (documented in docs/optimizer.md): a plan's *expected time to the target* is
its seconds per step on this link and compute times its *step multiplier*, the steps it needs
to the target relative to fp32's (:mod:`commopt.optim.step_multipliers`: a table the
time-to-accuracy benchmark records, shipped with the package).

- the options (:data:`OPTIONS`): ``none`` (the uncompressed codec), ``bf16``, ``qsgd8``,
  ``qsgd4+ef``, ``powersgd4``, ``powersgd2``, ``powersgd1``, ``qsgd2+ef``; QSGD applies to
  tensors the compression policy lets through, low rank to those and only to matrices that
  rank ``r`` shrinks by at least ``PowerSGD.min_compression_rate``;
- a tensor's wire time under an option: its wire bytes (the codec's ``encoded_nbytes``, or
  the low-rank codec's ``wire_numel``) over the link's rate; its codec time: its elements
  times the option's codec cost per element, measured on the parameters' device when the
  wrapper decides (:func:`measure_codec_costs`; :data:`CODEC_SECONDS_PER_ELEMENT` without a
  measurement);
- seconds per step: the compute time between two steps, plus the synchronous tensors' time
  beyond the backward pass they overlap, at least every tensor's time (the link carries it
  all each step; double-buffered tensors overlap a whole step), plus the codec time that does
  not overlap compute (on a GPU codec kernels overlap compute like the wire; on a CPU they
  take compute's cores, ``codec_overlaps=False``);
- the step multiplier: the element-weighted mean over the tensors of their option's
  multiplier, times the schedule's for the double-buffered tensors;
- greedy: start with every tensor exact; move the one tensor (or tied group) to the option
  that lowers the expected time the most, until no move lowers it by more than 0.1%. Ties go
  to the earlier tensor, so the plan is deterministic;
- local steps (a schedule registered as ``local_steps``, with ``H`` steps between averages):
  one average of the outer gradients every ``H`` steps, the outer gradients sent with the
  option (one for every tensor it applies to, the rest exact) of least expected time:
  ``(step + its exposed wire and codec time / H) x multiplier(H) x the option's
  outer-gradient multiplier``, only with options the table prices for outer gradients (a
  low-rank outer gradient keeps a few directions of H steps' progress and trains far
  slower); with ``overlap_steps``, each fragment's wire time beyond that many steps of
  compute is exposed, without, all of it; chosen when that is lower than the best per-step
  plan's.

    >>> planner = AutoPlanner()
    >>> tensors = [TensorInfo("fc.weight", (1024, 1024)), TensorInfo("fc.bias", (1024,))]
    >>> planner.plan(tensors, link_rate=1e12, backward_s=0.01, step_s=0.03).choices
    {'fc.weight': 'none', 'fc.bias': 'none'}
    >>> slow = planner.plan(tensors, link_rate=125e6, backward_s=0.01, step_s=0.03)
    >>> slow.choices["fc.weight"] != "none", slow.choices["fc.bias"]
    (True, 'none')
    >>> AutoPlan.from_json(slow.to_json()) == slow
    True
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from commopt.optim.step_multipliers import StepMultipliers
from commopt.tables import table

__all__ = [
    "CODEC_SECONDS_PER_ELEMENT",
    "OPTIONS",
    "AutoPlan",
    "AutoPlanner",
    "AutoPlanning",
    "ComputeTimer",
    "TensorInfo",
    "link_rate_setting",
    "measure_codec_costs",
    "parse_rate",
    "probe_link_rate",
]

#: The codecs the planner chooses from (their step multipliers: the package's table,
#: :mod:`commopt.optim.step_multipliers`). fp16 and QSGD without error feedback are left
#: out: bf16 and QSGD with error feedback move the same bytes with float32's range and with
#: the error carried to the next step.
OPTIONS = ("none", "bf16", "qsgd8", "qsgd4+ef", "powersgd4", "powersgd2", "powersgd1", "qsgd2+ef")

#: The codec's own work per gradient element, encode and decode of one reduction (seconds):
#: an estimate for one CPU core streaming at a few GB/s (a cast reads 4 bytes and writes 2,
#: QSGD makes two passes and draws random numbers, low rank ``r`` does about ``8 r``
#: multiply-adds per element in its matrix products). The wrapper measures them instead
#: (:func:`measure_codec_costs`); these serve a planner given no measurement.
CODEC_SECONDS_PER_ELEMENT: dict[str, float] = {
    "none": 0.0,
    "bf16": 1e-9,
    "qsgd8": 4e-9,
    "qsgd4+ef": 5e-9,
    "qsgd2+ef": 5e-9,
    "powersgd4": 4e-9,
    "powersgd2": 2.5e-9,
    "powersgd1": 1.5e-9,
}

_RATE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b|bps|bit/s|b/s)?\s*$", re.IGNORECASE
)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_rate(text: object) -> float:
    """A link rate in bytes per second: a number (bytes/s), or ``"1gbit"``, ``"100mbit"``,
    ``"125MB"`` (decimal units; ``bit`` divides by 8).

    >>> parse_rate("1gbit"), parse_rate("125MB"), parse_rate(2.5e6)
    (125000000.0, 125000000.0, 2500000.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RATE.match(str(text))
        if m is None:
            raise ValueError(
                f"cannot read the link rate {text!r}: give bytes per second (125e6) or a rate "
                "such as '1gbit', '100mbit' or '125MB'"
            )
        value = float(m.group(1)) * _SCALE[m.group(2).lower()]
        if (m.group(3) or "").lower().startswith("bit"):
            value /= 8
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"the link rate must be a positive number of bytes/s, got {text!r}")
    return value


@dataclass(frozen=True)
class TensorInfo:
    """One tensor the planner chooses for: its name, shape, whether the compression policy
    lets it be compressed, whether its plan is double-buffered, and ``tie``: tensors with the
    same ``tie`` get the same option (the wrapper ties the compensated tensors: it has one
    compensated plan at most)."""

    name: str
    shape: tuple[int, ...]
    compressible: bool = True
    double_buffered: bool = False
    tie: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class AutoPlan:
    """The chosen option of every tensor, and the inputs it was chosen from (JSON-able)."""

    choices: dict[str, str]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    wire_bytes: dict[str, int] = field(default_factory=dict)
    inputs: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    #: the schedule the plan chose for the default plan (None: the wrapper's own)
    schedule: str | None = None
    #: expected seconds to the target relative to fp32's steps, per candidate: ``exact``
    #: (every tensor exact), ``per_step`` (the best per-step plan), ``local_steps`` (where
    #: priced) and ``chosen``
    expected_s: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "choices": self.choices,
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "wire_bytes": self.wire_bytes,
                "inputs": self.inputs,
                "fits": self.fits,
                "schedule": self.schedule,
                "expected_s": self.expected_s,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> AutoPlan:
        """The plan :meth:`to_json` wrote (checked: a ValueError names what is wrong)."""
        try:
            data = json.loads(text)
            choices = {str(k): str(v) for k, v in data["choices"].items()}
            plan = cls(
                choices=choices,
                shapes={str(k): tuple(int(d) for d in v) for k, v in data["shapes"].items()},
                wire_bytes={str(k): int(v) for k, v in data["wire_bytes"].items()},
                inputs={str(k): float(v) for k, v in data["inputs"].items()},
                fits=bool(data["fits"]),
                # (absent from plans saved before the cost model: the wrapper's schedule)
                schedule=None if data.get("schedule") is None else str(data["schedule"]),
                expected_s={str(k): float(v) for k, v in data.get("expected_s", {}).items()},
            )
        except (TypeError, KeyError, AttributeError, ValueError) as err:
            raise ValueError(
                f"not an automatic plan's JSON ({err!r}): {str(text)[:80]!r}"
            ) from None
        unknown = sorted(set(choices.values()) - set(OPTIONS))
        if unknown:
            raise ValueError(f"automatic plan with unknown options {unknown}; known: {OPTIONS}")
        return plan

    def rules(self) -> list[tuple[str, dict[str, object]]]:
        """``plans=`` rules: one per tensor, its exact name (``fnmatch`` specials escaped)."""
        return [
            (re.sub(r"([\[\]*?])", r"[\1]", name), {"compression": _compression(option)})
            for name, option in self.choices.items()
        ]

    def table(self) -> str:
        """The plan as a terminal table: tensor, shape, choice, wire bytes per reduction."""
        rows = [
            [
                name,
                "x".join(str(d) for d in self.shapes.get(name, ())),
                option,
                str(self.wire_bytes.get(name, 0)),
            ]
            for name, option in self.choices.items()
        ]
        return table(["tensor", "shape", "choice", "bytes"], rows, plain=True)

    def summary(self) -> str:
        """The expected times and the step multipliers they used, one line each."""
        expected = ", ".join(f"{k} {v:.4g} s" for k, v in sorted(self.expected_s.items()))
        used = ", ".join(
            f"{k.removeprefix('multiplier.')} x{v:g}"
            for k, v in sorted(self.inputs.items())
            if k.startswith("multiplier.")
        )
        return (
            f"schedule: {self.schedule or 'as given'}; expected time to the target, in "
            f"seconds per fp32 step to it (seconds per step x step multiplier): {expected}\n"
            f"step multipliers: {used}"
        )


def _fragments_of(
    units: Sequence[Sequence[int]], tensors: Sequence[TensorInfo], fragments: int
) -> list[list[int]]:
    """The units (indices into ``units``) of each local-steps fragment: near-equal elements,
    as the schedule splits its tensors (one fragment: every unit)."""
    if fragments <= 1 or len(units) <= 1:
        return [list(range(len(units)))]
    from commopt.optim.schedules.local_steps import balanced_fragments

    sizes = [sum(tensors[i].numel for i in unit) for unit in units]
    return balanced_fragments(sizes, min(int(fragments), len(units)))


def _compression(option: str) -> str | None:
    return None if option == "none" else option


class AutoPlanner:
    """Chooses each tensor's option (:data:`OPTIONS`), and where priced the local-steps
    schedule, for the least expected time to the target.

    ``multipliers``: the step multipliers (default: the package's table,
    :class:`~commopt.optim.step_multipliers.StepMultipliers`); ``codec_seconds_per_element``: the codec cost per element of each option (default
    :data:`CODEC_SECONDS_PER_ELEMENT`); ``exact_bytes_per_element``: the uncompressed
    codec's (4: float32); ``codec_overlaps``: whether codec work overlaps compute (True on a
    GPU; False where the codec shares the processor compute runs on, as on a CPU).
    """

    def __init__(
        self,
        *,
        codec_seconds_per_element: Mapping[str, float] | None = None,
        exact_bytes_per_element: int = 4,
        codec_overlaps: bool = True,
        multipliers: StepMultipliers | None = None,
    ) -> None:
        self.multipliers = StepMultipliers.load() if multipliers is None else multipliers
        self.codec_cost = dict(CODEC_SECONDS_PER_ELEMENT)
        if codec_seconds_per_element is not None:
            self.codec_cost.update(codec_seconds_per_element)
        self.exact_bytes = int(exact_bytes_per_element)
        self.codec_overlaps = bool(codec_overlaps)
        self._codecs: dict[str, object] = {}

    def _codec(self, option: str) -> Any:
        from commopt.codecs import get_codec

        found = self._codecs.get(option)
        if found is None:
            found = self._codecs[option] = get_codec(option)
        return found

    def wire_bytes(self, option: str, tensor: TensorInfo) -> int | None:
        """Bytes each rank sends for ``tensor`` under ``option`` (None: not applicable)."""
        from commopt.codecs import PowerSGD

        n = tensor.numel
        if option == "none":
            return n * self.exact_bytes
        if not tensor.compressible or n == 0:
            return None
        codec = self._codec(option)
        if isinstance(codec, PowerSGD):
            if len(tensor.shape) < 2:
                return None
            lay = codec.placement(n, [(0, tensor.shape)])
            if not lay.matrices:  # too small for this rank to save a factor
                return None
            return 4 * codec.wire_numel(n, [(0, tensor.shape)])
        return int(codec.encoded_nbytes(n))

    def plan(
        self,
        tensors: Sequence[TensorInfo],
        *,
        link_rate: float,
        backward_s: float,
        step_s: float,
        schedule: str = "synchronous",
        local_steps: int | None = None,
        local_fragments: int = 1,
        local_overlap: int = 0,
    ) -> AutoPlan:
        """The plan for ``tensors`` on a link of ``link_rate`` bytes/s, with a backward pass
        of ``backward_s`` and a step (compute between two reductions) of ``step_s`` seconds:
        the one of least expected time to the target (seconds per step x the step
        multiplier). ``schedule``: the double-buffered tensors' schedule (its multiplier
        counts for them); ``local_steps``: the steps between averages of the local-steps
        schedule, priced as a candidate beside the per-step plans (None: not a candidate),
        with ``local_fragments`` fragments of near-equal bytes, each fragment's transfer
        overlapping ``local_overlap`` inner steps."""
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError("the planner needs one name per tensor; some names repeat")
        if not link_rate > 0:
            raise ValueError(f"link_rate must be > 0 bytes/s, got {link_rate!r}")
        table = self.multipliers
        sched_m = table.schedule(schedule)
        # The units that move together: a tensor, or the tensors that share a ``tie``.
        units: list[list[int]] = []
        tied: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            if t.tie is None:
                units.append([i])
            elif t.tie in tied:
                tied[t.tie].append(i)
            else:
                tied[t.tie] = [i]
                units.append(tied[t.tie])
        # Each unit's applicable options: (option, each member's wire bytes, time that
        # overlaps compute, codec time that does not, elements x step multiplier). A tied
        # member that an option does not apply to travels exactly under it (as the
        # compression policy does). The first is always ``none``.
        Choice = tuple[str, list[int], float, float, float]
        menus: list[list[Choice]] = []
        for unit in units:
            menu: list[Choice] = []
            for option in OPTIONS:
                sizes = [self.wire_bytes(option, tensors[i]) for i in unit]
                if all(b is None for b in sizes):
                    continue
                wire = [
                    tensors[i].numel * self.exact_bytes if b is None else b
                    for i, b in zip(unit, sizes)
                ]
                per_element = self.codec_cost.get(option, 0.0)
                wire_s = sum(b / link_rate for b in wire)
                codec_s = sum(
                    per_element * tensors[i].numel
                    for i, size in zip(unit, sizes)
                    if size is not None
                )
                mass = sum(
                    tensors[i].numel
                    * (table.codec(option) if size is not None else 1.0)
                    * (sched_m if tensors[i].double_buffered else 1.0)
                    for i, size in zip(unit, sizes)
                )
                inside, outside = (
                    (wire_s + codec_s, 0.0) if self.codec_overlaps else (wire_s, codec_s)
                )
                menu.append((option, wire, inside, outside, mass))
            menus.append(menu)
        synchronous = [not tensors[unit[0]].double_buffered for unit in units]
        total_numel = sum(t.numel for t in tensors)

        def expected(sync_in: float, all_in: float, outside: float, mass: float) -> float:
            # Seconds per step: compute, plus the synchronous reduction's time beyond the
            # backward pass it overlaps; the link cannot carry more than its time per step
            # (everything it moves); codec time outside compute adds. Times the plan's step
            # multiplier: the element-weighted mean of its tensors'.
            period = max(step_s + max(0.0, sync_in - backward_s), all_in) + outside
            return period * (mass / total_numel if total_numel else sched_m)

        at = [0] * len(units)
        totals = [
            sum(menus[u][0][2] for u in range(len(units)) if synchronous[u]),
            sum(menus[u][0][2] for u in range(len(units))),
            sum(menus[u][0][3] for u in range(len(units))),
            sum(menus[u][0][4] for u in range(len(units))),
        ]
        exact_s = now = expected(*totals)
        # Greedy: the one change of one unit's option that lowers the expected time the most,
        # until none lowers it by more than 0.1%. Each move lowers it, so this ends; ties go
        # to the earlier unit and option, so the plan is deterministic.
        for _ in range(len(units) * len(OPTIONS) * 4 + 1):
            best: tuple[float, int, int, list[float]] | None = None
            for u, menu in enumerate(menus):
                cur = menu[at[u]]
                for j, nxt in enumerate(menu):
                    if j == at[u]:
                        continue
                    d_in, d_out, d_mass = nxt[2] - cur[2], nxt[3] - cur[3], nxt[4] - cur[4]
                    moved = [
                        totals[0] + (d_in if synchronous[u] else 0.0),
                        totals[1] + d_in,
                        totals[2] + d_out,
                        totals[3] + d_mass,
                    ]
                    gain = now - expected(*moved)
                    if gain <= 1e-3 * now or gain <= 1e-12:
                        continue
                    if best is None or gain > best[0]:
                        best = (gain, u, j, moved)
            if best is None:
                break
            at[best[1]], totals = best[2], best[3]
            now = expected(*totals)
        fits = totals[0] <= backward_s * (1 + 1e-9) and totals[1] <= step_s * (1 + 1e-9)
        priced: dict[str, float] = {"exact": exact_s, "per_step": now}
        chosen_schedule: str | None = None
        if local_steps is not None:
            m_local = table.local_steps(int(local_steps))
            if m_local is not None:
                # Local steps: one average of the outer gradients every H steps. The outer
                # gradients travel with one option, on every tensor it applies to (the others
                # exact), priced as a per-step plan is: its wire and codec time, once per H
                # steps, and its step multiplier times the schedule's. With overlap, each
                # fragment's time that can overlap compute hides behind its overlapped inner
                # steps; without, nothing hides.
                split = _fragments_of(units, tensors, local_fragments)
                hidden_s = step_s * max(0, int(local_overlap))
                local_s, picks, per_sync = math.inf, [0] * len(units), 0.0
                for option in OPTIONS:
                    m_outer = table.outer_codec(option)
                    if m_outer is None:
                        continue  # not known to train as outer gradients (low rank, for one)
                    pick = [
                        next((j for j, c in enumerate(menu) if c[0] == option), 0) for menu in menus
                    ]
                    if option != OPTIONS[0] and not any(pick):
                        continue  # applies to no tensor: the exact price, already counted
                    sync_s = sum(
                        max(0.0, sum(menus[u][pick[u]][2] for u in part) - hidden_s)
                        + sum(menus[u][pick[u]][3] for u in part)
                        for part in split
                    )
                    mass = sum(
                        sum(tensors[i].numel for i in unit) * (m_outer if pick[u] else 1.0)
                        for u, unit in enumerate(units)
                    )
                    price = (step_s + sync_s / int(local_steps)) * m_local
                    price *= mass / total_numel if total_numel else 1.0
                    if price < local_s * (1 - 1e-9):
                        local_s, picks, per_sync = price, pick, sync_s
                priced["local_steps"] = local_s
                if local_s < now * (1 - 1e-3):
                    chosen_schedule, now = "local_steps", local_s
                    at = picks
                    fits = step_s + per_sync / int(local_steps) <= step_s * (1 + 1e-9)
        priced["chosen"] = now
        choices: dict[str, str] = {}
        wire_bytes: dict[str, int] = {}
        for u, unit in enumerate(units):
            option, wire, _, _, _ = menus[u][at[u]]
            for i, b in zip(unit, wire):
                choices[tensors[i].name], wire_bytes[tensors[i].name] = option, b
        inputs = {
            "link_rate": float(link_rate),
            "backward_s": backward_s,
            "step_s": step_s,
            "codec_overlaps": float(self.codec_overlaps),
            **{f"codec_s_per_element.{k}": float(v) for k, v in self.codec_cost.items()},
            **table.as_inputs(),
        }
        if local_steps is not None:
            inputs["local_steps"] = float(local_steps)
            if local_fragments != 1 or local_overlap:
                inputs["local_fragments"] = float(local_fragments)
                inputs["local_overlap"] = float(local_overlap)
        return AutoPlan(
            choices={t.name: choices[t.name] for t in tensors},
            shapes={t.name: t.shape for t in tensors},
            wire_bytes={t.name: wire_bytes[t.name] for t in tensors},
            inputs=inputs,
            fits=fits,
            schedule=chosen_schedule,
            expected_s=priced,
        )


def _codec_work(
    codec: Any, flat: Any, sample: Sequence[tuple[int, ...]], decodes: int
) -> Callable[[int], None]:
    """One reduction's codec arithmetic on ``flat`` (the tensors of ``sample`` laid end to
    end), as a function of the step number (random numbers are keyed by it)."""
    import torch

    from commopt.codecs import PowerSGD, RngKey

    if isinstance(codec, PowerSGD):
        shapes, at = [], 0
        for shape in sample:
            shapes.append((at, shape))
            at += math.prod(shape)
        grad = flat.clone()

        def low_rank(i: int) -> None:
            flat.copy_(grad)
            reduction = codec.start(flat, shapes, key="probe", factor=1.0, size=1, reduction=i)
            reduction.after_p_sum()
            reduction.after_q_sum()

        return low_rank
    wire = torch.empty(codec.encoded_nbytes(flat.numel()), dtype=torch.uint8, device=flat.device)
    acc = torch.zeros_like(flat)
    n_dec = 1 if codec.linear else decodes

    def encode_decode(i: int) -> None:
        codec.encode(flat, wire, scale=1.0, rng=RngKey(0, 0, i), key="probe")
        for _ in range(n_dec):
            codec.decode(wire, acc, accumulate=True)

    return encode_decode


def measure_codec_costs(
    tensors: Sequence[TensorInfo],
    *,
    size: int,
    device: Any = None,
    sample_elements: int = 1 << 21,
    repeats: int = 2,
) -> dict[str, float]:
    """Each option's codec seconds per element on ``device``, timed on the tensors it applies
    to (the largest first, ``sample_elements`` elements at most: a larger tensor's leading
    rows; random values): a flat codec's encode and the decodes a ring allreduce of ``size``
    ranks makes of it
    (``2 (size - 1) / size`` of the buffer, at least once), a low-rank codec's whole
    arithmetic (P, orthogonalisation, Q, the product and the residual), the fastest of
    ``repeats`` after one untimed run. Options that apply to no tensor are left out.
    """
    import torch

    from commopt.codecs import get_codec

    device = torch.device("cpu") if device is None else torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    shapes_of = AutoPlanner()
    decodes = max(1, round(2 * (size - 1) / size)) if size > 1 else 1
    gen = torch.Generator(device="cpu").manual_seed(0)
    costs: dict[str, float] = {}
    for option in OPTIONS[1:]:
        usable = sorted(
            (t for t in tensors if shapes_of.wire_bytes(option, t) is not None),
            key=lambda t: -t.numel,
        )
        sample: list[tuple[int, ...]] = []  # shapes; a large tensor's leading rows only
        room = sample_elements
        for t in usable:
            shape = t.shape or (1,)
            inner = math.prod(shape[1:])
            rows = min(shape[0], room // max(1, inner))
            if rows < 1 or (
                rows < shape[0]
                and shapes_of.wire_bytes(option, TensorInfo("", (rows, *shape[1:]))) is None
            ):
                break
            sample.append((rows, *shape[1:]))
            room -= rows * inner
        numel = sum(math.prod(shape) for shape in sample)
        if numel == 0:
            continue
        flat = torch.randn(numel, generator=gen).to(device)
        work = _codec_work(get_codec(option), flat, sample, decodes)
        work(0)
        best = math.inf
        for i in range(1, repeats + 1):
            sync(device)
            start = time.perf_counter()
            work(i)
            sync(device)
            best = min(best, time.perf_counter() - start)
        costs[option] = best / numel
    return costs


class ComputeTimer:
    """The compute time of the first steps: the backward pass (first gradient ready to the
    end of backward) and the time between two steps (the end of one ``step()`` to the start of
    the next). The first ``skip`` steps are not counted; :attr:`done` after ``steps`` more."""

    def __init__(self, steps: int, skip: int = 1) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"auto_measure_steps must be an integer >= 1, got {steps!r}")
        self.steps, self.skip = steps, skip
        self.seen = 0  # step() calls finished
        self._first_grad: float | None = None
        self._backward: float | None = None  # this step's (last backward's) duration
        self._step_end: float | None = None
        self._backwards: list[float] = []
        self._betweens: list[float] = []

    def grad_ready(self) -> None:
        if self._first_grad is None:
            self._first_grad = time.perf_counter()

    def backward_end(self) -> None:
        if self._first_grad is not None:
            self._backward = time.perf_counter() - self._first_grad
            self._first_grad = None

    def step_begin(self) -> None:
        if self.seen >= self.skip and self._step_end is not None:
            self._betweens.append(time.perf_counter() - self._step_end)
            if self._backward is not None:
                self._backwards.append(self._backward)
        self._backward = None
        self._first_grad = None

    def step_end(self) -> None:
        self.seen += 1
        self._step_end = time.perf_counter()

    @property
    def done(self) -> bool:
        return self.seen >= self.skip + self.steps

    def measured(self) -> tuple[float, float]:
        """(backward seconds, seconds between steps): medians of the counted steps."""
        between = statistics.median(self._betweens) if self._betweens else 0.0
        backward = statistics.median(self._backwards) if self._backwards else 0.0
        return min(backward, between) if between else backward, between


def probe_link_rate(
    comm: Any, nbytes: int = 4 << 20, repeats: int = 3, device: Any = None
) -> float:
    """The rate of ``comm``'s float32 allreduce, in bytes of input per second: one
    allreduce of ``nbytes`` to warm up, then the fastest of ``repeats`` (a collective call:
    every rank runs it; each returns its own measurement)."""
    import torch

    if comm.size == 1:
        return math.inf
    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    comm.allreduce(buf)
    best = math.inf
    for _ in range(repeats):
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        start = time.perf_counter()
        comm.allreduce(buf)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / max(best, 1e-9)


class AutoPlanning:
    """The wrapper's ``compression="auto"``: the link's rate, the compute timer while the
    first steps reduce exactly, and the plan once chosen (None until then)."""

    def __init__(
        self,
        link_rate: float,
        measure_steps: int,
        *,
        schedule: str = "synchronous",
        local_steps: int | None = None,
        local_fragments: int = 1,
        local_overlap: int = 0,
    ) -> None:
        self.link_rate = float(link_rate)
        #: the wrapper's schedule (the double-buffered tensors' multiplier) and the local-steps
        #: schedule's steps between averages (None: not a candidate), fragments and overlap
        self.schedule = schedule
        self.local_steps = local_steps
        self.local_fragments = int(local_fragments)
        self.local_overlap = int(local_overlap)
        self.timer = ComputeTimer(measure_steps)
        self.plan: AutoPlan | None = None
        self.logged = False

    @property
    def measuring(self) -> bool:
        return self.plan is None

    def decide(
        self,
        tensors: Sequence[TensorInfo],
        exact_bytes_per_element: int = 4,
        *,
        size: int = 2,
        device: Any = None,
    ) -> AutoPlan:
        """Rank 0's plan from the measured compute time and the codecs' costs measured now
        on ``device`` (the caller broadcasts it). Codec work overlaps compute on a GPU and
        takes compute's cores on a CPU."""
        import torch

        device = torch.device("cpu") if device is None else torch.device(device)
        backward_s, step_s = self.timer.measured()
        planner = AutoPlanner(
            exact_bytes_per_element=exact_bytes_per_element,
            codec_seconds_per_element=measure_codec_costs(tensors, size=size, device=device),
            codec_overlaps=device.type != "cpu",
        )
        return planner.plan(
            tensors,
            link_rate=self.link_rate,
            backward_s=backward_s,
            step_s=step_s,
            schedule=self.schedule,
            local_steps=self.local_steps,
            local_fragments=self.local_fragments,
            local_overlap=self.local_overlap,
        )

    def describe(self) -> str:
        """What every rank must share (compared with the other settings)."""
        if self.plan is None:
            return f"auto, measuring {self.timer.steps} steps"
        schedule = f"schedule={self.plan.schedule}; " if self.plan.schedule else ""
        return "auto: " + schedule + "; ".join(f"{k}={v}" for k, v in self.plan.choices.items())


def link_rate_setting(value: object, world_size: int, environ: Mapping[str, str]) -> float | None:
    """The allreduce rate (bytes of input per second) from ``auto_link_rate=`` or the
    ``COMMOPT_LINK_RATE`` environment variable (None: neither; probe the link).

    A link rate becomes an allreduce rate through the ring allreduce's traffic: each rank
    sends ``2 (size - 1) / size`` times the buffer.

    >>> link_rate_setting("1gbit", 2, {})
    125000000.0
    >>> link_rate_setting(None, 4, {"COMMOPT_LINK_RATE": "1gbit"})
    83333333.33333333
    """
    if value is None:
        value = environ.get("COMMOPT_LINK_RATE") or None
    if value is None:
        return None
    rate = parse_rate(value)
    if world_size > 1:
        rate /= 2 * (world_size - 1) / world_size
    return rate
