"""Tree attention masks: which keys a query of a draft tree sees, for every attention kernel and reference.

Speculative decoding with draft *trees* verifies many candidate continuations in one step. The
tree's nodes are laid out one after another in the cache (node i at slot position start + i), but
a node must see only its own ancestors (and everything before the tree), not its siblings or
cousins, although they sit at lower positions. Each query row carries two int32 numbers:

    base  the first cache position its mask covers
    bits  a 32-bit mask: bit j set = the key at position base + j is visible

and a key at position kp is visible to a query at position q iff

    kp <= q  and  (kp < base  or  (kp - base < 32  and  bit (kp - base) of bits is set))

(keys before `base` are always visible, keys at base + 32 or later never). The causal bound
`kp <= q` and a sliding window still apply on top. A row with base = q + 1 and bits = 0 is plain
causal attention: that is what every token outside a tree gets, padding included.

The mask only ever removes keys from the causal span, so a kernel's choice of KV blocks to read
(from the window start to the last query's position) stays right; it adds one more test to the
mask it already builds.
"""

from __future__ import annotations

import jax.numpy as jnp

TREE_WIDTH = 32  # cache positions one mask covers: the bits of an int32


def tree_visible(kv_pos, base, bits):
    """Whether each key position kv_pos is visible under a row's (base, bits), by the rule of the
    module docstring less the causal bound (the caller's). Shapes broadcast: e.g. kv_pos [1, K]
    against base, bits [R, 1] gives [R, K] bool. Lowers in XLA, Mosaic and Triton alike (a shift
    by a vector of amounts, clamped into 0..31 so that no lane shifts by 32 or more)."""
    offset = kv_pos - base
    bit = jnp.right_shift(bits, jnp.clip(offset, 0, TREE_WIDTH - 1)) & 1  # arithmetic shift: bit 31 too
    return (offset < 0) | ((offset < TREE_WIDTH) & (bit != 0))


def check_tree(tree_base, tree_bits, num_tokens: int) -> bool:
    """Whether a call has tree masks (both given) or not (neither); ValueError for one of the two,
    or arrays that are not one int32 per query row [T]."""
    if (tree_base is None) != (tree_bits is None):
        raise ValueError("tree masks need both tree_base and tree_bits ([T] int32 each), or neither")
    if tree_base is None:
        return False
    for name, a in (("tree_base", tree_base), ("tree_bits", tree_bits)):
        if tuple(a.shape) != (num_tokens,) or a.dtype != jnp.int32:
            raise ValueError(f"{name} must be [T] = [{num_tokens}] int32 (one per query row); got {tuple(a.shape)} {a.dtype}")
    return True
