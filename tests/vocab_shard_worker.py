"""Compile the entropy estimators on vocabulary-sharded logits and report the collectives.

Run by tests/test_distributed.py in a subprocess with 8 forced CPU devices. Prints on its last
line: the vocabulary size, the element count of the largest array any collective in the
compiled programs produces (a full gather of one row would be >= V), and the largest
difference from the single-device values.
"""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from etjax.distributed.mesh import MODEL, MeshShape, make_mesh
from etjax.distributed.placement import Placement
from etjax.distributed.topk import top_k
from etjax.entropy.estimators import exact_entropy, tail_bounds
from etjax.sampling.sampler import initial_sampler_state, sample_next
from etjax.sampling.settings import SamplerSettings, pack_sampler_params

_COLLECTIVE = re.compile(
    r"=\s*\(?([a-z0-9]+)\[([0-9,]*)\][^=]*?\b(all-gather|all-reduce|all-to-all|"
    r"collective-permute|reduce-scatter)(?:-start)?\("
)


def largest_collective(hlo: str) -> int:
    largest = 0
    for match in _COLLECTIVE.finditer(hlo):
        dims = [int(d) for d in match.group(2).split(",") if d]
        largest = max(largest, int(np.prod(dims)) if dims else 1)
    return largest


def main() -> None:
    vocab, rows = 49152, 4
    placement = Placement(make_mesh(MeshShape(1, 8)))
    mesh = placement.mesh
    logits = jax.random.normal(jax.random.key(0), (rows, vocab), jnp.float32) * 4.0
    sharded = jax.device_put(logits, NamedSharding(mesh, P(None, MODEL)))

    def on_mesh(estimator):
        # As the decode programs trace: with the mesh visible to mesh-aware code.
        def traced(x):
            with placement.tracing():
                return estimator(x)

        return jax.jit(traced)

    def sampler(*settings: SamplerSettings):
        # The sampler as the decode step runs it, for `rows` rows of these settings.
        params = pack_sampler_params(list(settings), rows)
        state = initial_sampler_state(params)
        counts = jnp.zeros((rows, vocab), jnp.int32)
        in_prompt = jnp.zeros((rows, vocab), bool)

        def sample(x):
            tokens, info, _ = sample_next(
                x, params, state, counts, in_prompt, jnp.zeros(rows, jnp.int32)
            )
            return tokens, info.model_entropy, info.sampled_entropy

        return sample

    plain = sampler(
        SamplerSettings(temperature=0.8, seed=1),
        SamplerSettings(temperature=1.0, seed=2),
        SamplerSettings(sampler="entropic", target_entropy=1.5, seed=3),
    )
    # Top-p falls back to sorting the whole row when the top candidates do not hold the mass:
    # that branch gathers the row, so only its exactness is checked.
    filtered = sampler(SamplerSettings(temperature=0.7, top_p=0.9, min_p=0.05, seed=4))
    estimators = [
        (exact_entropy, True),
        (lambda x: tail_bounds(x, 64), True),
        (lambda x: top_k(x, 64), True),
        (plain, True),
        (filtered, False),
    ]
    largest, error = 0, 0.0
    for estimator, ungathered in estimators:
        program = on_mesh(estimator)
        if ungathered:
            hlo = program.lower(sharded).compile().as_text()
            largest = max(largest, largest_collective(hlo))
        got = jax.tree.leaves(program(sharded))
        want = jax.tree.leaves(jax.jit(estimator)(np.asarray(logits)))  # on one device
        assert all(g.dtype == w.dtype for g, w in zip(got, want, strict=True))
        error = max(
            error,
            *(
                float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
                for g, w in zip(got, want, strict=True)
            ),
        )
    print(
        json.dumps(
            {"vocab_size": vocab, "largest_collective_elements": largest, "max_abs_error": error}
        )
    )


if __name__ == "__main__":
    main()
