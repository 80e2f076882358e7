"""Fuzz what a peer can send and what a user can pass: codec wires, API arguments, objects.

Hypothesis draws, for every target below, ``--examples`` inputs and checks each:

* ``codec:NAME``: a wire for ``get_codec(NAME)`` (and QSGD with float16 scales, ``Exact``)
  that is random bytes, an honest wire with flipped bits, an honest wire with one scale
  replaced by NaN/Inf/negative/huge, or one that is truncated or oversized; decoded with the
  native and the reference kernels at a random byte offset, with and without accumulation.
  A wrong size must raise ``ValueError`` naming ``encoded_nbytes``; otherwise ``decode``
  raises ``ValueError`` naming the codec or returns, and then: both kernels wrote the same
  bits, nothing outside ``out`` changed, the bytes around the wire made no difference (no
  read out of bounds), and a NaN/Inf in ``out`` only where the codec's ``can_overflow`` makes
  the reduction re-check its result (the step's NaN/Inf agreement then skips the step on
  every rank); a NaN/Inf the reduction would not see is a *silent corruption*.
* ``codec:powersgd1`` / ``codec:powersgd4``: the low-rank codec has no flat wire; what
  arrives is the sum of the ranks' P's, then of their Q's (two allreduces). For a random
  bucket (matrices, convolutions, vectors sent exactly) on 1-3 emulated ranks, one of the two
  sums is replaced by random bytes, flipped bits, one NaN/Inf/huge/tiny value, or bytes too
  few or too many, and handed at a byte offset to ``after_p_sum``/``after_q_sum``. A wrong
  size must raise ``ValueError`` naming the bytes needed; otherwise nothing is written
  outside the bucket, the codec keeps no NaN/Inf in its Q or residual, ``discard_step``
  puts them back bit for bit, and a NaN/Inf in the result is re-checked (``can_overflow``).
* ``kernels:native`` / ``kernels:triton``: ``commopt.kernels.qsgd_decode`` and
  ``cast_decode`` on random wires and settings (any bits, levels, bucket size, scale size),
  bit-identical to the reference kernels, no read or write out of bounds.
* ``api``: ``get_codec``, the codec constructors, ``create_communicator`` and
  ``create_multi_node_optimizer`` with random arguments: a working object or ``ValueError``/
  ``TypeError``, never another exception; an optimizer that was built trains two steps.
* ``objects``: ``commopt.comm.objects`` (what ``bcast_obj``/``allgather_obj`` send): random
  values round-trip; random bytes, damaged messages and messages with hostile JSON trees
  decode to plain values or raise ``ValueError``, never anything else, never a class.

Every target runs in a child process of its own, so a crash (a signal, as a segfault in a
native kernel would be) is counted, not fatal. The record gives per target the examples
run, the outcomes, the failures (hypothesis' smallest failing example) and the crashes.

    python benchmarks/fuzz_wire.py --examples 10000 --out benchmarks/results/fuzz-wire.json
    python benchmarks/fuzz_wire.py --examples 50 --targets codec:qsgd4,objects  # quick
    python benchmarks/fuzz_wire.py --merge a.json b.json --out all.json  # runs side by side
    python benchmarks/fuzz_wire.py --out benchmarks/results/fuzz-wire.json --doc docs/reliability.md

Exits 1 when any target failed or crashed.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

CODECS = ("none", "fp16", "bf16", "qsgd2", "qsgd4", "qsgd8", "qsgd4-fp16scales", "qsgd4+ef")
#: low-rank codecs: no flat wire; their sums of P and Q are fuzzed instead (``check_lowrank``).
LOWRANK_CODECS = ("powersgd1", "powersgd4")
TARGETS = (
    *(f"codec:{c}" for c in CODECS),
    *(f"codec:{c}" for c in LOWRANK_CODECS),
    "codec:exact",
    "kernels:native",
    "kernels:triton",
    "api",
    "objects",
)
#: the Triton kernels run under the interpreter here (tens of ms a call): fewer examples.
TRITON_SHARE = 0.02


class Finding(AssertionError):
    """An input on which a check failed (hypothesis shrinks it)."""


# ----------------------------------------------------------------------------- helpers


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def _same_bits(a: torch.Tensor, b: torch.Tensor, *, zero_sign: bool = True) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (payloads may differ); with
    ``zero_sign=False`` also -0.0 equals 0.0."""
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    if not zero_sign:
        return torch.equal(a[~na], b[~nb])
    view = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return torch.equal(a[~na].view(view), b[~nb].view(view))


def _impl_env(impl: str):
    """Context: COMMOPT_KERNELS=impl (how the codecs pick their CPU kernels)."""

    class _Env:
        def __enter__(self):
            self.old = os.environ.get("COMMOPT_KERNELS")
            os.environ["COMMOPT_KERNELS"] = impl

        def __exit__(self, *exc):
            if self.old is None:
                os.environ.pop("COMMOPT_KERNELS", None)
            else:
                os.environ["COMMOPT_KERNELS"] = self.old

    return _Env()


def _placed(data: torch.Tensor, offset: int, trailer: torch.Tensor) -> torch.Tensor:
    """``data`` at byte ``offset`` of a larger uint8 buffer; what surrounds it is ``trailer``
    (repeated): a kernel reading out of bounds reads those bytes."""
    n = data.numel()
    backing = torch.empty(offset + n + 64, dtype=torch.uint8)
    backing[:offset] = trailer[:offset]
    backing[offset + n :] = trailer[:64]
    backing[offset : offset + n] = data
    return backing[offset : offset + n]


def _guarded_out(init: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` (float32, a copy of ``init``) inside a buffer with 16 sentinel values each side."""
    backing = torch.full((init.numel() + 32,), 1234.5)
    backing[16 : 16 + init.numel()] = init
    return backing[16 : 16 + init.numel()], backing


def _guards_intact(backing: torch.Tensor, n: int) -> bool:
    return bool((backing[:16] == 1234.5).all() and (backing[16 + n :] == 1234.5).all())


# ----------------------------------------------------------------------------- codec targets


def make_codec(name: str):
    from commopt.codecs import QSGD, get_codec
    from commopt.codecs.exact import Exact

    if name == "exact":
        return Exact(torch.float32)
    if name == "qsgd4-fp16scales":
        return QSGD(bits=4, bucket_size=128, scale_dtype=torch.float16)
    return get_codec(name)


SPECIAL_SCALES = (float("nan"), float("inf"), float("-inf"), -1.0, -0.0, 3e38, 1e38, 65504.0, 1e-45)


def _honest_wire(codec, n: int, seed: int) -> torch.Tensor:
    from commopt.codecs import RngKey

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * float(torch.exp(torch.randn(1, generator=gen) * 3))
    wire = torch.empty(codec.encoded_nbytes(n), dtype=torch.uint8)
    codec.encode(x, wire, rng=RngKey(seed, 0, 0), key="fuzz")
    if hasattr(codec, "reset"):  # error feedback: no residual carried into the next example
        codec.reset()
    return wire


def _scale_bytes(codec) -> tuple[int, torch.dtype] | None:
    inner = getattr(codec, "inner", codec)
    if hasattr(inner, "bucket_size") and hasattr(inner, "scale_dtype"):
        return (4 if inner.scale_dtype == torch.float32 else 2), inner.scale_dtype
    return None


def draw_codec_case(data, codec) -> dict:
    """A wire for ``codec``: its kind, bytes, offset, and the decode's arguments."""
    n = data.draw(st.integers(0, 700), label="numel")
    size = codec.encoded_nbytes(n)
    kinds = ["random", "flipped", "flipped", "flipped", "truncated", "oversized"]
    if _scale_bytes(codec) is not None:
        kinds += ["scale", "scale"]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    if kind == "truncated" and size == 0:
        kind = "oversized"
    if kind == "truncated":
        wire = _random_bytes(data.draw(st.integers(0, size - 1), label="nbytes"), seed)
    elif kind == "oversized":
        wire = _random_bytes(size + data.draw(st.integers(1, 64), label="extra"), seed)
    elif kind == "random":
        wire = _random_bytes(size, seed)
    else:
        wire = _honest_wire(codec, n, seed)
        if kind == "flipped" and size:
            for _ in range(data.draw(st.integers(1, 8), label="flips")):
                pos = data.draw(st.integers(0, size - 1), label="byte")
                wire[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif kind == "scale" and n:
            nbytes, dtype = _scale_bytes(codec)
            bucket = getattr(codec, "inner", codec).bucket_size
            b = data.draw(st.integers(0, -(-n // bucket) - 1), label="bucket")
            value = data.draw(st.sampled_from(SPECIAL_SCALES), label="scale")
            wire[b * nbytes : (b + 1) * nbytes] = torch.tensor([value], dtype=dtype).view(
                torch.uint8
            )
    return {
        "n": n,
        "size": size,
        "kind": kind,
        "wire": wire,
        "offset": data.draw(st.integers(0, 3), label="offset"),
        "accumulate": data.draw(st.booleans(), label="accumulate"),
        "alpha": data.draw(st.sampled_from([1.0, -1.0, 0.5]), label="alpha"),
        "seed": seed,
    }


def _decode(codec, case: dict, impl: str | None, trailer: torch.Tensor, init: torch.Tensor):
    """(error or None, out, its guarded backing) of one decode."""
    wire = _placed(case["wire"], case["offset"], trailer)
    out, backing = _guarded_out(init)
    try:
        if impl is None:
            codec.decode_scaled(wire, out, accumulate=case["accumulate"], alpha=case["alpha"])
        else:
            with _impl_env(impl):
                codec.decode_scaled(wire, out, accumulate=case["accumulate"], alpha=case["alpha"])
    except (ValueError, TypeError) as err:
        return err, out, backing
    return None, out, backing


def check_codec(codec, case: dict) -> str:
    """Decode ``case`` with every CPU kernel; the outcome, or raise Finding."""
    from commopt import kernels
    from commopt.codecs.exact import Exact

    n = case["n"]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    init = torch.randn(n, generator=gen) if case["accumulate"] else torch.zeros(n)
    trailers = [_random_bytes(64, case["seed"] + 2), torch.full((64,), 0xFF, dtype=torch.uint8)]
    uses_kernels = not isinstance(codec, Exact)
    impls = (
        (["reference"] + (["native"] if kernels.native_available() else []))
        if uses_kernels
        else [None]
    )
    results = []
    for impl in impls:  # the torch reference cannot read out of bounds: one surrounding
        for trailer in trailers[:1] if impl == "reference" else trailers:
            err, out, backing = _decode(codec, case, impl, trailer, init)
            if not _guards_intact(backing, n):
                raise Finding(f"{impl}: decode wrote outside out")
            results.append((impl, err, out))
    errors = {type(e).__name__ if e else None for _, e, _ in results}
    if len(errors) != 1:
        raise Finding(f"the kernels disagree on raising: {[(i, repr(e)) for i, e, _ in results]}")
    err = results[0][1]
    if case["wire"].numel() != case["size"]:
        if not isinstance(err, ValueError) or "encoded_nbytes" not in str(err):
            raise Finding(f"a {case['kind']} wire gave {err!r}, not a ValueError naming the size")
        return "size rejected"
    if err is not None:
        if not isinstance(err, ValueError) or codec.name.split("+")[0] not in str(err):
            raise Finding(f"unclear error {err!r}")
        return "rejected"
    first = results[0][2]
    for impl, _, out in results[1:]:
        if not _same_bits(first, out):
            raise Finding(f"{impl} decoded other bits than {results[0][0]} (or read out of bounds)")
    return _outcome(codec, first)


def _outcome(codec, decoded: torch.Tensor) -> str:
    """A decoded result's outcome: finite, or NaN/Inf that the reduction re-checks (the
    codec's ``can_overflow``); a NaN/Inf no re-check would see is a silent corruption."""
    if not bool(torch.isfinite(decoded).all()):
        if not codec.can_overflow:
            raise Finding("NaN/Inf decoded by a codec whose reductions do not re-check it")
        return "nan/inf, re-checked"
    return "finite"


# ----------------------------------------------------------------------------- low-rank targets

SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 1e-45, 0.0)
LOWRANK_KEY = "fuzz"


def draw_lowrank_case(data, codec) -> dict:
    """A bucket of tensors, 1-3 emulated ranks, and the damage done to one of the two sums
    (P's, then Q's) that the ranks' allreduces deliver: random bytes, flipped bits, one value
    replaced by NaN/Inf/huge/tiny, truncated or oversized."""
    shapes, at = [], 0
    for _ in range(data.draw(st.integers(1, 3), label="tensors")):
        form = data.draw(st.sampled_from(["matrix", "matrix", "conv", "vector"]), label="form")
        if form == "vector":
            shape: tuple[int, ...] = (data.draw(st.integers(1, 50), label="len"),)
        elif form == "matrix":
            shape = (data.draw(st.integers(1, 48), label="rows"), data.draw(st.integers(1, 48)))
        else:
            shape = (data.draw(st.integers(1, 16), label="out"), data.draw(st.integers(1, 4)), 3, 3)
        at += data.draw(st.integers(0, 3), label="gap")  # elements between: sent exactly
        shapes.append((at, shape))
        at += math.prod(shape)
    numel = at + data.draw(st.integers(0, 3), label="tail")
    lay = codec.placement(numel, shapes)
    stage = data.draw(st.sampled_from(["P", "Q"]), label="stage")
    size = 4 * (lay.p_numel if stage == "P" else lay.q_numel)
    kind = data.draw(
        st.sampled_from(
            ["random", "flipped", "flipped", "value", "value", "truncated", "oversized"]
        ),
        label="kind",
    )
    if kind in ("truncated", "flipped", "value") and size == 0:
        kind = "oversized"
    case = {
        "shapes": shapes,
        "numel": numel,
        "ranks": data.draw(st.integers(1, 3), label="ranks"),
        "warm": data.draw(st.booleans(), label="warm"),  # an honest step first: Q, residual
        "stage": stage,
        "size": size,
        "kind": kind,
        "seed": data.draw(st.integers(0, 2**31 - 1), label="seed"),
        "offset": data.draw(st.integers(0, 3), label="offset"),
    }
    if kind == "truncated":
        case["nbytes"] = data.draw(st.integers(0, size - 1), label="nbytes")
    elif kind == "oversized":
        case["nbytes"] = size + data.draw(st.integers(1, 64), label="extra")
    elif kind == "flipped":
        case["flips"] = [
            (data.draw(st.integers(0, size - 1), label="byte"), data.draw(st.integers(0, 7)))
            for _ in range(data.draw(st.integers(1, 8), label="flips"))
        ]
    elif kind == "value":
        case["at"] = data.draw(st.integers(0, size // 4 - 1), label="at")
        case["value"] = data.draw(st.sampled_from(SPECIAL_VALUES), label="value")
    return case


def _damaged(summed: torch.Tensor, case: dict) -> torch.Tensor:
    """The bytes that arrive in place of the honest float32 sum ``summed``."""
    kind, seed = case["kind"], case["seed"]
    if kind in ("truncated", "oversized"):
        return _random_bytes(case["nbytes"], seed)
    if kind == "random":
        return _random_bytes(summed.numel() * 4, seed)
    wire = summed.clone().view(torch.uint8)
    if kind == "flipped":
        for pos, bit in case["flips"]:
            wire[pos] ^= 1 << bit
    else:
        wire.view(torch.float32)[case["at"]] = case["value"]
    return wire


def _snapshot(codec) -> tuple:
    return tuple(
        None if t is None else t.clone()
        for t in (codec.q(LOWRANK_KEY), codec.residual(LOWRANK_KEY))
    )


def check_lowrank(name: str, case: dict) -> str:
    """One damaged reduction through the low-rank codec's decoding stages; the outcome.

    Every emulated rank runs ``start``; the honest sum of their P's (then Q's) is what an
    allreduce delivers; one stage's sum is damaged and handed, as bytes at an odd offset, to
    rank 0's ``after_p_sum``/``after_q_sum`` (ranks 1.. get the same bytes: an allreduce
    gives every rank the same sum). A wrong size must raise ``ValueError`` naming the size
    needed; otherwise: nothing written outside the bucket, the codec's kept Q and residual
    finite, ``discard_step`` (what a skipped step does) puts them back bit for bit, and a
    NaN/Inf in the result only where ``can_overflow`` makes the reduction re-check it.
    """
    ranks, numel, shapes = case["ranks"], case["numel"], case["shapes"]
    codecs = [make_codec(name) for _ in range(ranks)]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    magnitude = float(torch.exp(torch.randn(1, generator=gen) * 3))

    def grads() -> list[torch.Tensor]:
        return [torch.randn(numel, generator=gen) * magnitude for _ in range(ranks)]

    def start(flats, step):
        return [
            c.start(f, shapes, key=LOWRANK_KEY, factor=1.0 / ranks, size=ranks, reduction=step)
            for c, f in zip(codecs, flats, strict=True)
        ]

    if case["warm"]:  # an honest reduction first: a warm Q and a residual to keep or restore
        jobs = start(grads(), 0)
        p = sum(j.p for j in jobs)
        q = sum(j.after_p_sum(p) for j in jobs)
        for j in jobs:
            j.after_q_sum(q)
    before = _snapshot(codecs[0])
    flats = grads()
    out, backing = _guarded_out(flats[0])
    flats[0] = out
    jobs = start(flats, 1)
    trailer = _random_bytes(64, case["seed"] + 2)
    p = sum(j.p for j in jobs)
    try:
        if case["stage"] == "P":
            wire = _damaged(p, case)
            q = sum(j.after_p_sum(_placed(wire, case["offset"], trailer)) for j in jobs)
            jobs[0].after_q_sum(q)
        else:
            q = sum(j.after_p_sum(p) for j in jobs)
            jobs[0].after_q_sum(_placed(_damaged(q, case), case["offset"], trailer))
        err = None
    except (ValueError, TypeError) as e:
        err = e
    if not _guards_intact(backing, numel):
        raise Finding("the reduction wrote outside the bucket")
    if case["kind"] in ("truncated", "oversized"):
        if not isinstance(err, ValueError) or f"needs {case['size']} bytes" not in str(err):
            raise Finding(
                f"a {case['kind']} sum of {case['stage']} gave {err!r}, not a ValueError "
                f"naming the {case['size']} bytes needed"
            )
        return "size rejected"
    if err is not None:
        raise Finding(f"a sum of the right size raised {err!r}")
    codec = codecs[0]
    for what, kept in zip(("Q", "residual"), _snapshot(codec), strict=True):
        if kept is not None and not bool(torch.isfinite(kept).all()):
            raise Finding(f"NaN/Inf kept in the codec's {what}")
    codec.discard_step()  # what every rank does when the NaN/Inf agreement skips the step
    for what, was, now in zip(("Q", "residual"), before, _snapshot(codec), strict=True):
        if (was is None) != (now is None) or (was is not None and not torch.equal(was, now)):
            raise Finding(f"discard_step did not put the {what} back")
    return _outcome(codec, out)


# ----------------------------------------------------------------------------- kernel targets


@st.composite
def kernel_cases(draw):
    op = draw(st.sampled_from(["qsgd", "qsgd", "cast"]))
    n = draw(st.integers(0, 500))
    seed = draw(st.integers(0, 2**31 - 1))
    if op == "cast":
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
        size = n * torch.empty((), dtype=dtype).element_size()
        return {
            "op": op,
            "n": n,
            "dtype": dtype,
            "size": size,
            "seed": seed,
            "accumulate": draw(st.booleans()),
            "alpha": draw(st.sampled_from([1.0, -1.0, 3.0])),
        }
    bits = draw(st.sampled_from([2, 4, 8]))
    params = {
        "bits": bits,
        "levels": draw(st.integers(1, 2 ** (bits - 1) - 1)),
        "bucket_size": draw(st.sampled_from([1, 2, 3, 7, 64, 128, 333])),
        "scale_bytes": draw(st.sampled_from([4, 2])),
    }
    from commopt import kernels

    size = kernels.qsgd_nbytes(
        n, bits=bits, bucket_size=params["bucket_size"], scale_bytes=params["scale_bytes"]
    )
    return {
        "op": op,
        "n": n,
        "params": params,
        "size": size,
        "seed": seed,
        "accumulate": draw(st.booleans()),
        "alpha": draw(st.sampled_from([1.0, -1.0, 3.0])),
    }


def _kernel_decode(case: dict, impl: str, trailer: torch.Tensor, offset: int):
    from commopt import kernels

    raw = _random_bytes(case["size"], case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    init = torch.randn(case["n"], generator=gen)
    out, backing = _guarded_out(init)
    if case["op"] == "cast":
        elem = torch.empty((), dtype=case["dtype"]).element_size()
        wire = _placed(raw, offset * elem, trailer).view(case["dtype"])
        kernels.cast_decode(
            wire, out, accumulate=case["accumulate"], alpha=case["alpha"], impl=impl
        )
    else:
        wire = _placed(raw, offset, trailer)
        kernels.qsgd_decode(
            wire,
            out,
            accumulate=case["accumulate"],
            alpha=case["alpha"],
            impl=impl,
            **case["params"],
        )
    return out, backing


def check_kernels(case: dict, impl: str) -> str:
    """``impl`` against the reference on random bytes, with two different surroundings."""
    from commopt import kernels

    trailers = [_random_bytes(64, case["seed"] + 2), torch.zeros(64, dtype=torch.uint8)]
    ref, _ = _kernel_decode(case, "reference", trailers[0], 0)
    for k, trailer in enumerate(trailers):
        out, backing = _kernel_decode(case, impl, trailer, k)
        if not _guards_intact(backing, case["n"]):
            raise Finding(f"{impl} wrote outside out")
        # Triton writes +0.0 for a code no encoder writes (sign bit, level 0), the others -0.0
        if not _same_bits(ref, out, zero_sign=impl != "triton"):
            raise Finding(f"{impl} decoded other bits than the reference (or read out of bounds)")
    # a wire of the wrong size is refused before any kernel runs
    if case["op"] == "qsgd" and case["size"]:
        short = torch.zeros(case["size"] - 1, dtype=torch.uint8)
        try:
            kernels.qsgd_decode(short, torch.zeros(case["n"]), impl=impl, **case["params"])
        except ValueError:
            pass
        else:
            raise Finding(f"{impl} decoded a wire one byte short")
    return "identical" if bool(torch.isfinite(out).all()) else "identical (nan/inf)"


# ----------------------------------------------------------------------------- api target

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.sampled_from([torch.float16, torch.int8, torch.bfloat16, torch.float64, object()]),
)


def _names(valid):
    return st.one_of(st.sampled_from(list(valid)), st.text(max_size=12), junk)


@st.composite
def api_cases(draw):
    from commopt.codecs import codec_names

    names = codec_names() + [n + "+ef" for n in codec_names()] + [" QSGD4+EF "]
    kind = draw(
        st.sampled_from(
            [
                "get_codec",
                "QSGD",
                "CastCodec",
                "ErrorFeedback",
                "create_communicator",
                "optimizer",
                "optimizer",
            ]
        )
    )
    if kind == "get_codec":
        return kind, {"spec": draw(_names(names))}
    if kind == "QSGD":
        return kind, {
            k: draw(v)
            for k, v in {
                "bits": st.one_of(st.sampled_from([2, 4, 8]), junk),
                "bucket_size": st.one_of(st.integers(-2, 300), junk),
                "scale": st.one_of(st.sampled_from(["max", "l2"]), junk),
                "stochastic": st.one_of(st.booleans(), junk),
                "levels": st.one_of(st.none(), st.integers(-1, 200), junk),
                "scale_dtype": st.one_of(st.sampled_from([torch.float32, torch.float16]), junk),
            }.items()
            if draw(st.booleans())
        }
    if kind == "CastCodec":
        return kind, {
            "dtype": draw(st.one_of(st.sampled_from([torch.float32, torch.float16]), junk))
        }
    if kind == "ErrorFeedback":
        return kind, {"inner": draw(st.one_of(st.sampled_from(["qsgd4", "fp16"]), junk))}
    if kind == "create_communicator":
        return kind, {
            "name": draw(
                st.one_of(
                    st.just("local"),
                    st.text(max_size=10).filter(
                        lambda s: s not in ("mpi", "torch", "horovod", "nccl", "pure_nccl", "gloo")
                    ),
                )
            ),
            "allreduce_grad_dtype": draw(
                st.one_of(
                    st.sampled_from([None, "float16", "bfloat16", "float32", torch.float16]), junk
                )
            ),
        }
    options = {
        "double_buffering": st.one_of(st.sampled_from([False, True, "compensated"]), junk),
        "zero_fill": st.one_of(st.booleans(), junk),
        "allreduce_grad_dtype": st.one_of(st.sampled_from([None, "float16", "bfloat16"]), junk),
        "compression": st.one_of(st.sampled_from(names), junk),
        "overlap": st.one_of(st.booleans(), junk),
        "bucket_cap_mb": st.one_of(st.floats(-1, 100), junk),
        "seed": st.one_of(st.integers(0, 2**40), junk),
        "algorithm": st.one_of(st.sampled_from(["auto", "native", "scatter_reduce"]), junk),
        "clip_grad_norm": st.one_of(st.none(), st.floats(0.01, 10), junk),
    }
    return kind, {k: draw(v) for k, v in options.items() if draw(st.booleans())}


def check_api(kind: str, kwargs: dict) -> str:
    import commopt
    from commopt.codecs import QSGD, CastCodec, ErrorFeedback, get_codec

    def build():
        if kind == "get_codec":
            return get_codec(**kwargs)
        if kind == "QSGD":
            return QSGD(**kwargs)
        if kind == "CastCodec":
            return CastCodec(**kwargs)
        if kind == "ErrorFeedback":
            inner = kwargs["inner"]
            return ErrorFeedback(get_codec(inner) if inner in ("qsgd4", "fp16") else inner)
        if kind == "create_communicator":
            return commopt.create_communicator(
                kwargs["name"], allreduce_grad_dtype=kwargs["allreduce_grad_dtype"]
            )
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.Linear(40, 3))
        comm = commopt.create_communicator("local")
        opt = commopt.create_multi_node_optimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), comm, model=model, **kwargs
        )
        return model, opt

    try:
        made = build()
    except (ValueError, TypeError) as err:
        if not str(err):
            raise Finding(f"{kind}: {type(err).__name__} without a message") from err
        return "rejected"
    except Exception as err:  # anything else is unclear to the user
        raise Finding(f"{kind}({kwargs!r}) raised {type(err).__name__}: {err}") from err
    try:
        _use(made)
    except Finding:
        raise
    except Exception as err:
        raise Finding(f"{kind}({kwargs!r}) was built but {type(err).__name__}: {err}") from err
    return "built and used"


def _use(made) -> None:
    """Use what ``check_api`` built: a codec round-trips, an optimizer trains two steps."""
    from commopt.codecs import Codec, RngKey

    if isinstance(made, Codec):
        x = torch.linspace(-1, 1, 300)
        wire = torch.empty(made.encoded_nbytes(300), dtype=torch.uint8)
        made.encode(x, wire, rng=RngKey(0, 0, 0), key="k")
        out = torch.zeros(300)
        made.decode(wire, out)
        if not bool(torch.isfinite(out).all()):
            raise Finding(f"{made!r} decoded NaN/Inf from finite input")
    elif isinstance(made, tuple):
        model, opt = made
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(4, 40)).sum().backward()
            opt.step()
        opt.flush()
        weights = torch.nn.utils.parameters_to_vector(model.parameters())
        if not bool(torch.isfinite(weights).all()):
            raise Finding("the optimizer wrote NaN/Inf into the weights")
        opt.close()


# ----------------------------------------------------------------------------- objects target

_ALLOWED_TYPES = (
    type(None),
    bool,
    int,
    float,
    str,
    list,
    dict,
    tuple,
    bytes,
    torch.Tensor,
    torch.dtype,
)


def _plain(value) -> bool:
    """Only the types a message may produce (NumPy arrays included), all the way down."""
    stack = [value]
    while stack:  # not recursive: a message may nest deeper than Python's recursion limit
        v = stack.pop()
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":
            continue
        if not isinstance(v, _ALLOWED_TYPES):
            return False
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return True


leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.sampled_from([torch.float32, torch.bool, torch.int8]),
    st.builds(
        lambda n, s: torch.randn(n, generator=torch.Generator().manual_seed(s)),
        st.integers(0, 5),
        st.integers(0, 99),
    ),
)
values = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=5), inner, max_size=3),
        st.dictionaries(st.integers(), inner, max_size=2),
    ),
    max_leaves=12,
)
json_trees = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-5, 2**65),
        st.floats(),
        st.text(max_size=6),
        st.sampled_from(["float32", "bool", "bfloat16", "cpu", "cuda", "nn", "$tensor"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.builds(
            lambda tag, body: {tag: body},
            st.sampled_from(
                ["$tuple", "$dict", "$bytes", "$dtype", "$tensor", "$ndarray", "$dataclass", "x"]
            ),
            inner,
        ),
        st.dictionaries(st.text(max_size=4), inner, max_size=3),
    ),
    max_leaves=15,
)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


@st.composite
def object_cases(draw):
    from commopt.comm.objects import encode

    kind = draw(
        st.sampled_from(["roundtrip", "random", "damaged", "damaged", "tree", "tree", "deep"])
    )
    if kind == "roundtrip":
        return kind, draw(values)
    if kind == "random":
        return kind, draw(st.binary(max_size=200))
    if kind == "damaged":
        msg = bytearray(encode(draw(values)))
        what = draw(st.sampled_from(["flip", "cut", "extend", "length"]))
        if what == "flip" and msg:
            for _ in range(draw(st.integers(1, 6))):
                msg[draw(st.integers(0, len(msg) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif what == "cut":
            msg = msg[: draw(st.integers(0, len(msg)))]
        elif what == "extend":
            msg += draw(st.binary(min_size=1, max_size=20))
        else:
            msg[:8] = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
        return kind, bytes(msg)
    if kind == "deep":
        depth = draw(st.integers(500, 200000))
        header = (
            (b"[" * depth + b"]" * depth)
            if draw(st.booleans())
            else (b'{"$tuple":[' * depth + b"]}" * depth)
        )
        return kind, len(header).to_bytes(8, "little") + header
    tree = draw(json_trees)
    header = json.dumps(tree).encode()
    return kind, len(header).to_bytes(8, "little") + header + draw(st.binary(max_size=40))


def check_objects(kind: str, payload) -> str:
    from commopt.comm.objects import decode, encode

    if kind == "roundtrip":
        back = decode(encode(payload))
        if not _equal(payload, back):
            raise Finding(f"{payload!r} came back as {back!r}")
        return "round trip"
    try:
        value = decode(payload)
    except ValueError as err:
        if not str(err):
            raise Finding("ValueError without a message") from err
        return "rejected"
    except Exception as err:
        raise Finding(f"decode raised {type(err).__name__}: {err}") from err
    if not _plain(value):
        raise Finding(f"decode returned a {type(value).__name__}")
    return "decoded"


# ----------------------------------------------------------------------------- running


def run_target(target: str, examples: int, seed: int = 0) -> dict:
    """Hypothesis over one target, in this process: the tally and the failure, if any."""
    tally: collections.Counter = collections.Counter()

    if target.removeprefix("codec:") in LOWRANK_CODECS:
        name = target.removeprefix("codec:")
        layout_codec = make_codec(name)  # layouts only: each example builds its own codecs
        strategy = st.data()

        def one(data):
            tally[check_lowrank(name, draw_lowrank_case(data, layout_codec))] += 1

    elif target.startswith("codec:"):
        codec = make_codec(target.split(":", 1)[1])
        strategy = st.data()

        def one(data):
            tally[check_codec(codec, draw_codec_case(data, codec))] += 1

    elif target.startswith("kernels:"):
        impl = target.split(":", 1)[1]
        if impl == "native":
            from commopt import kernels

            if not kernels.native_available():
                return {"skipped": "the native kernels are not built"}
        strategy = kernel_cases()

        def one(case):
            tally[check_kernels(case, impl)] += 1

    elif target == "api":
        strategy = api_cases()

        def one(case):
            tally[check_api(*case)] += 1

    elif target == "objects":
        strategy = object_cases()

        def one(case):
            tally[check_objects(*case)] += 1

    else:
        raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")

    runner = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )(given(strategy)(one))
    start = time.perf_counter()
    failure = None
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner()
    except Finding as err:
        failure = str(err)
    except Exception as err:
        failure = f"{type(err).__name__}: {err}"
    return {
        "examples": sum(tally.values()),
        "outcomes": dict(tally),
        "failure": failure,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _child(target: str, examples: int, timeout: float) -> dict:
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        target,
        "--examples",
        str(examples),
    ]
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    if target == "kernels:triton":
        env["COMMOPT_KERNELS"] = "triton"  # commopt then loads Triton under its interpreter
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"examples": 0, "failure": f"timed out after {timeout} s", "crashed": False}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("FUZZ ")]
    if proc.returncode < 0 or not lines:
        return {
            "examples": 0,
            "crashed": proc.returncode < 0,
            "failure": f"child exited {proc.returncode}: {proc.stderr[-2000:]}",
        }
    return {**json.loads(lines[-1][5:]), "crashed": False}


def merge(paths: list[str]) -> dict:
    """One record from the records of runs over disjoint targets (run side by side)."""
    records = [json.loads(Path(p).read_text()) for p in paths]
    targets = {t: r for rec in records for t, r in rec["targets"].items()}

    def each(field: str) -> list:  # a merged record's lists are flattened
        return [
            v
            for rec in records
            for v in (rec[field] if isinstance(rec[field], list) else [rec[field]])
        ]

    return {
        "command": each("command"),
        "date": max(rec["date"] for rec in records),
        "host": each("host"),
        "examples_per_target": min(rec["examples_per_target"] for rec in records),
        "triton_examples": min(rec["triton_examples"] for rec in records),
        "crashes": sum(rec["crashes"] for rec in records),
        "failed_targets": [t for rec in records for t in rec["failed_targets"]],
        "silent_corruptions": sum(rec["silent_corruptions"] for rec in records),
        "wall_s": each("wall_s"),
        "targets": {t: targets[t] for t in TARGETS if t in targets},
    }


BEGIN, END = "<!-- fuzz: begin -->", "<!-- fuzz: end -->"


def section(record: dict) -> str:
    """The fuzz section of docs/reliability.md, from a record alone."""
    commands = record["command"] if isinstance(record["command"], list) else [record["command"]]
    hosts = record["host"] if isinstance(record["host"], list) else [record["host"]]
    loads = [h["load_average_start"] for h in hosts] + [h["load_average_end"] for h in hosts]
    walls = record["wall_s"] if isinstance(record["wall_s"], list) else [record["wall_s"]]
    ran = " and, side by side, ".join(f"`{c}`" for c in commands)
    lines = [
        BEGIN,
        "## Fuzz: bytes from the wire are untrusted",
        "",
        f"{ran} on {record['date']}, on one host of {hosts[0]['cpus']} cores shared with other "
        f"work (load average {min(loads)}-{max(loads)}; {max(walls)} s)"
        + (
            ", merged with `python benchmarks/fuzz_wire.py --merge ... --out "
            "benchmarks/results/fuzz-wire.json`. "
            if len(commands) > 1
            else ". "
        )
        + f"Hypothesis drew {record['examples_per_target']} examples per target "
        f"({record['triton_examples']} for the Triton kernels, which run under Triton's "
        "interpreter here), derandomized: the same sequence on every run, so codecs whose wires "
        "draw alike see the same inputs (`qsgd4+ef` those of `qsgd4`, `exact` those of "
        "`none`). Each target ran in a process of its own, so a crash would be counted. "
        "Result file: `benchmarks/results/fuzz-wire.json`.",
        "",
        f"**Crashes: {record['crashes']}. Silent corruptions: {record['silent_corruptions']}. "
        f"Failed targets: {', '.join(record['failed_targets']) or 'none'}.**",
        "",
        "| target | examples | outcomes | finding |",
        "|---|---|---|---|",
    ]
    for target, r in record["targets"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.get("outcomes", {}).items()))
        finding = "crash" if r.get("crashed") else (r.get("failure") or "none")
        finding = finding.replace("|", "\\|").replace("\n", " ")[:200]
        lines.append(f"| `{target}` | {r.get('examples', 0)} | {outcomes} | {finding} |")
    lines += [
        "",
        "Outcomes: *size rejected*, a truncated or oversized wire refused with a `ValueError` "
        "naming `encoded_nbytes`; *rejected*, a QSGD scale no encoder writes (negative, or so "
        "large that the levels overflow float32) refused with a `ValueError` naming the "
        "bucket; *finite*, decoded, the same bits from the native and the reference kernels, "
        "nothing written outside the output and nothing read outside the wire (the bytes "
        "around it changed nothing); *nan/inf, re-checked*, as *finite* but the damaged bytes "
        "spelled NaN or Inf (a NaN scale, a NaN float): every codec has `can_overflow` set, so "
        "the reduction re-checks its result and the step's NaN/Inf agreement makes every rank "
        "skip the step (`tests/unit/test_wire_fuzz.py::"
        "test_damaged_scale_is_caught_by_the_nan_agreement_on_every_rank` damages one rank's "
        "scales on 2 gloo ranks: both skip that step, weights untouched; with the re-check off "
        "a rank's weights become NaN). A *silent corruption* would be a NaN/Inf decoded where "
        "no re-check follows. `codec:powersgd*`: the low-rank codec has no flat wire; what "
        "arrives is the sum of the ranks' P's and then of their Q's, so one of the two sums "
        "(for random buckets of matrices, convolutions and vectors on 1-3 emulated ranks) is "
        "replaced by random bytes, flipped bits, one NaN/Inf/huge/tiny value, or bytes too few "
        "or too many, and handed at a byte offset to the codec's `after_p_sum`/`after_q_sum`: "
        "*size rejected* is a `ValueError` naming the bytes the bucket's placement needs; "
        "otherwise nothing is written outside the bucket, no NaN/Inf is kept in the codec's Q "
        "or residual, `discard_step` (what a skipped step does) puts both back bit for bit, "
        "and a NaN/Inf in the result (a damaged Q, or a damaged value sent exactly; a NaN in a "
        "matrix's P only zeroes that column) is re-checked. `api`: the codec constructors, `get_codec`, "
        "`create_communicator` and `create_multi_node_optimizer` with random arguments give a "
        "working object (a codec round-trips, an optimizer trains two steps with finite "
        "weights) or a `ValueError`/`TypeError`. `objects`: `bcast_obj`/`allgather_obj` "
        "messages round-trip, and random, damaged or hostile messages (bad JSON, nesting "
        "200,000 deep, wrong tags, bad offsets, shapes that do not match the bytes, bool bytes "
        "other than 0/1) decode to plain values or raise `ValueError`; nothing is unpickled "
        "and no class is looked up by a name from the message. `kernels:*`: "
        "`commopt.kernels.qsgd_decode`/`cast_decode` on random bytes with any bits, levels, "
        "bucket size and scale size, at odd offsets and with different bytes around the wire: "
        "the same values as the reference kernels (the Triton kernels write 0.0 where the "
        "others write -0.0 for a code no encoder writes, a sign bit on level 0) and no write "
        "outside the output.",
        END,
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10000, help="per target")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated: {TARGETS}")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per target")
    ap.add_argument("--out", help="write the JSON record here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--merge", nargs="+", metavar="RECORD", help="merge records into --out")
    ap.add_argument("--doc", help="write the fuzz section of this page from the --out record")
    args = ap.parse_args(argv)
    if args.doc:  # only renders: python benchmarks/fuzz_wire.py --out RECORD --doc PAGE
        from soak import write_section  # benchmarks/ is this script's directory

        write_section(section(json.loads(Path(args.out).read_text())), Path(args.doc), BEGIN, END)
        return 0
    if args.merge:
        record = merge(args.merge)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        return 1 if record["failed_targets"] else 0
    if args.child:
        torch.set_num_threads(1)
        print("FUZZ " + json.dumps(run_target(args.child, args.examples)), flush=True)
        return 0
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        ap.error(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    start, load0 = time.perf_counter(), os.getloadavg()[0]
    results: dict[str, dict] = {}

    def record() -> dict:
        failed = [t for t, r in results.items() if r.get("failure") or r.get("crashed")]
        return {
            "command": "python benchmarks/fuzz_wire.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "host": {
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_start": round(load0, 2),
                "load_average_end": round(os.getloadavg()[0], 2),
            },
            "examples_per_target": args.examples,
            "triton_examples": max(1, math.ceil(args.examples * TRITON_SHARE)),
            "crashes": sum(bool(r.get("crashed")) for r in results.values()),
            "failed_targets": failed,
            "silent_corruptions": sum(
                "NaN/Inf decoded by a codec" in (r.get("failure") or "") for r in results.values()
            ),
            "wall_s": round(time.perf_counter() - start, 1),
            "targets": dict(results),
            "complete": len(results) == len(targets),
        }

    for target in targets:
        count = args.examples
        if target == "kernels:triton":
            count = max(1, math.ceil(args.examples * TRITON_SHARE))
        results[target] = r = _child(target, count, args.timeout)
        verdict = "CRASHED" if r.get("crashed") else ("FAILED" if r.get("failure") else "ok")
        print(f"{target}: {r.get('examples', 0)} examples, {verdict} {r.get('outcomes', '')}")
        if r.get("failure"):
            print("   ", r["failure"][:2000])
        if args.out:  # after every target: a run cut short keeps what it did
            Path(args.out).write_text(json.dumps(record(), indent=1) + "\n")
    final = record()
    failed = final["failed_targets"]
    print(
        f"fuzz {'passed' if not failed else 'FAILED: ' + ', '.join(failed)} in {final['wall_s']} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
