"""The sampler suite against transformers' logits processors and hand-computed values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import etjax
from etjax.engine_build import RequestSettings, SequenceOutput, generate_ids
from etjax.errors import RequestError
from etjax.sampling.filters import apply_penalties, truncate
from etjax.sampling.sampler import initial_sampler_state, sample_next
from etjax.sampling.settings import SamplerSettings, pack_sampler_params

VOCAB = 300


def _logits(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, (rows, VOCAB)).astype(np.float32)


def _kept(x: np.ndarray) -> np.ndarray:
    return np.isfinite(x)


def _entropy(z: np.ndarray) -> np.ndarray:
    # -sum p log p of softmax(z) per row, in float64 NumPy: the truth, apart from etjax's code.
    x = z.astype(np.float64) - z.max(-1, keepdims=True)
    log_p = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return -(np.exp(log_p) * log_p).sum(-1)


# Jitted once: one program per row count serves every setting (settings are arrays), where
# eager calls compile each operation on its own.
_truncate = jax.jit(truncate)
_apply_penalties = jax.jit(apply_penalties)


@pytest.mark.parametrize(
    "setting,warper",
    [
        (dict(top_k=7), lambda: __import__("transformers").TopKLogitsWarper(7)),
        (dict(top_p=0.8), lambda: __import__("transformers").TopPLogitsWarper(0.8)),
        # A nucleus wider than the 256 candidates: the exact full-sort fallback.
        (dict(top_p=0.995), lambda: __import__("transformers").TopPLogitsWarper(0.995)),
        (dict(min_p=0.001), lambda: __import__("transformers").MinPLogitsWarper(0.001)),
        (dict(min_p=0.05), lambda: __import__("transformers").MinPLogitsWarper(0.05)),
        (dict(typical_p=0.7), lambda: __import__("transformers").TypicalLogitsWarper(0.7)),
    ],
)
def test_filters_keep_the_same_tokens_as_transformers(setting, warper):
    z = _logits(4)
    params = pack_sampler_params([SamplerSettings(temperature=1.0, **setting)] * 4, 4, xp=np)
    ours = np.asarray(_truncate(z, params, np.zeros(4, np.float32)))
    reference = warper()(torch.zeros((4, 1), dtype=torch.long), torch.tensor(z)).numpy()
    differ = _kept(ours) != _kept(reference)
    if "top_p" in setting:
        # Both sides sum float32 probabilities in different orders, so a token whose mass
        # ahead equals top_p to ~1e-6 may fall either way; any other difference is a bug.
        p64 = np.exp(z.astype(np.float64) - z.max(axis=1, keepdims=True))
        p64 /= p64.sum(axis=1, keepdims=True)
        order = np.argsort(-p64, axis=1)
        ahead = np.zeros_like(p64)
        np.put_along_axis(
            ahead,
            order,
            np.cumsum(np.take_along_axis(p64, order, 1), 1) - np.take_along_axis(p64, order, 1),
            1,
        )
        assert np.all(np.abs(ahead[differ] - setting["top_p"]) < 1e-5)
    else:
        assert not differ.any()
    np.testing.assert_array_equal(ours[_kept(ours)], z[_kept(ours)])


def _stable_prefix(order_by: np.ndarray, probs: np.ndarray, limit: float) -> np.ndarray:
    # Reference: in the stable order of `order_by` ascending (ties by index), keep tokens while
    # the float64 mass ahead of them is below `limit`, the first always.
    order = np.argsort(order_by, kind="stable")
    sorted_p = probs[order]
    ahead = np.cumsum(sorted_p) - sorted_p
    kept = np.zeros(len(probs), bool)
    kept[order] = (ahead < limit) | (np.arange(len(probs)) == 0)
    return kept, np.abs(ahead[np.argsort(order)] - limit)


@pytest.mark.parametrize("setting", [dict(top_p=0.995), dict(top_p=0.6), dict(typical_p=0.7)])
def test_filters_split_exact_ties_by_index_as_a_stable_sort_would(setting):
    # Logits on a grid of quarters: many tokens share each value, and the cut-off falls
    # inside a group of ties, which neither filter permutes (filters.py sorts keys alone).
    z = np.round(_logits(4, seed=3) * 2) / 4
    params = pack_sampler_params([SamplerSettings(temperature=1.0, **setting)] * 4, 4, xp=np)
    ours = _kept(np.asarray(_truncate(z, params, np.zeros(4, np.float32))))
    ties_cut = 0
    for row in range(4):
        p64 = np.exp(z[row].astype(np.float64) - z[row].max())
        p64 /= p64.sum()
        if "top_p" in setting:
            want, margin = _stable_prefix(-z[row], p64, setting["top_p"])
        else:
            surprise_gap = np.abs(-np.log(p64) - np.sum(-p64 * np.log(p64)))
            want, margin = _stable_prefix(surprise_gap, p64, setting["typical_p"])
        assert np.all((ours[row] == want) | (margin < 1e-5))
        split = [v for v in np.unique(z[row]) if len(set(want[z[row] == v])) == 2]
        ties_cut += bool(split)
    assert ties_cut >= 2  # the case the test is for: a group of equal logits split at the cut


def test_filters_are_per_row():
    z = _logits(3, seed=1)
    settings = [SamplerSettings(top_k=3), SamplerSettings(), SamplerSettings(top_p=0.5)]
    out = np.asarray(_truncate(z, pack_sampler_params(settings, 3, xp=np), np.zeros(3, np.float32)))
    assert _kept(out[0]).sum() == 3
    assert _kept(out[1]).all()
    assert 1 <= _kept(out[2]).sum() < VOCAB


def test_penalties_match_transformers_and_hand_computation():
    import transformers

    z = _logits(2, seed=2)
    prompt = np.array([[1, 5, 9], [2, 2, 7]])
    output = np.array([[5, 5, 11], [3, 100, 3]])
    counts = np.zeros((2, VOCAB), np.int32)
    in_prompt = np.zeros((2, VOCAB), bool)
    for r in range(2):
        np.add.at(counts[r], output[r], 1)
        in_prompt[r, prompt[r]] = True
    # Repetition penalty alone: transformers applies it to every token of input_ids.
    params = pack_sampler_params([SamplerSettings(repetition_penalty=1.3)] * 2, 2, xp=np)
    ours = np.asarray(_apply_penalties(z, params, counts, in_prompt))
    processor = transformers.RepetitionPenaltyLogitsProcessor(1.3)
    ids = torch.tensor(np.concatenate([prompt, output], axis=1))
    reference = processor(ids, torch.tensor(z)).numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-6)
    # Presence and frequency (OpenAI semantics): z - presence * [count > 0] - frequency * count.
    params = pack_sampler_params(
        [SamplerSettings(presence_penalty=0.5, frequency_penalty=0.25)] * 2, 2, xp=np
    )
    ours = np.asarray(_apply_penalties(z, params, counts, in_prompt))
    expected = z - 0.5 * (counts > 0) - 0.25 * counts
    np.testing.assert_allclose(ours, expected, rtol=1e-6)


@jax.jit
def _sample(z: jax.Array, params, index: jax.Array):
    # One program per row count, as the engine runs it: called eagerly, each of the sampler's
    # operations would compile on its own (some seventy programs a test).
    rows = z.shape[0]
    return sample_next(
        z,
        params,
        initial_sampler_state(params),
        jnp.zeros((rows, VOCAB), jnp.int32),
        jnp.zeros((rows, VOCAB), bool),
        jnp.full((rows,), index, jnp.int32),
    )


def _draw(settings: list[SamplerSettings], z: np.ndarray, index: int = 0):
    params = pack_sampler_params(settings, len(settings), xp=np)
    return _sample(z, params, np.int32(index))


def test_sampling_follows_the_tempered_distribution():
    # 4000 draws from a 3-token distribution at T = 0.5: frequencies within 4 sigma of softmax(z/T).
    z = np.full((1, VOCAB), -np.inf, np.float32)
    z[0, :3] = [0.0, -0.5, -1.0]
    expected = np.exp(z[0, :3] / 0.5) / np.exp(z[0, :3] / 0.5).sum()
    params = pack_sampler_params([SamplerSettings(temperature=0.5, seed=3)], 1, xp=np)
    # All draws in one call: token index i keys the i-th draw's random stream.
    draws = jax.vmap(_sample, in_axes=(None, None, 0))(z, params, np.arange(4000, dtype=np.int32))
    tokens = np.asarray(draws[0][:, 0])
    freq = np.bincount(tokens, minlength=3)[:3] / len(tokens)
    sigma = np.sqrt(expected * (1 - expected) / len(tokens))
    assert np.all(np.abs(freq - expected) < 4 * sigma)


def test_sampled_entropy_and_temperature_are_reported():
    z = _logits(3, seed=4)
    settings = [
        SamplerSettings(),
        SamplerSettings(temperature=0.7, seed=1),
        SamplerSettings(temperature=1.0, top_k=2, seed=1),
    ]
    tokens, info, _ = _draw(settings, z)
    np.testing.assert_allclose(info.temperature, [0.0, 0.7, 1.0], rtol=1e-6)
    assert float(info.sampled_entropy[0]) == 0.0  # greedy draws from a point mass
    np.testing.assert_allclose(info.sampled_entropy[1], _entropy(z[1:2] / 0.7)[0], rtol=1e-5)
    top2 = np.sort(z[2])[-2:]
    p = np.exp(top2 - top2.max()) / np.exp(top2 - top2.max()).sum()
    assert float(info.sampled_entropy[2]) == pytest.approx(-(p * np.log(p)).sum(), rel=1e-5)
    np.testing.assert_allclose(info.model_entropy, _entropy(z), rtol=1e-6)
    assert int(tokens[0]) == int(np.argmax(z[0]))


def test_edt_temperature_formula():
    z = _logits(1, seed=5)
    s = SamplerSettings(sampler="edt", edt_t0=0.9, edt_theta=2.0, edt_base=0.8, seed=2)
    _, info, _ = _draw([s], z)
    h = float(_entropy(z)[0])
    assert float(info.temperature[0]) == pytest.approx(0.9 * 0.8 ** (2.0 / h), rel=1e-5)


def test_mirostat_truncates_by_surprise_and_steers_mu():
    z = _logits(1, seed=6)
    s = SamplerSettings(
        sampler="mirostat_v2", temperature=1.0, mirostat_tau=3.0, mirostat_eta=0.5, seed=9
    )
    state = jax.jit(initial_sampler_state)(pack_sampler_params([s], 1, xp=np))
    assert float(state.mirostat_mu[0]) == pytest.approx(6.0)  # mu starts at 2 tau
    tokens, info, new_state = _draw([s], z)
    p = np.exp(z[0] - z[0].max())
    p /= p.sum()
    kept = -np.log2(p) <= 6.0
    kept[np.argmax(p)] = True
    assert kept[int(tokens[0])]
    q = np.where(kept, p, 0.0) / np.where(kept, p, 0.0).sum()
    surprise = -np.log2(q[int(tokens[0])])
    assert float(new_state.mirostat_mu[0]) == pytest.approx(6.0 - 0.5 * (surprise - 3.0), rel=1e-4)
    assert float(info.sampled_entropy[0]) == pytest.approx(
        -(q[q > 0] * np.log(q[q > 0])).sum(), rel=1e-4
    )


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(temperature=-0.5), "temperature=-0.5"),
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_p=1.5), "top_p=1.5"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(min_p=2.0), "min_p=2.0"),
        (dict(typical_p=0.0), "typical_p=0.0"),
        (dict(sampler="beam"), "sampler='beam'"),
        (dict(t_min=3.0, t_max=1.0), "t_min=3.0"),
        (dict(edt_base=1.5), "edt_base=1.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    ],
)
def test_invalid_settings_are_rejected(options, match):
    with pytest.raises(RequestError, match=match):
        SamplerSettings(**options)


def test_decode_rejects_unknown_option_before_running():
    with pytest.raises(RequestError, match="unknown sampler option 'top_q'"):
        etjax.decode("hi", model=object(), top_q=0.5)


def test_every_sampler_in_one_batch_without_recompiling(tiny_hf_dir):
    from tests.compile_counter import counting_new_programs

    model = etjax.load_model(tiny_hf_dir("llama"))
    base = [
        SamplerSettings(),
        SamplerSettings(temperature=0.8, top_k=20, seed=1),
        SamplerSettings(temperature=0.9, top_p=0.9, min_p=0.02, seed=2),
        SamplerSettings(temperature=1.0, typical_p=0.8, repetition_penalty=1.2, seed=3),
        SamplerSettings(sampler="mirostat_v2", temperature=1.0, seed=4),
        SamplerSettings(sampler="edt", seed=5),
        SamplerSettings(sampler="entropic", target_entropy=3.0, seed=6),
        SamplerSettings(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=7),
    ]
    prompts = [
        "The weather today",
        "In 1990 the",
        "Numbers: 1 2 3",
        "Once upon",
        "Q: why?",
        "Dear sir,",
        "import numpy",
        "The end",
    ]

    ids = [model.tokenizer.encode(p) for p in prompts]

    def run(order: list[int]) -> list[SequenceOutput]:
        return generate_ids(
            model.weights,
            model.config,
            model.tokenizer,
            [ids[i] for i in order],
            [RequestSettings(max_new_tokens=12, sampler=base[i]) for i in order],
        )

    first = run(list(range(8)))
    with counting_new_programs() as compiles:
        reversed_ = run(list(range(8))[::-1])  # every row slot holds another sampler now
    assert compiles[0] == 0
    for a, b in zip(first, reversed_[::-1], strict=True):
        # Seeded: each request draws the same tokens again, from whichever row it runs in.
        assert a.token_ids == b.token_ids
    # the same request alone gives the same tokens as inside the mixed batch
    for i in (1, 4, 6):
        (alone,) = generate_ids(
            model.weights,
            model.config,
            model.tokenizer,
            [ids[i]],
            [RequestSettings(max_new_tokens=12, sampler=base[i])],
        )
        assert alone.token_ids == first[i].token_ids
