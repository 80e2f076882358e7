"""``compression="auto"``: a per-tensor plan chosen from sizes, the link's rate and compute time.

:class:`AutoPlanner` is the decision alone, with no communicator: given each tensor's name and
shape (and whether the policy lets it be compressed, and whether its plan is double-buffered),
the link's rate and the measured compute time, it returns an :class:`AutoPlan`, one codec name
per tensor, which serialises to JSON. The optimizer wrapper measures, asks rank 0's planner,
broadcasts the JSON and turns it into ``plans=`` rules (one per tensor).

The cost model (documented in docs/optimizer.md):

- the options, in a fixed order of compression error (:data:`OPTIONS`): ``none`` (exact: the
  uncompressed codec) < ``bf16`` < ``qsgd8`` < ``qsgd4+ef`` < ``powersgd4`` < ``powersgd2``
  < ``powersgd1`` < ``qsgd2+ef``; QSGD applies to tensors the compression policy lets
  through, low rank to those and only to matrices that rank ``r`` shrinks by at least
  ``PowerSGD.min_compression_rate``;
- a tensor's wire time under an option: its wire bytes (the codec's ``encoded_nbytes``, or
  the low-rank codec's ``wire_numel``) over the link's rate; its codec time: its elements
  times the option's codec cost per element, measured on the parameters' device when the
  wrapper decides (:func:`measure_codec_costs`; :data:`CODEC_SECONDS_PER_ELEMENT` without a
  measurement);
- what must fit: the synchronous tensors' time under the backward pass (they overlap it),
  and every tensor's time under the step (double-buffered tensors overlap a whole step);
- where the codec runs: on a GPU it overlaps compute like the wire does (its time counts in
  the budgets); on a CPU it takes the cores compute uses (``codec_overlaps=False``), so its
  time is added to the step instead;
- the cost of a plan: the time each budget is exceeded by, plus the codec time that does not
  overlap; greedy: start with every tensor exact; while a budget is exceeded, move the tensor
  (among those in an exceeded budget) to the cheaper option, of any of its own, that lowers
  the cost the most per step of error to that option; stop when everything fits or no move
  lowers the cost by more than 0.1% of the step. Ties go to the earlier tensor, so the plan
  is deterministic.

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

#: The options, lowest compression error first. The order's sources: a cast to bf16 keeps 8
#: bits of mantissa (a relative error of at most 2**-9 per element, and float32's range);
#: QSGD's published variance bound, min(d/s**2, sqrt(d)/s) times the squared norm of a bucket
#: of d=128 elements with s levels, is 0.008 at 8 bits (s=127), 1.6 at 4 bits (s=7) and 11 at
#: 2 bits (s=1); PowerSGD's authors (Vogels et al.) report ranks 2 to 4 reaching the
#: uncompressed accuracy on their image and language tasks and rank 1 slightly below, with
#: error feedback; error feedback is added to QSGD at 4 and 2 bits, where the noise is large.
#: Low rank comes after QSGD 4 bits with error feedback as measured by the time-to-accuracy
#: benchmark (docs/benchmarks-accuracy.md): to the same target, DDP's PowerSGD rank 4 with its warm-up
#: needed 215 steps on the text task and 160 on digits, QSGD 4 bits with error feedback 150
#: and 155; rank 1 did not reach the text target in 300 steps.
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

    def to_json(self) -> str:
        return json.dumps(
            {
                "choices": self.choices,
                "shapes": {k: list(v) for k, v in self.shapes.items()},
                "wire_bytes": self.wire_bytes,
                "inputs": self.inputs,
                "fits": self.fits,
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


def _compression(option: str) -> str | None:
    return None if option == "none" else option


class AutoPlanner:
    """Chooses each tensor's option (:data:`OPTIONS`) so the reduction fits the compute time.

    ``codec_seconds_per_element``: the codec cost per element of each option (default
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
    ) -> None:
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
    ) -> AutoPlan:
        """The plan for ``tensors`` on a link of ``link_rate`` bytes/s, with a backward pass
        of ``backward_s`` and a step (compute between two reductions) of ``step_s`` seconds."""
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError("the planner needs one name per tensor; some names repeat")
        if not link_rate > 0:
            raise ValueError(f"link_rate must be > 0 bytes/s, got {link_rate!r}")
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
        # Each unit's applicable options, in error order, each faster than the one before:
        # (error rank, option, each member's wire bytes, time in the budgets, codec time
        # outside them). A tied member that an option does not apply to travels exactly under
        # it (as the compression policy does).
        Rung = tuple[int, str, list[int], float, float]
        ladders: list[list[Rung]] = []
        for unit in units:
            ladder: list[Rung] = []
            for rank, option in enumerate(OPTIONS):
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
                inside, outside = (
                    (wire_s + codec_s, 0.0) if self.codec_overlaps else (wire_s, codec_s)
                )
                if not ladder or inside + outside < ladder[-1][3] + ladder[-1][4]:
                    ladder.append((rank, option, wire, inside, outside))
            ladders.append(ladder)
        at = [0] * len(units)
        budgets = [
            (
                backward_s,
                [u for u, unit in enumerate(units) if not tensors[unit[0]].double_buffered],
            ),
            (step_s, list(range(len(units)))),
        ]

        member_of: list[list[int]] = [[] for _ in units]  # each unit's budgets
        for b, (_, members) in enumerate(budgets):
            for u in members:
                member_of[u].append(b)

        fits = True
        while True:
            # The plan's cost: the seconds each budget is exceeded by, plus the codec time
            # outside the budgets; a move's gain is its change, from the budgets' sums (one
            # pass per move, not one per candidate).
            sums = [sum(ladders[u][at[u]][3] for u in members) for _, members in budgets]
            excess = [max(0.0, total - budget) for total, (budget, _) in zip(sums, budgets)]
            over = sorted(
                {u for b, (_, members) in enumerate(budgets) if excess[b] > 0 for u in members}
            )
            if not over:
                break
            best: tuple[float, int, int] | None = None
            for u in over:
                cur = ladders[u][at[u]]
                # Any cheaper option, not only the next: an option whose codec costs more
                # than the wire it saves must not hide a cheaper one further down.
                for j in range(at[u] + 1, len(ladders[u])):
                    nxt = ladders[u][j]
                    gain = (
                        cur[4]
                        - nxt[4]
                        + sum(
                            excess[b] - max(0.0, sums[b] + nxt[3] - cur[3] - budgets[b][0])
                            for b in member_of[u]
                        )
                    )
                    if gain <= 1e-3 * step_s or gain <= 1e-12:  # too little to pay error for
                        continue
                    score = gain / (nxt[0] - cur[0])
                    if best is None or score > best[0]:
                        best = (score, u, j)
            if best is None:  # no cheaper option of an exceeded budget's units lowers the cost
                fits = False
                break
            at[best[1]] = best[2]
        choices: dict[str, str] = {}
        wire_bytes: dict[str, int] = {}
        for u, unit in enumerate(units):
            _, option, wire, _, _ = ladders[u][at[u]]
            for i, b in zip(unit, wire):
                choices[tensors[i].name], wire_bytes[tensors[i].name] = option, b
        return AutoPlan(
            choices={t.name: choices[t.name] for t in tensors},
            shapes={t.name: t.shape for t in tensors},
            wire_bytes={t.name: wire_bytes[t.name] for t in tensors},
            inputs={
                "link_rate": float(link_rate),
                "backward_s": backward_s,
                "step_s": step_s,
                "codec_overlaps": float(self.codec_overlaps),
                **{f"codec_s_per_element.{k}": float(v) for k, v in self.codec_cost.items()},
            },
            fits=fits,
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

    def __init__(self, link_rate: float, measure_steps: int) -> None:
        self.link_rate = float(link_rate)
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
        return planner.plan(tensors, link_rate=self.link_rate, backward_s=backward_s, step_s=step_s)

    def describe(self) -> str:
        """What every rank must share (compared with the other settings)."""
        if self.plan is None:
            return f"auto, measuring {self.timer.steps} steps"
        return "auto: " + "; ".join(f"{k}={v}" for k, v in self.plan.choices.items())


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
