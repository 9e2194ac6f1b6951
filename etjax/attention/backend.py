"""`AttentionBackend`: the attention kernels a step runs, chosen once (by the engine, from the
platform) and carried as a static value in the attention plan and the step's statics.

- `xla`: pallas_kernels/ragged_attention/xla.py for dense attention and the XLA block-sparse
  kernel for pruned decode; every platform.
- `pallas_gpu`: the Triton kernels, dense (ragged) and block-sparse.
- `pallas_tpu`: the Mosaic block-sparse kernel for pruned decode; dense steps run the XLA
  kernel (seam.py says why).

A Pallas backend resolved for a CPU runs its kernels in interpret mode (slow, the same
program: how the tests drive every backend through the product path). Resolved for a TPU or a
GPU, it lowers them to Mosaic or Triton, also from a CPU host (jax.export,
tests/test_export.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")
_BY_PLATFORM = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str = "xla"  # "xla", "pallas_tpu" or "pallas_gpu"
    interpret: bool = False  # run Pallas kernels interpreted (on a CPU)

    def ragged(
        self, q, k_pages, v_pages, positions, passes, chunk, window, softcap=0.0, shared=False
    ) -> jax.Array:
        """Dense ragged attention over the paged cache (the arguments of
        pallas_kernels/ragged_attention); `shared`: the last pass is a shared pass (the XLA
        kernel's `shared_last`; only where `reads_shared_prefixes`)."""
        if shared and not self.reads_shared_prefixes:
            raise ValueError(f"the {self.name} kernel cannot merge a shared pass")
        if self.name == "pallas_gpu":
            from pallas_kernels.ragged_attention.pallas_gpu import ragged_attention_gpu

            kernel = functools.partial(ragged_attention_gpu, interpret=self.interpret)
            return kernel(
                q, k_pages, v_pages, positions, passes, chunk, window=window, softcap=softcap
            )
        from pallas_kernels.ragged_attention import ragged_attention_xla

        return ragged_attention_xla(
            q, k_pages, v_pages, positions, passes, chunk, window, softcap, shared
        )

    @property
    def reads_shared_prefixes(self) -> bool:
        """Whether its dense kernel merges a token's tiles from several passes, so decode rows
        can read a shared prefix once (etjax/attention/cascade.py): the XLA kernel does (and
        runs a TPU's dense steps); the Triton one adds its passes' outputs."""
        return self.name != "pallas_gpu"

    def block_sparse(self):
        """The block-sparse decode kernel of pruned steps (pallas_kernels/block_sparse)."""
        if self.name == "pallas_tpu":
            from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu

            return functools.partial(block_sparse_attention_tpu, interpret=self.interpret)
        if self.name == "pallas_gpu":
            from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu

            return functools.partial(block_sparse_attention_gpu, interpret=self.interpret)
        from pallas_kernels.block_sparse.xla import block_sparse_attention_xla

        return block_sparse_attention_xla


XLA = AttentionBackend()


def resolve_backend(name: str, platform: str | None = None) -> AttentionBackend:
    """The kernels `name` selects on `platform` (default: JAX's default backend): "auto" is
    "pallas_tpu" on a TPU, "pallas_gpu" on a GPU and "xla" elsewhere."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; must be one of {BACKENDS}")
    platform = platform or jax.default_backend()
    chosen = _BY_PLATFORM.get(platform, "xla") if name == "auto" else name
    return AttentionBackend(chosen, interpret=chosen != "xla" and platform == "cpu")
