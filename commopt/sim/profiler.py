"""Profile a real training step on this machine's CPU: per-layer backward timings.

Each parameter gets a post-accumulate-grad hook that stamps the moment its gradient is ready;
a layer (a module owning parameters) is ready with its last parameter, and its backward time
is the gap since the layer that became ready before it. That is exactly what the simulator
needs: when each bucket's gradients exist. A few iterations on a small batch, the fastest
kept, so profiling stays quick.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    >>> prof = profile_module(net, lambda: (torch.randn(8, 32),), name="mlp", batch=8, iterations=2)
    >>> [lay.numel for lay in prof.layers]
    [2112, 650]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from commopt.sim.model_profiles import Layer, ModelProfile

PROFILABLE = ("resnet50",)


def profile_module(
    model,
    make_inputs: Callable[[], tuple],
    *,
    name: str,
    batch: int,
    iterations: int = 3,
    sample_unit: str = "samples",
    loss_fn=None,
    device_kind: str = "cpu",
) -> ModelProfile:
    """Time ``iterations`` forward+backward passes of ``model`` (after one warm-up) and keep the
    fastest. ``loss_fn(output)`` defaults to the mean of the output."""
    import torch

    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    owners = [
        (mod_name or "model", m)
        for mod_name, m in model.named_modules()
        if any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if not owners:
        raise ValueError("the model has no trainable parameters to profile")
    stamps: dict[int, float] = {}
    handles = [
        p.register_post_accumulate_grad_hook(
            lambda param: stamps.__setitem__(id(param), time.perf_counter())
        )
        for _, module in owners
        for p in module.parameters(recurse=False)
        if p.requires_grad
    ]
    loss_fn = loss_fn or (lambda out: out.float().mean())
    best: tuple[float, float, float, dict[str, float]] | None = None
    try:
        model.train()
        for it in range(iterations + 1):
            inputs = make_inputs()
            model.zero_grad(set_to_none=True)
            stamps.clear()
            t0 = time.perf_counter()
            loss = loss_fn(model(*inputs))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            ready = {
                owner: max(stamps[id(p)] for p in m.parameters(recurse=False) if p.requires_grad)
                for owner, m in owners
            }
            if it > 0 and (best is None or t2 - t0 < best[2] - best[0]):
                best = (t0, t1, t2, ready)
    finally:
        for h in handles:
            h.remove()
    assert best is not None  # iterations >= 1: the loop kept at least one timed pass
    t0, t1, t2, ready = best
    # Backward time of a layer: the gap since the previously ready layer.
    gaps, prev = {}, t1
    for owner in sorted(ready, key=lambda owner: ready[owner]):
        gaps[owner] = max(ready[owner] - prev, 0.0)
        prev = ready[owner]
    layers = tuple(
        Layer(
            owner,
            sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad),
            gaps[owner] + 1e-9,
        )
        for owner, m in owners
    )
    step = t2 - t0
    return ModelProfile(
        name=name,
        description=f"{name} measured on {device_kind}: batch {batch}, best of {iterations}",
        sample_unit=sample_unit,
        batch_per_gpu=batch,
        grad_bytes_per_param=4,
        forward_fraction=(t1 - t0) / step,
        throughput={device_kind: batch / step},
        layers=layers,
        sources={
            "measured": f"forward {t1 - t0:.4f} s, backward {t2 - t1:.4f} s, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads"
        },
    )


def profile_named_model(
    name: str, *, batch: int = 1, image_size: int = 64, iterations: int = 2, threads: int | None = 1
) -> ModelProfile:
    """Profile a model by name on the CPU (``resnet50``: random images, cross-entropy).

    ``threads`` (default 1; None keeps torch's setting): one thread keeps the timing steady on a
    shared machine, where intra-op threads waiting on each other can be ten times slower."""
    import torch

    if name != "resnet50":
        raise ValueError(
            f"cannot profile {name!r} by name; profilable: {', '.join(PROFILABLE)} "
            "(or call commopt.sim.profiler.profile_module on your own model)"
        )
    last_map = -(-image_size // 32)  # side of layer4's output
    if batch < 1 or image_size < 32 or batch * last_map * last_map < 2:
        # Batch norm in training mode needs two values per channel in the last stage.
        raise ValueError(
            f"need batch >= 1, image size >= 32 and batch x (size/32)^2 >= 2, "
            f"got batch {batch} and size {image_size} (try --profile-image-size 64)"
        )
    from commopt.sim.resnet import resnet50

    torch.manual_seed(0)
    model = resnet50()
    labels = torch.randint(0, 1000, (batch,))
    saved = torch.get_num_threads()
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        prof = profile_module(
            model,
            lambda: (torch.randn(batch, 3, image_size, image_size),),
            name=name,
            batch=batch,
            iterations=iterations,
            sample_unit="images",
            loss_fn=lambda out: torch.nn.functional.cross_entropy(out, labels),
        )
    finally:
        torch.set_num_threads(saved)
    return replace(
        prof,
        description=f"{name} measured on this CPU: batch {batch} of "
        f"{image_size}x{image_size} images, best of {iterations}",
    )
