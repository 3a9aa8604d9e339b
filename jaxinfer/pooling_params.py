"""`PoolingParams`: how a pooling request turns its prompt's hidden states into a vector
(vLLM's names), validated on construction.

    llm = LLM("./Qwen3-Embedding-0.6B", runner="pooling")
    llm.embed(["a", "b"], PoolingParams(dimensions=256))
"""

from __future__ import annotations

import dataclasses

POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """pooling_type: "LAST" (the last prompt token's hidden state), "MEAN" (the mean over every
    prompt token) or "CLS" (the first token's); None: the model's (its sentence-transformers
    config, else LAST). normalize: L2-normalize the vector (None: the model's). dimensions: keep
    only the first `dimensions` entries before normalizing (models trained for it, Matryoshka:
    their config lists `matryoshka_dimensions` or sets `is_matryoshka`). task: "embed" (the pooled
    hidden state) or "classify" (a sequence-classification model's head applied to it: its
    labels' logits through a sigmoid for one label, a softmax for several)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"

    def __post_init__(self):
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(f"PoolingParams.pooling_type={self.pooling_type!r}: expected one of {POOLING_TYPES}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize={self.normalize!r}: expected True, False or None")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions={self.dimensions!r}: expected a positive integer")
        if self.task not in TASKS:
            raise ValueError(f"PoolingParams.task={self.task!r}: expected one of {TASKS}")
