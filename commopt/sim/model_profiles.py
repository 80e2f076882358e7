"""Model profiles: per-layer gradient sizes and backward timings, saved as JSON.

A profile lists the layers in forward order; each has ``numel`` (parameters whose gradient
becomes ready when the backward pass finishes that layer) and ``backward_weight`` (its share
of the backward time, in any unit: MACs for the built-in profiles, seconds for a measured
one). Absolute times come from the single-GPU throughput of the machine's GPU:
``step = batch_per_gpu / throughput[gpu]``, split into forward, backward and update by
``forward_fraction`` and ``update_fraction``.

    >>> p = load_profile("resnet50")
    >>> p.numel
    25557032
    >>> round(p.step_time("v100") * 1000, 1)  # 64 images at the published 1226 img/s
    52.2
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")
ALIASES = {
    "bert": "bert-large",
    "txl": "transformer-xl-base",
    "transformer-xl": "transformer-xl-base",
    "transformer-big": "transformer-big",
    "fairseq-transformer-big": "transformer-big",
}


@dataclass(frozen=True)
class Layer:
    name: str
    numel: int
    backward_weight: float


@dataclass(frozen=True)
class ModelProfile:
    name: str
    sample_unit: str  # what the throughput counts: images, tokens, ...
    batch_per_gpu: float  # samples per GPU per step
    grad_bytes_per_param: int  # 4: float32 gradients, 2: float16 (e.g. apex O2)
    forward_fraction: float
    throughput: dict  # gpu -> samples/s on one GPU
    layers: tuple
    update_fraction: float = 0.0
    description: str = ""
    sources: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if not self.layers:
            raise ValueError(f"profile {self.name!r} has no layers")
        if (
            not 0 <= self.forward_fraction < 1
            or not 0 <= self.update_fraction < 1
            or self.forward_fraction + self.update_fraction >= 1
        ):
            raise ValueError(
                f"profile {self.name!r}: forward_fraction + update_fraction must be in [0, 1)"
            )
        if self.grad_bytes_per_param not in (2, 4, 8):
            raise ValueError(
                f"grad_bytes_per_param must be 2, 4 or 8, got {self.grad_bytes_per_param}"
            )
        if not self.batch_per_gpu > 0:
            raise ValueError(f"batch_per_gpu must be > 0, got {self.batch_per_gpu}")
        if any(lay.numel < 0 or lay.backward_weight < 0 for lay in self.layers):
            raise ValueError(f"profile {self.name!r}: layer sizes and weights must be >= 0")
        if sum(lay.backward_weight for lay in self.layers) <= 0:
            raise ValueError(f"profile {self.name!r}: backward weights sum to 0")

    @property
    def numel(self) -> int:
        return sum(lay.numel for lay in self.layers)

    @property
    def grad_bytes(self) -> int:
        return self.numel * self.grad_bytes_per_param

    def step_time(self, gpu: str) -> float:
        """Seconds of one training step on one GPU of kind ``gpu`` (no communication)."""
        if gpu not in self.throughput:
            known = ", ".join(sorted(self.throughput)) or "none"
            raise ValueError(
                f"profile {self.name!r} has no single-GPU throughput for {gpu!r} (it has: {known}); "
                "pass --throughput SAMPLES_PER_S or --step-time SECONDS"
            )
        return self.batch_per_gpu / float(self.throughput[gpu])

    def with_overrides(
        self,
        *,
        batch_per_gpu: float | None = None,
        gpu: str | None = None,
        throughput: float | None = None,
        step_time: float | None = None,
        grad_bytes_per_param: int | None = None,
    ) -> ModelProfile:
        """A copy with another batch, gradient width, or single-GPU speed for ``gpu``."""
        p = self
        if batch_per_gpu is not None:
            # A bigger batch takes proportionally longer: keep the throughput.
            p = replace(p, batch_per_gpu=float(batch_per_gpu))
        given = throughput if throughput is not None else step_time
        if given is not None:
            if gpu is None:
                raise ValueError("a throughput override needs the GPU kind it applies to")
            if not given > 0:  # checked before dividing: a step time of 0 is this error too
                raise ValueError(f"throughput and step time must be > 0, got {given}")
            value = given if throughput is not None else p.batch_per_gpu / given
            p = replace(p, throughput={**p.throughput, gpu: float(value)})
        if grad_bytes_per_param is not None:
            p = replace(p, grad_bytes_per_param=int(grad_bytes_per_param))
        return p

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "sample_unit": self.sample_unit,
            "batch_per_gpu": self.batch_per_gpu,
            "grad_bytes_per_param": self.grad_bytes_per_param,
            "forward_fraction": self.forward_fraction,
            "update_fraction": self.update_fraction,
            "throughput": dict(self.throughput),
            "sources": dict(self.sources),
            "layers": [
                {"name": lay.name, "numel": lay.numel, "backward_weight": lay.backward_weight}
                for lay in self.layers
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ModelProfile:
        try:
            layers = tuple(
                Layer(str(e["name"]), int(e["numel"]), float(e["backward_weight"]))
                for e in d["layers"]
            )
            return cls(
                name=d["name"],
                description=d.get("description", ""),
                sample_unit=d.get("sample_unit", "samples"),
                batch_per_gpu=float(d["batch_per_gpu"]),
                grad_bytes_per_param=int(d.get("grad_bytes_per_param", 4)),
                forward_fraction=float(d.get("forward_fraction", 1 / 3)),
                update_fraction=float(d.get("update_fraction", 0.0)),
                throughput={str(k): float(v) for k, v in d.get("throughput", {}).items()},
                layers=layers,
                sources=dict(d.get("sources", {})),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"model profile lacks or mistypes the field {exc}") from exc

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")


def list_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(name_or_path: str | ModelProfile) -> ModelProfile:
    """A built-in profile by name (see :func:`list_profiles`) or a JSON file."""
    if isinstance(name_or_path, ModelProfile):
        return name_or_path
    name = ALIASES.get(name_or_path, name_or_path)
    builtin = os.path.join(PROFILE_DIR, f"{name}.json")
    if os.path.exists(builtin):
        path = builtin
    elif name_or_path.endswith(".json") or os.path.sep in name_or_path:
        path = name_or_path
        if not os.path.exists(path):
            raise FileNotFoundError(f"model profile {path!r} does not exist")
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}; built-in: {', '.join(list_profiles())} "
            "(or give a profile JSON file, or --profile-model NAME to measure one)"
        )
    with open(path) as f:
        return ModelProfile.from_dict(json.load(f))
