"""One block selection per group of pruned rows that share a prefix, read once for the group.

Rows admitted with a prefix cache hit hold the same pages for their shared beginning (the
questions asked of one document). Selected row by row, each row keeps its own blocks of the
document and the kernel reads each row's choice apart: four rows that keep 35% of a shared
document read 1.4 documents, where a dense cascade pass (etjax/attention/cascade.py) reads it
once. Here the group selects the shared pages together: each page is scored by the largest
Quest bound over the group's queries (an upper bound for every member), hot for the group if
it was hot for any member, and the group keeps what its most uncertain member's fraction asks
of the shared pages. Each row then selects its own pages after the prefix with its own
fraction, and its kept table lists the group's pages first: the CPU kernel reads those once
for the whole group (cpp_kernels/block_sparse.cc).

Every member attends at least the blocks of the shared prefix its own fraction asks for,
chosen by a bound that holds for its queries too, so no member attends less than it would
alone; the group reads fewer bytes whenever its members' selections overlap less than
completely. The price is attention work: each member attends the group's count. On a CPU,
where a document's KV stays in cache and the step is bound by that work, this measured
slower than selecting row by row (docs/PERF.md "pruned_groups"), so it runs only when
`PruningConfig.group_shared_prefixes` asks for it.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from etjax.pruning.budget import kept_block_count
from etjax.pruning.config import PruningThresholds


@flax.struct.dataclass
class PrunedGroups:
    """Rows of a pruned decode step that share a prefix: leaders [B] int32, the row whose
    group each row is in (the first of its group; itself for a row in none); shared_pages [B]
    int32, the pages of each row's prefix its group shares (0 for a row in none). Built on the
    host from the rows' page lists (etjax/engine/device.py, as cascade attention groups dense
    rows)."""

    leaders: jax.Array
    shared_pages: jax.Array


def group_block_counts(
    fraction: jax.Array,
    num_blocks: jax.Array,
    groups: PrunedGroups,
    thresholds: PruningThresholds,
) -> tuple[jax.Array, jax.Array]:
    """Blocks each group keeps of its shared prefix (per leader, [B]: 0 where a row leads no
    group) and blocks each row keeps of its own pages after it ([B]), from the rows' kept
    fractions [B] and their blocks [B]."""
    shared, leaders = groups.shared_pages, groups.leaders
    rows = fraction.shape[0]
    leads = (leaders == jnp.arange(rows)) & (shared > 0)
    # Indexed by leader (a leader's own shared_pages are its group's); a row leading no
    # group has an empty segment (-inf) and keeps nothing here.
    group_fraction = jnp.maximum(jax.ops.segment_max(fraction, leaders, num_segments=rows), 0.0)
    group_count = jnp.where(leads, kept_block_count(group_fraction, shared, thresholds), 0)
    own_count = kept_block_count(fraction, num_blocks - shared, thresholds)
    return group_count, own_count


def grouped_blocks(
    fraction: jax.Array,
    num_blocks: jax.Array,
    groups: PrunedGroups,
    thresholds: PruningThresholds,
) -> tuple[jax.Array, jax.Array]:
    """Per row [B]: the blocks its token attends per layer and KV head (its group's and its
    own, int32) and, of those, the blocks read once for its whole group less its share
    (float32: the group's count times 1 - 1 / members), which the cost accounting
    subtracts as it does cascade attention's (`SequenceOutput.shared_blocks`)."""
    group_count, own_count = group_block_counts(fraction, num_blocks, groups, thresholds)
    rows = fraction.shape[0]
    members = jax.ops.segment_sum(jnp.ones(rows, jnp.float32), groups.leaders, num_segments=rows)
    mine = group_count[groups.leaders]
    spared = mine * (1.0 - 1.0 / jnp.maximum(members[groups.leaders], 1.0))
    return mine + own_count, spared


def select_grouped(
    select,
    scores: jax.Array,
    num_blocks: jax.Array,
    fraction: jax.Array,
    groups: PrunedGroups,
    thresholds: PruningThresholds,
    max_kept: int,
    last_mass: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kept blocks of grouped rows: the group's over the shared prefix, then each row's own.

    select: the backend's block selection (etjax/pruning/selection.py's `select_blocks` or its
    CPU kernel: same arguments and results); scores [B, S, P], num_blocks [B], last_mass
    [B, S, P] as there; fraction [B] each row's kept fraction. Returns kept_blocks
    [B, S, max_kept] (page-table columns: the group's first, then the row's own), kept_counts
    [B, S] and shared_counts [B] (per leader: how many of its group's first kept entries are
    the group's, for the kernel)."""
    b, _, p = scores.shape
    leaders, shared = groups.leaders, groups.shared_pages
    column = jnp.arange(p)[None, None, :]
    group_count, own_count = group_block_counts(fraction, num_blocks, groups, thresholds)

    # The group's selection over its shared pages, computed at its leader's index.
    in_prefix = column < shared[:, None, None]
    group_scores = jax.ops.segment_max(
        jnp.where(in_prefix, scores, -jnp.inf), leaders, num_segments=b
    )
    group_mass = None
    if last_mass is not None:
        group_mass = jax.ops.segment_max(jnp.where(in_prefix, last_mass, 0.0), leaders, b)
        group_mass = jnp.maximum(group_mass, 0.0)  # a group of none: -inf, never hot
    group_kept, group_counts = select(
        group_scores, shared, group_count, thresholds, max_kept, group_mass
    )

    # Each row's own pages, shifted so that its first page after the prefix is column 0.
    def after_prefix(x, fill):
        index = jnp.minimum(column + shared[:, None, None], p - 1)
        moved = jnp.take_along_axis(x, jnp.broadcast_to(index, x.shape), axis=2)
        return jnp.where(column + shared[:, None, None] < p, moved, fill)

    own_mass = None if last_mass is None else after_prefix(last_mass, 0.0)
    own_kept, own_counts = select(
        after_prefix(scores, -jnp.inf),
        num_blocks - shared,
        own_count,
        thresholds,
        max_kept,
        own_mass,
    )
    own_kept = own_kept + shared[:, None, None]

    # Each row's table: its group's entries, then its own.
    first = group_counts[leaders]  # [B, S]
    slot = jnp.arange(max_kept)[None, None, :]
    from_own = jnp.take_along_axis(
        own_kept, jnp.clip(slot - first[..., None], 0, max_kept - 1), axis=2
    )
    kept = jnp.where(slot < first[..., None], group_kept[leaders], from_own)
    counts = jnp.minimum(first + own_counts, max_kept)
    return kept, counts, group_counts[:, 0]
