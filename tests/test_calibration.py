"""The entropy signal's calibration (etjax/calibration): its measures against hand-computed
values, the optax fit against a brute-force grid, the file's validation, and the engine
reading the calibrated signal while sampling and the default path stay as they were."""

from __future__ import annotations

import dataclasses
import json
import logging

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import etjax
from etjax.calibrate.fit import calibrate, fit_temperature, mean_nll
from etjax.calibrate.metrics import entropy_gap, expected_calibration_error, token_statistics
from etjax.calibration.file import Calibration, load_calibration, save_calibration
from etjax.calibration.identity import model_identity
from etjax.calibration.signal import CalibrationParams, calibrated_entropy
from etjax.cli import main
from etjax.engine_build import RequestSettings, RuntimeOptions, generate_ids
from etjax.errors import CalibrationError
from etjax.pruning.budget import kept_block_count, kept_fraction
from etjax.pruning.config import PruningConfig
from tests import compile_level
from tests.compile_counter import counting_new_programs
from tests.model_runner import full_logits


def _softmax_stats(z: np.ndarray, y: np.ndarray, t: float) -> dict[str, np.ndarray]:
    # float64 truth: surprisal, entropy, confidence, correctness at temperature t.
    x = z.astype(np.float64) / t
    x = x - x.max(axis=1, keepdims=True)
    log_p = x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    p = np.exp(log_p)
    return {
        "surprisal": -log_p[np.arange(len(y)), y],
        "entropy": -(p * log_p).sum(axis=1),
        "confidence": p.max(axis=1),
        "correct": z.argmax(axis=1) == y,
    }


def _synthetic(n: int = 700, v: int = 64, true_t: float = 1.7, seed: int = 0):
    # Logits and tokens drawn from softmax(z / true_t): a model whose calibration is known.
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, v)) * 3.0).astype(np.float32)
    x = z.astype(np.float64) / true_t
    probs = np.exp(x - x.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    y = np.array([rng.choice(v, p=row) for row in probs], np.int32)
    return z, y


def test_ece_of_a_hand_computed_example():
    # 15 bins of width 1/15. 0.95, 0.97, 0.99 share bin (14/15, 1]: accuracy 2/3, mean
    # confidence 0.97, weight 3/5. 0.21 and 0.26 share (3/15, 4/15]: accuracy 0, mean 0.235,
    # weight 2/5. ECE = 0.6 * |2/3 - 0.97| + 0.4 * 0.235.
    confidence = np.array([0.95, 0.97, 0.99, 0.21, 0.26])
    correct = np.array([True, False, True, False, False])
    expected = 0.6 * abs(2 / 3 - 0.97) + 0.4 * 0.235
    assert expected_calibration_error(confidence, correct) == pytest.approx(expected, abs=1e-12)
    # A perfectly calibrated bin contributes nothing: confidence 0.5, half of them right.
    assert expected_calibration_error(np.full(4, 0.5), np.array([1, 0, 1, 0], bool)) == 0.0


def test_entropy_gap_by_hand():
    # Two equal-count bins: entropies [1, 1] vs surprisals [0, 2] (gap 0 in the bin, -0 mean),
    # entropies [3, 3] vs surprisals [1, 1] (gap 2).
    gap = entropy_gap(np.array([1.0, 3.0, 1.0, 3.0]), np.array([0.0, 1.0, 2.0, 1.0]), bins=2)
    assert gap["mean"] == pytest.approx(1.0)
    assert gap["binned"] == pytest.approx(0.5 * 0.0 + 0.5 * 2.0)


def test_token_statistics_match_float64():
    z, y = _synthetic(n=300, v=50)
    for t in (1.0, 0.6, 2.5):
        ours = token_statistics(jnp.asarray(z), jnp.asarray(y), jnp.float32(t))
        truth = _softmax_stats(z, y, t)
        chex.assert_trees_all_close(
            {k: np.asarray(ours[k], np.float64) for k in ("surprisal", "entropy", "confidence")},
            {k: truth[k] for k in ("surprisal", "entropy", "confidence")},
            rtol=1e-4,
            atol=1e-5,
        )
        np.testing.assert_array_equal(np.asarray(ours["correct"]), truth["correct"])


def test_fitted_temperature_minimises_nll_against_a_numpy_grid():
    z, y = _synthetic()
    fit = fit_temperature(z, y)
    grid = np.linspace(0.5, 4.0, 3501)  # steps of 0.001
    nll = np.array([_softmax_stats(z, y, t)["surprisal"].mean() for t in grid])
    best = grid[nll.argmin()]
    assert abs(fit.temperature - best) <= 0.0015
    assert _softmax_stats(z, y, fit.temperature)["surprisal"].mean() <= nll.min() + 1e-7
    assert abs(fit.temperature - 1.7) < 0.25  # and near the temperature the tokens came from
    assert fit.nll_after < fit.nll_before
    # The first-order condition of the optimum: mean entropy equals mean surprisal.
    at_fit = _softmax_stats(z, y, fit.temperature)
    assert abs(at_fit["entropy"].mean() - at_fit["surprisal"].mean()) < 1e-4
    # Deterministic: the same data give the same temperature, bit for bit.
    assert fit_temperature(z, y).temperature == fit.temperature
    # The objective itself is the float64 mean NLL (rows padded to the chunk count 0).
    padded = np.pad(z, ((0, 68), (0, 0))), np.pad(y, (0, 68), constant_values=-1)
    ours = float(mean_nll(jnp.log(jnp.float32(1.3)), *map(jnp.asarray, padded)))
    assert ours == pytest.approx(_softmax_stats(z, y, 1.3)["surprisal"].mean(), rel=1e-5)


def test_fit_checks_shapes_before_tracing():
    z, y = _synthetic(n=40, v=8)
    with pytest.raises(AssertionError, match="rank"):
        fit_temperature(z[None], y)  # [1, N, V]
    with pytest.raises(AssertionError, match="shape"):
        fit_temperature(z, y[:-1])  # one target short
    with pytest.raises(AssertionError, match="type"):
        fit_temperature(z, y.astype(np.float32))  # targets must be token ids


def test_calibrated_entropy_is_raw_at_t1_and_the_tempered_entropy_otherwise():
    z, _ = _synthetic(n=3, v=40)
    raw = jnp.asarray(_softmax_stats(z, np.zeros(3, np.int64), 1.0)["entropy"], jnp.float32)
    t = np.array([1.0, 1.5, 0.7], np.float32)
    out = np.asarray(calibrated_entropy(jnp.asarray(z), raw, CalibrationParams(jnp.asarray(t))))
    assert out[0] == raw[0]  # bit for bit: no calibration, no change
    for row in (1, 2):
        truth = _softmax_stats(z[row : row + 1], np.zeros(1, np.int64), float(t[row]))["entropy"]
        assert out[row] == pytest.approx(truth[0], rel=1e-5)
    # All rows uncalibrated: the raw values pass through untouched.
    ones = CalibrationParams(jnp.ones(3, jnp.float32))
    np.testing.assert_array_equal(calibrated_entropy(jnp.asarray(z), raw, ones), raw)


def test_calibration_file_round_trip(tmp_path):
    cal = Calibration(1.25, "tiny", 49152, {"tokens": 10, "nll_before": 3.0}, ramp_shift=0.375)
    path = save_calibration(cal, tmp_path / "cal.json")
    assert load_calibration(path, vocab_size=49152) == cal
    assert load_calibration(path).fit == {"tokens": 10, "nll_before": 3.0}
    assert load_calibration(path).ramp_shift == 0.375


def test_a_file_without_a_ramp_shift_leaves_the_ramp_where_it_is(tmp_path):
    (tmp_path / "cal.json").write_text(json.dumps(GOOD))  # a temperature alone, as by hand
    assert load_calibration(tmp_path / "cal.json").ramp_shift == 0.0


GOOD = {
    "format": "etjax-calibration",
    "version": 1,
    "model": "tiny",
    "vocab_size": 49152,
    "temperature": 1.2,
}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"temperature": -1.0}, r"field 'temperature' = -1.0; must be a number in \[0.05, 20"),
        ({"temperature": "1.2"}, r"field 'temperature' = '1.2'"),
        ({"temperature": True}, r"field 'temperature' = True"),
        ({"temperature": float("nan")}, r"field 'temperature' = nan"),
        ({"version": 3}, r"field 'version' = 3; this etjax reads versions 1, 2"),
        ({"version": 2}, r"missing field 'model_identity' \(version 2 files record"),
        ({"model_identity": ["llama"]}, r"field 'model_identity' = \['llama'\]; must be an obj"),
        ({"format": "pickle"}, r"field 'format' = 'pickle'"),
        ({"vocab_size": 0}, r"field 'vocab_size' = 0; must be a positive integer"),
        ({"code": "import os"}, r"unknown field 'code'"),
        ({"temperature": None}, r"field 'temperature' = None"),
        ({"fit": {"nested": {"a": 1}}}, r"field 'fit'"),
        ({"ramp_shift": "0.4"}, r"field 'ramp_shift' = '0.4'; must be a number of nats"),
        ({"ramp_shift": 40.0}, r"field 'ramp_shift' = 40.0; must be a number of nats in \[-16"),
        ({"ramp_shift": float("inf")}, r"field 'ramp_shift' = inf"),
        ({"ramp_shift": False}, r"field 'ramp_shift' = False"),
    ],
)
def test_bad_calibration_files_are_refused_naming_file_field_and_value(tmp_path, change, message):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**GOOD, **change}))
    with pytest.raises(CalibrationError, match=message) as e:
        load_calibration(path)
    assert str(path) in str(e.value)


def test_unreadable_or_mismatched_calibration_files(tmp_path):
    with pytest.raises(CalibrationError, match="not found"):
        load_calibration(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{temperature: 1")
    with pytest.raises(CalibrationError, match=r"bad\.json: not a JSON calibration file"):
        load_calibration(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text("[1.2]")
    with pytest.raises(CalibrationError, match="expected a JSON object"):
        load_calibration(tmp_path / "list.json")
    missing = {k: v for k, v in GOOD.items() if k != "model"}
    (tmp_path / "partial.json").write_text(json.dumps(missing))
    with pytest.raises(CalibrationError, match="missing field 'model'"):
        load_calibration(tmp_path / "partial.json")
    (tmp_path / "other.json").write_text(json.dumps(GOOD))
    with pytest.raises(CalibrationError, match="'vocab_size' = 49152 but the model has 1000"):
        load_calibration(tmp_path / "other.json", vocab_size=1000)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CalibrationError, match=r"deep\.json: JSON nested too deeply to read"):
        load_calibration(tmp_path / "deep.json")
    (tmp_path / "huge.json").write_text(json.dumps({**GOOD, "fit": {"x": [0] * 50_000}}))
    with pytest.raises(CalibrationError, match=r"field 'fit' = \{'x': \[0, 0,.*\.\.\. \(150007 ch"):
        load_calibration(tmp_path / "huge.json")


# The engine, on a tiny random model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir):
    return etjax.load_model(tiny_hf_dir("llama"))


T = 2.0
# A ramp across the whole range of this model's entropies (about 9.5 nats of at most 10.8), so
# the kept fraction moves with the signal.
RAMP = PruningConfig(enabled=True, min_fraction=0.2, entropy_low=0.0, entropy_high=20.0)


def _run(model, prompts, calibration=None, pruning=None, temperature=0.0):
    # The options of test_pruning_decode.py's runs on the same model, 12 tokens as there, so
    # that a run of both files compiles their programs once: without pruning, its dense XLA
    # runs'; with it, the options of its `etjax.decode` test (decode's own, pages of 4).
    from etjax.sampling import SamplerSettings

    settings = [
        RequestSettings(
            max_new_tokens=12,
            ignore_eos=True,
            sampler=SamplerSettings(temperature=temperature, seed=7 + i),
        )
        for i in range(len(prompts))
    ]
    if pruning is None:
        options = RuntimeOptions(
            page_size=4, steps_per_sync=4, calibration=calibration, attention_backend="xla"
        )
    else:
        options = RuntimeOptions(page_size=4, pruning=pruning, calibration=calibration)
    return generate_ids(model.weights, model.config, model.tokenizer, prompts, settings, options)


def test_calibration_changes_the_signal_not_the_samples_and_compiles_nothing(tiny):
    rng = np.random.default_rng(3)
    # Three rows of test_pruning_decode.py's lengths: its dense run takes these programs.
    prompts = [rng.integers(3, tiny.config.vocab_size, size=n).tolist() for n in (37, 9, 22)]
    cal = Calibration(T, "tiny", tiny.config.vocab_size)
    for temperature in (0.0, 0.8):  # greedy, and sampled with per-request seeds
        plain = _run(tiny, prompts, temperature=temperature)
        with counting_new_programs() as count:
            calibrated = _run(tiny, prompts, cal, temperature=temperature)
        assert count[0] == 0  # the temperature is traced: the same programs run
        for a, b, prompt in zip(plain, calibrated, prompts, strict=True):
            assert a.token_ids == b.token_ids  # sampling is unchanged
            assert a.entropy == b.entropy and a.logprob == b.logprob
            assert a.calibrated_entropy == a.entropy  # no calibration: the signal is raw
            # The calibrated signal is the entropy of softmax(z / T) of the same distributions.
            # One padded shape for every pass (test_kv_cache.py's: compiled once in a run).
            ids = np.zeros((1, 64), np.int32)
            ids[0, : len(prompt) + len(b.token_ids) - 1] = prompt + b.token_ids[:-1]
            z = full_logits(tiny.weights, tiny.config, ids)[0, len(prompt) - 1 :]
            z = z[: len(b.token_ids)]
            truth = _softmax_stats(z, np.zeros(len(z), np.int64), T)["entropy"]
            np.testing.assert_allclose(b.calibrated_entropy, truth, rtol=1e-4, atol=1e-4)
            assert min(np.subtract(b.calibrated_entropy, b.entropy)) > 0  # T > 1: less sure


def test_pruning_budgets_follow_the_calibrated_signal(tiny):
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, tiny.config.vocab_size, size=120).tolist()  # 30+ blocks of 4
    cal = Calibration(T, "tiny", tiny.config.vocab_size)
    for calibration in (None, cal):
        (out,) = _run(tiny, [prompt], calibration, RAMP)
        # Blocks the pass after token i read: the ramp of the signal token i was drawn from,
        # over the blocks the context holds with it (the last token is not run).
        blocks = (len(prompt) + np.arange(len(out.token_ids)) + 4) // 4
        fraction = kept_fraction(np.float32(out.calibrated_entropy), RAMP)
        expected = kept_block_count(fraction, blocks, RAMP, xp=np)
        np.testing.assert_array_equal(out.kept_blocks[:-1], expected[:-1])
        if calibration is None:
            raw_kept = out.kept_blocks
    assert sum(out.kept_blocks) > sum(raw_kept)  # T > 1: a higher signal keeps more blocks


def test_a_calibrations_ramp_shift_moves_the_engines_ramp(tiny):
    # With a ramp shift s the budget is the ramp moved by s nats, read against the calibrated
    # signal: fraction = 0.2 + 0.8 * clip((H - s) / 20); fewer blocks than unshifted (s > 0).
    rng = np.random.default_rng(4)
    prompt = rng.integers(3, tiny.config.vocab_size, size=120).tolist()
    shift = 3.0
    moved = PruningConfig(min_fraction=0.2, entropy_low=shift, entropy_high=20.0 + shift)
    kept = {}
    for s in (0.0, shift):
        cal = Calibration(T, "tiny", tiny.config.vocab_size, ramp_shift=s)
        (out,) = _run(tiny, [prompt], cal, RAMP)
        blocks = (len(prompt) + np.arange(len(out.token_ids)) + 4) // 4
        fraction = kept_fraction(np.float64(out.calibrated_entropy), moved if s else RAMP, xp=np)
        expected = kept_block_count(fraction, blocks, RAMP, xp=np)
        np.testing.assert_array_equal(out.kept_blocks[:-1], expected[:-1])
        kept[s] = sum(out.kept_blocks)
    assert kept[shift] < kept[0.0]


def test_load_model_with_a_calibration_and_decode(tiny_hf_dir, tmp_path, caplog):
    directory = tiny_hf_dir("llama")
    # Made by hand, without the model's identity: a version 1 file, loaded with a warning.
    path = save_calibration(Calibration(T, "tiny", 49152), tmp_path / "cal.json")
    assert json.loads(path.read_text())["version"] == 1
    with caplog.at_level(logging.WARNING, logger="etjax.calibration.file"):
        model = etjax.load_model(directory, calibration=path)
    assert model.calibration.temperature == T
    assert "cal.json: a version 1 calibration file" in caplog.text
    (result,) = etjax.decode("Hello", model=model, max_new_tokens=3)
    assert len(result.calibrated_entropy) == 3
    assert all(c > h for c, h in zip(result.calibrated_entropy, result.entropy, strict=True))
    (tmp_path / "bad.json").write_text(json.dumps({**GOOD, "vocab_size": 7}))
    with pytest.raises(CalibrationError, match=r"bad\.json: field 'vocab_size' = 7"):
        etjax.load_model(directory, calibration=tmp_path / "bad.json")


def test_calibrate_command_fits_on_one_text_and_reports_on_another(
    tiny, tiny_hf_dir, tmp_path, lee
):
    fit_text, held_text = tmp_path / "fit.txt", tmp_path / "held.txt"
    fit_text.write_text(" ".join(lee[:3]))
    held_text.write_text(" ".join(lee[100:102]))
    out = tmp_path / "cal.json"
    args = ["calibrate", "--model", str(tiny_hf_dir("llama")), "--text", str(fit_text)]
    args += ["--held-out", str(held_text), "--window", "64", "--max-tokens", "128"]
    # The fit's L-BFGS evaluates the NLL over [128, 49,152] logits tens of times: it runs
    # faster compiled as users compile (13 s of CPU for the test against 19 cheaply, under
    # load, 2026-12-07).
    with compile_level.as_users_compile():
        assert main([*args, "--output", str(out)]) == 0
    cal = load_calibration(out, vocab_size=49152)
    fit = cal.fit
    assert fit["tokens"] == 128 and fit["held_out_tokens"] >= 128
    # The file records the model it was fitted on (the same weights as `tiny`'s).
    assert json.loads(out.read_text())["version"] == 2
    assert cal.identity["architecture"] == "llama" and cal.identity["num_layers"] == 2
    assert load_calibration(out, 49152, model_identity(tiny)) == cal
    assert fit["nll_after"] <= fit["nll_before"] and fit["optimizer"] == "optax.lbfgs"
    # A random model is far too sure of itself: the fit raises T and closes most of the gap
    # between its entropy and the surprisal, on the text it saw and on the other.
    assert cal.temperature > 1
    # The paired ramp: a higher signal (T > 1) needs the ramp moved up to keep the budget.
    assert cal.ramp_shift > 0 and 0.2 <= fit["ramp_kept_fraction"] <= 1
    for where in ("", "held_out_"):
        before, after = fit[f"{where}entropy_gap_before"], fit[f"{where}entropy_gap_after"]
        assert abs(after) < abs(before) / 10
        assert fit[f"{where}ece_after"] < fit[f"{where}ece_before"]
    # Deterministic: the same text, the same file.
    again = tmp_path / "again.json"
    with compile_level.as_users_compile():
        assert main([*args, "--output", str(again)]) == 0
    assert json.loads(again.read_text()) == json.loads(out.read_text())


def test_a_file_fitted_for_another_model_of_the_same_vocabulary_is_refused(tiny, tmp_path):
    # The same architecture, sizes and vocabulary; one norm weight moved, as a fine-tune would.
    layers = list(tiny.weights.layers)
    layers[1] = layers[1].replace(attn_norm=layers[1].attn_norm + 0.5)
    tuned = dataclasses.replace(tiny.weights, layers=tuple(layers))
    other = dataclasses.replace(tiny, weights=tuned, name="tiny-tuned")
    fitted = Calibration(T, "tiny-tuned", 49152, identity=model_identity(other))
    path = save_calibration(fitted, tmp_path / "tuned.json")
    assert load_calibration(path, 49152, model_identity(other)) == fitted
    with pytest.raises(CalibrationError) as refused:
        load_calibration(path, 49152, model_identity(tiny), model_name="tiny")
    message = str(refused.value)
    assert message.startswith(f"{path}: fitted for another model: the file's model ('tiny-tuned')")
    assert "the model loaded ('tiny') differ in weights 'sha256:" in message
    assert "architecture" not in message and "vocab_size" not in message  # only what differs


def test_the_identity_is_the_weights_not_the_dtype_they_load_in(tiny_hf_dir, tiny):
    bf16 = etjax.load_model(tiny_hf_dir("llama"), dtype="bfloat16")
    assert bf16.weights.embed.dtype == jnp.bfloat16
    assert model_identity(bf16) == model_identity(tiny)


def test_calibrate_refuses_too_little_text_before_running_the_model(tiny, tiny_hf_dir, tmp_path):
    few = "The river ran"
    scored = len(tiny.tokenizer.encode(few)) - 1  # a window of n tokens scores n - 1
    with pytest.raises(CalibrationError, match=rf"texts \(--text\) holds {scored} scored tok"):
        calibrate(tiny, few)
    with pytest.raises(CalibrationError, match=r"held_out \(--held-out\) holds 0 scored tokens"):
        calibrate(tiny, "word " * 400, held_out="")
    with pytest.raises(CalibrationError, match=r"max_tokens \(--max-tokens\) = 100; must be an"):
        calibrate(tiny, "word " * 400, max_tokens=100)
    (tmp_path / "few.txt").write_text(few)
    code = main(["calibrate", "--model", str(tiny_hf_dir("llama")), "--text",
                 str(tmp_path / "few.txt"), "--output", str(tmp_path / "c.json")])  # fmt: skip
    assert code == 2 and not (tmp_path / "c.json").exists()


def test_calibrate_command_checks_files_before_loading(tmp_path, capsys):
    code = main(["calibrate", "--model", "/nonexistent", "--text", str(tmp_path / "no.txt"),
                 "--output", str(tmp_path / "c.json")])  # fmt: skip
    assert code == 2
    assert "--text" in capsys.readouterr().err


def test_generate_and_batch_take_a_calibration_and_check_it_first(tmp_path, capsys):
    # `--calibration` on the CLI reaches load_model, which checks the file before the weights.
    (tmp_path / "bad.json").write_text(json.dumps({**GOOD, "temperature": -1}))
    for command in (
        ["generate", "Hello", "--calibration", str(tmp_path / "bad.json")],
        ["batch", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
         "--calibration", str(tmp_path / "bad.json")],
    ):  # fmt: skip
        (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "Hi"}\n')
        assert main(command) != 0
        assert "bad.json" in capsys.readouterr().err
