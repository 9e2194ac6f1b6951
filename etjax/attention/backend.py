"""`AttentionBackend`: the attention a step runs, chosen once (by the engine, from the platform
and the pruning setting) and carried as a static value in the attention plan and the step's
statics: its kernels, and whether decode rows prune (`prunes`). That is the one place dense or
pruned is chosen; the host's layout, the step programs and each layer ask it.

- `xla`: pallas_kernels/ragged_attention/xla.py for dense attention and the XLA block-sparse
  kernel for pruned decode; every platform.
- `cpu`: `xla`, except that attention runs C++ kernels that read the pages in place
  (cpp_kernels): every dense pass (decode rows and verified drafts: 0.2-0.4x the XLA
  loop's time per layer; prompt chunks, register-blocked and skipping what the causal mask
  hides; docs/PERF.md "step_floor"), and pruned decode's page scores, block selection and
  block-sparse attention.
  "auto" picks it on a CPU when they build (a C++ compiler at hand) and the engine runs on
  one device.
- `pallas_gpu`: the Triton kernels, dense (ragged) and block-sparse.
- `pallas_tpu`: the Mosaic kernels: dense passes reading pages in place
  (pallas_kernels/ragged_attention/pallas_tpu.py, in xla.py's place of its loops) and the
  block-sparse kernel for pruned decode.

A Pallas backend resolved for a CPU runs its kernels in interpret mode (slow, the same
program: how the tests drive every backend through the product path). Resolved for a TPU or a
GPU, it lowers them to Mosaic or Triton, also from a CPU host (jax.export,
tests/test_export.py).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from etjax.pruning.config import PruningConfig, PruningShape

BACKENDS = ("auto", "xla", "cpu", "pallas_tpu", "pallas_gpu")
_BY_PLATFORM = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu"}
DENSE = PruningConfig().shape()  # pruning off: a row reads every block of its context


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str = "xla"  # "xla", "cpu", "pallas_tpu" or "pallas_gpu"
    interpret: bool = False  # run Pallas kernels interpreted (on a CPU)
    # The pruning's static settings (its thresholds are traced, etjax/pruning/config.py);
    # DENSE: decode rows read all their blocks.
    pruning: PruningShape = DENSE

    @property
    def prunes(self) -> bool:
        """Whether decode rows read only the blocks their budgets keep (etjax/pruning): the
        step then computes budgets and hands the layers a `SparsePlan` (plan.py)."""
        return self.pruning.enabled

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

        native_pass = None
        if self.name == "cpu":
            from pallas_kernels.ragged_attention.cpu import ragged_pass_cpu

            native_pass = ragged_pass_cpu
        elif self.name == "pallas_tpu":  # Mosaic, pages read in place
            from pallas_kernels.ragged_attention.pallas_tpu import ragged_pass_tpu

            native_pass = functools.partial(ragged_pass_tpu, interpret=self.interpret)
        return ragged_attention_xla(
            q, k_pages, v_pages, positions, passes, chunk, window, softcap, shared, native_pass
        )

    @property
    def reads_shared_prefixes(self) -> bool:
        """Whether its dense kernel merges a token's tiles from several passes, so decode rows
        can read a shared prefix once (etjax/attention/cascade.py): the XLA kernel does (and
        runs a TPU's dense steps); the Triton one adds its passes' outputs."""
        return self.name != "pallas_gpu"

    @property
    def sparse_reads_own_count(self) -> bool:
        """Whether its block-sparse kernel reads each row's own kept blocks (the C++ and
        Triton kernels loop per row up to the row's count) rather than every row of a burst
        up to the largest count (the XLA loop's one trip count, the TPU kernel's static
        grid). Only then does a long row in a pruned burst cost the short rows nothing."""
        return self.name in ("cpu", "pallas_gpu")

    @property
    def reads_grouped_pruned_rows(self) -> bool:
        """Whether its block-sparse kernel reads the pages a group of pruned rows shares once
        for the group (etjax/pruning/groups.py): the C++ kernel does; the others read each
        row's kept pages apart, where one selection for the group would only cost."""
        return self.name == "cpu"

    @property
    def scores_own_pages(self) -> bool:
        """Whether pruned steps score each row's own pages (the C++ scorer) rather than every
        padded row up to the longest row's pages (`score_pages_xla`'s loop)."""
        return self.name == "cpu"

    def block_sparse(self):
        """The block-sparse decode kernel of pruned steps (pallas_kernels/block_sparse)."""
        if self.name == "pallas_tpu":
            from pallas_kernels.block_sparse.pallas_tpu import block_sparse_attention_tpu

            return functools.partial(block_sparse_attention_tpu, interpret=self.interpret)
        if self.name == "pallas_gpu":
            from pallas_kernels.block_sparse.pallas_gpu import block_sparse_attention_gpu

            return functools.partial(block_sparse_attention_gpu, interpret=self.interpret)
        if self.name == "cpu":
            from pallas_kernels.block_sparse.cpu import block_sparse_attention_cpu

            return block_sparse_attention_cpu
        from pallas_kernels.block_sparse.xla import block_sparse_attention_xla

        return block_sparse_attention_xla

    def page_bounds(self):
        """The pages' Quest-bound scorer of pruned steps (pallas_kernels/page_scores, one
        signature): the C++ one on `cpu`, else the XLA loop."""
        if self.name == "cpu":
            from pallas_kernels.page_scores.cpu import page_bounds_cpu

            return page_bounds_cpu
        from pallas_kernels.page_scores.xla import score_pages_xla

        return score_pages_xla

    def block_selection(self):
        """Pruned steps' choice of kept blocks, with etjax/pruning/selection.py's
        `select_blocks` signature (the pruning settings as one argument), on the C++ kernel
        on `cpu`, else the XLA one (pallas_kernels/block_selection)."""
        from etjax.pruning.selection import select_blocks

        if self.name == "cpu":
            from pallas_kernels.block_selection.cpu import select_blocks_cpu

            return functools.partial(select_blocks, kernel=select_blocks_cpu)
        return select_blocks


XLA = AttentionBackend()


def resolve_backend(
    name: str, platform: str | None = None, devices: int = 1, pruning: PruningShape = DENSE
) -> AttentionBackend:
    """The kernels `name` selects on `platform` (default: JAX's default backend) for an engine
    on `devices` devices, whose decode rows prune as `pruning` says (DENSE: they do not). On
    one device "auto" is "pallas_tpu" on a TPU, "pallas_gpu" on a
    GPU, and on a CPU "cpu" when its kernel builds, else "xla"; a mesh keeps the XLA loop,
    which the SPMD partitioner splits by KV head (a Pallas or C++ kernel is one custom call
    it cannot split: "Mosaic kernels cannot be automatically partitioned", compiling a
    v5e:2x2 step, tests/test_tpu_compile.py)."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend={name!r}; must be one of {BACKENDS}")
    platform = platform or jax.default_backend()
    if name == "auto":
        chosen = _BY_PLATFORM.get(platform) if devices == 1 else None
        if chosen is None:
            chosen = "cpu" if devices == 1 and _cpu_kernel_builds() else "xla"
    else:
        chosen = name
    if chosen == "cpu" and (platform != "cpu" or not _cpu_kernel_builds()):
        raise ValueError(
            f"attention_backend='cpu' needs a CPU platform (not {platform!r}) and its C++ "
            "kernel built (a C++ compiler; see the log's warning); use 'xla'"
        )
    interpret = chosen.startswith("pallas") and platform == "cpu"
    return AttentionBackend(chosen, interpret=interpret, pruning=pruning)


def _cpu_kernel_builds() -> bool:
    from cpp_kernels import cpu_kernels_available

    return cpu_kernels_available()
