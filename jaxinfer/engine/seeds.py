"""Per-sequence seeds: each completion of a request, and each drafter, draws from its own stream.

A request's seed (its SamplingParams.seed, or one the engine draws) seeds completion 0;
completion j > 0 and a draft model or draft heads sampling for a sequence get seeds derived from
it, so that n completions differ and a drafter's draws never repeat the target's.
"""

from __future__ import annotations

import numpy as np

DRAFT_SEED_SALT = 0x5EED_D4AF  # drafts of a sequence sample with child_seed(its seed, DRAFT_SEED_SALT)


def child_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`)."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] >> 1)
