"""The declaration of a checkpoint's tensors, shared by every model family and the converter."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightSpec:
    """HF tensor names and shapes a checkpoint must hold (``required``) or may hold."""

    required: dict[str, tuple[int, ...]]
    optional: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def check(self, found: dict[str, tuple[int, ...]]) -> list[str]:
        """Every problem with the found tensors: missing, unexpected and misshapen names."""
        problems = []
        missing = sorted(set(self.required) - set(found))
        if missing:
            problems.append(f"missing tensors: {', '.join(missing)}")
        known = self.required | self.optional
        unexpected = sorted(set(found) - set(known))
        if unexpected:
            problems.append(f"unexpected tensors: {', '.join(unexpected)}")
        for name, shape in sorted(found.items()):
            if name in known and tuple(shape) != tuple(known[name]):
                problems.append(
                    f"tensor {name} has shape {tuple(shape)}, expected {tuple(known[name])}"
                )
        return problems
