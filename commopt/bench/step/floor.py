"""The floor of a training step: what no scheduling can remove on these hosts.

floor = max(compute + codec, link limit): the step's compute (the twin's, measured at the
same moment), the processor time of the configuration's own arithmetic on the gradient
(``codec_seconds``: encode, decode and reduce at the kernels' measured speed on this rank),
and the wire time, which at best hides entirely behind the other two. Everything a step
takes above its floor is overhead of the implementation (copies, checks, Python, polling,
waiting for a shared core) or wire time that the schedule did not hide.

    >>> floor_s(compute_s=0.08, codec_s=0.02, limit_s=0.107)
    0.107
    >>> floor_s(compute_s=0.08, codec_s=0.04, limit_s=None)
    0.12
"""

from __future__ import annotations

import statistics
import time


def floor_s(compute_s: float | None, codec_s: float | None, limit_s: float | None) -> float | None:
    """max(compute + codec, link limit); None without a compute time."""
    if compute_s is None:
        return None
    return max(compute_s + (codec_s or 0.0), limit_s or 0.0)


def _ring_passes(n: int) -> tuple[float, float]:
    """Encodes and decodes of the whole gradient one rank does in a ring allreduce of n ranks:
    reduce-scatter encodes and decodes (n-1)/n of it, allgather encodes 1/n, decodes (n-1)/n."""
    return 1.0, 2.0 * (n - 1) / n


def _commopt_work(cfg, numel: int, n: int):
    """A function doing one step's codec arithmetic of commopt configuration ``cfg``."""
    import torch

    from commopt.codecs import RngKey, get_codec

    grad, acc = torch.randn(numel), torch.zeros(numel)
    _enc, dec = _ring_passes(n)
    codec = get_codec("fp32" if cfg.wire == "fp32" else cfg.wire)
    wire = torch.empty(codec.encoded_nbytes(numel), dtype=torch.uint8)
    if cfg.wire == "fp32":  # the transport sums fp32 as it receives: one add pass per decode

        def add_received():
            for _ in range(round(dec)):
                acc.add_(grad)

        return add_received
    step = [0]

    def encode_decode():
        step[0] += 1
        codec.encode(grad, wire, scale=1.0 / n, rng=RngKey(0, 0, step[0]), key="floor")
        for _ in range(round(dec)):
            codec.decode(wire, acc, accumulate=True)

    return encode_decode


def _powersgd_work(shapes, rank: int):
    """PowerSGD's arithmetic on the matrices of ``shapes`` it compresses (torch's rule)."""
    import math

    import torch

    mats = [
        torch.randn(s[0], math.prod(s[1:]))
        for s in shapes
        if len(s) > 1 and (s[0] + math.prod(s[1:])) * rank * 2 < math.prod(s)
    ]
    state = [(torch.zeros_like(m), torch.randn(m.shape[1], rank)) for m in mats]

    def work():  # PowerSGD's arithmetic: error feedback, P = MQ, orthonormal P, Q = M^T P, PQ^T
        for m, (err, q) in zip(mats, state):
            m.add_(err)
            p = m @ q
            p = torch.linalg.qr(p).Q
            q.copy_(m.t() @ p)
            err.copy_(m - p @ q.t())

    return work


def _plan_work(opt, n: int):
    """One step's codec arithmetic of commopt's optimizer ``opt``, bucket by bucket: each
    bucket's own codec (as a per-layer plan such as ``compression="auto"`` chose it)."""
    import copy

    import torch

    from commopt.codecs import PowerSGD, RngKey

    _enc, dec = _ring_passes(n)
    works = []
    for schedule in opt.plans.values():
        reducer = schedule.bucketed.reducer
        for b in reducer.buckets:
            if isinstance(b.codec, PowerSGD):
                shapes = [tuple(reducer.params[s.param].shape) for s in b.slots]
                works.append(_powersgd_work(shapes, b.codec.rank))
                continue
            grad, acc = torch.randn(b.numel), torch.zeros(b.numel)
            if b.codec is None:  # exact: the transport's sum as it receives

                def add(acc=acc, grad=grad):
                    for _ in range(round(dec)):
                        acc.add_(grad)

                works.append(add)
                continue
            wire = torch.empty(b.codec.encoded_nbytes(b.numel), dtype=torch.uint8)
            codec = copy.deepcopy(b.codec)  # its own state: the optimizer's stays untouched

            def encode_decode(codec=codec, grad=grad, acc=acc, wire=wire, key=b.key):
                codec.encode(grad, wire, scale=1.0 / n, rng=RngKey(0, 0, 1), key=f"floor-{key}")
                for _ in range(round(dec)):
                    codec.decode(wire, acc, accumulate=True)

            works.append(encode_decode)

    def work():
        for w in works:
            w()

    return work


def _ddp_work(cfg, shapes, n: int):
    """One step's hook arithmetic of DDP configuration ``cfg``, with torch's own operations."""

    import torch

    grads = [torch.randn(s) for s in shapes]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if cfg.wire == "fp32":
        return lambda: flat.add_(flat)  # gloo's sum of the received bucket
    if cfg.wire in ("fp16", "bf16"):
        dtype = torch.float16 if cfg.wire == "fp16" else torch.bfloat16

        def fp16_hook():  # fp16/bf16_compress_hook: divide, cast down, (sum), cast back
            half = flat.div(n).to(dtype)
            half.add_(half)
            flat.copy_(half)

        return fp16_hook
    return _powersgd_work(shapes, cfg.powersgd_rank)


def codec_seconds(cfg, shapes, n: int, repeats: int = 3, opt=None) -> float:
    """Median seconds of one step's codec arithmetic for ``cfg`` on this rank (1 rank's share).

    ``opt`` (commopt's optimizer of ``cfg``) is needed where the codec is chosen per layer
    (``compression="auto"``): its buckets' own codecs are timed. A local-steps configuration
    codes its outer gradients once per cycle of ``sync_every`` steps: its share per step.
    """
    import math

    numel = sum(math.prod(s) for s in shapes)
    # PowerSGD's arithmetic is the same in DDP's hook and in commopt's low-rank codec.
    own = cfg.kind == "ddp" or cfg.wire == "powersgd"
    if cfg.wire == "auto":
        if opt is None:
            raise ValueError(f"{cfg.name}: the codec time of a per-layer plan needs its optimizer")
        work = _plan_work(opt, n)
    else:
        work = _ddp_work(cfg, shapes, n) if own else _commopt_work(cfg, numel, n)
    work()  # warm-up: page in, first-call costs
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / cfg.cycle
