"""2:4 semi-structured sparse weights kept compressed: the `Sparse24Weight` pytree.

A 2:4 sparse matrix W [K, N] (at most two nonzeros in every four consecutive input rows of a
column; what `jaxinfer prune --pattern 2:4` and compressed-tensors' "sparse-24-bitmask"
checkpoints hold) is kept as its kept values and a bitmask of where they sit, laid out as
`pallas_kernels.sparse24_matmul.reference` fixes:

    values  [..., 4, K / 8, N]   the weight's dtype     (half of the weight's entries)
    mask    [..., K / 8, N]      uint8                  (bit j of byte r: row 8r + j kept)

bfloat16: 56 % of the dense bytes. The model's matmul (`jaxinfer.models.layers.matmul`) sends it
to the kernel table's `sparse24_matmul`: with Pallas kernels (TPU / GPU) the kernel reads the
compressed bytes and expands each tile on the chip, so a bandwidth-bound decode reads about half
the weight bytes; the XLA path (the CPU's) expands the matrix and multiplies densely. On the CPU
a 2:4 checkpoint loads dense in the first place (`keep_checkpoint_quantization` is off there), as
its quantized matrices do; on TPU / GPU its 2:4 matrices stay compressed (`sparsify_weights`).

Leading axes ([L, 4, K / 8, N] values: stacked layers) are kept, as a QuantizedWeight's are, so
`jax.tree.map(lambda a: a[i], w)` takes layer i.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from jaxinfer.ops.quantization import replace_weights
from jaxinfer.tree import nested_to_flat
from pallas_kernels.sparse24_matmul import reference as s24

__all__ = ["SPARSE24_FIELDS", "Sparse24Weight", "from_compressed_tensors", "from_dense_24", "sparsify_params", "sparsify_weights"]

SPARSE24_FIELDS = ("values", "mask")


@dataclasses.dataclass(frozen=True)
class Sparse24Weight:
    """A 2:4 sparse [K, N] (or stacked [L, K, N]) matmul weight in its compressed form (module docstring)."""

    values: jax.Array  # [..., 4, K / 8, N]
    mask: jax.Array    # uint8 [..., K / 8, N]

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the dense weight this stands for ([..., K, N])."""
        *lead, rows, N = self.mask.shape
        return (*lead, s24.ROWS_PER_BYTE * rows, N)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.mask.nbytes

    def dense(self, dtype=None) -> jax.Array:
        """The dense weight [..., K, N] (in `dtype`, default the values' dtype)."""
        return s24.densify(self.values, self.mask, dtype)

    def dequantize(self) -> jax.Array:
        """The float32 dense weight (the name QuantizedWeight's readers call)."""
        return self.dense(jnp.float32)


jax.tree_util.register_dataclass(Sparse24Weight, data_fields=list(SPARSE24_FIELDS), meta_fields=[])


def from_dense_24(w: jax.Array, *, prune: bool = False) -> Sparse24Weight:
    """A dense 2:4 sparse weight [..., K, N] -> Sparse24Weight (ValueError if it is not 2:4; with
    `prune=True` the two largest magnitudes of every group of four are kept instead)."""
    return Sparse24Weight(*s24.from_dense_24(w, prune=prune))


def from_compressed_tensors(compressed, bitmask, shape) -> Sparse24Weight:
    """One torch weight [N, K] as compressed-tensors' sparse-24-bitmask stores it (compressed [N, K / 2],
    bitmask [N, K / 8], shape) -> Sparse24Weight [K, N] (a transpose and a reshape of the same numbers)."""
    values, mask = s24.from_compressed_tensors(compressed, bitmask, shape)
    return Sparse24Weight(jnp.asarray(values), jnp.asarray(mask))


# The 2:4 matrices: the projections (compressed-tensors' pruning targets Linear layers and ignores the LM head).
SPARSE24_WEIGHT_NAMES = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})


def sparsify_params(params: Mapping[str, jax.Array], names: Iterable[str] | None = None, *, prune: bool = False
                    ) -> dict[str, jax.Array | Sparse24Weight]:
    """A flat name -> array dict with the named weights (default: every SPARSE24_WEIGHT_NAMES
    projection, 2-D or stacked 3-D, whose K is a multiple of 8) replaced by Sparse24Weights
    (ValueError for one that is not 2:4, unless `prune`). The input dict is not modified."""
    if names is None:
        names = [n for n, w in params.items() if n.rsplit(".", 1)[-1] in SPARSE24_WEIGHT_NAMES and getattr(w, "ndim", 0) in (2, 3)
                 and w.shape[-2] % s24.ROWS_PER_BYTE == 0]
    names = set(names)
    return {name: from_dense_24(w, prune=prune) if name in names else w for name, w in params.items()}


def sparsify_weights(graphdef, state, names: Iterable[str], *, prune: bool = False):
    """(graphdef, state) of a loaded nnx model with the named (flat) weights, dense 2:4 matrices,
    kept compressed as Sparse24Weights: the step the loader runs on TPU / GPU for the matrices a
    2:4 checkpoint stores compressed (jaxinfer.runtime.loading.stored_sparse24). Each compressed
    weight keeps its dense weight's sharding on the K and N axes (values and mask split alike)."""
    from flax import nnx  # the model container; the rest of this module is plain JAX

    flat = nested_to_flat(nnx.to_pure_dict(state))
    compressed = {}
    for name in names:
        w = flat[name]
        sharding = getattr(w, "sharding", None)
        out_shardings = None
        if isinstance(sharding, jax.sharding.NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (w.ndim - len(sharding.spec))
            out_shardings = (jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[:-2], None, *spec[-2:])),
                             sharding)
        compress = jax.jit(functools.partial(s24.from_dense_24, prune=prune), out_shardings=out_shardings)
        if not prune and not isinstance(w, jax.ShapeDtypeStruct):
            bad = s24.violating_groups(w)
            if bad:
                raise ValueError(f"{name}: not 2:4 sparse ({bad} groups of four input rows hold more than two nonzeros)")
        compressed[name] = Sparse24Weight(*(jax.eval_shape(compress, w) if isinstance(w, jax.ShapeDtypeStruct) else compress(w)))
    del flat
    return replace_weights(graphdef, state, compressed)
