"""Per-sequence seeds: each completion of a request, and each drafter, draws from its own stream.

A request's seed (its SamplingParams.seed reduced by `sampler_seed`, or one the engine draws)
seeds completion 0; completion j > 0 and a draft model or draft heads sampling for a sequence get
seeds derived from it, so that n completions differ and a drafter's draws never repeat the target's.
"""

from __future__ import annotations

import hashlib

import numpy as np

SEED_RANGE = 2**32  # the sampler's seeds are uint32 (ops.sampling.SamplingTensors.seed)
DRAFT_SEED_SALT = 0x5EED_D4AF  # drafts of a sequence sample with child_seed(its seed, DRAFT_SEED_SALT)


def sampler_seed(seed: int) -> int:
    """Any Python int as a seed the sampler takes, in [0, 2**32).

    A seed already in that range is used as it is. Any other (negative, or 2**32 and over) is
    hashed, so that seeds differing only in their high bits still differ: the BLAKE2b digest of
    4 bytes, read little-endian, of the seed's two's-complement little-endian bytes
    (`seed.bit_length() // 8 + 1` of them). The same in every process: sampler_seed(-1) ==
    0xF9358970.
    """
    seed = int(seed)
    if 0 <= seed < SEED_RANGE:
        return seed
    data = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(data, digest_size=4).digest(), "little")


def child_seed(seed: int, index: int) -> int:
    """Seed of completion `index` of a request seeded with `seed` (completion 0 uses `seed`);
    `seed` is a sampler seed (in [0, 2**32))."""
    if index == 0:
        return seed
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] >> 1)
