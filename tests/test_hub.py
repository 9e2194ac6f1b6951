"""Hub ids through `huggingface_hub`, on a Hugging Face cache laid out by the test itself and
HF_HUB_OFFLINE set: nothing touches the network."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from etjax.errors import ModelLoadError
from etjax.loaders import hub
from tests.subprocess_env import subprocess_env

COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Each model named on the command line: its name and source, then its greedy token and that
# token's log-probability for one prompt (the prefill's programs alone, no decode burst's).
# One process for all (a second load's decode reuses the first's compiled programs).
LOAD = (
    "import sys, etjax\nfor name in sys.argv[1:]:\n    m = etjax.load_model(name)\n"
    "    print(m.name, m.source)\n"
    "    (r,) = etjax.decode('Hi', model=m, max_new_tokens=1, logprobs=3)\n"
    "    print(r.token_ids, r.top_logprobs)"
)


def _env(tmp_path):
    env = subprocess_env()
    env["HF_HUB_CACHE"] = str(tmp_path / "hub")
    env["HF_HUB_OFFLINE"] = "1"
    return env


def test_a_cached_hub_id_loads_offline_as_its_local_directory(tiny_hf_dir, tmp_path):
    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(tiny_hf_dir("llama"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    by_path = str(tiny_hf_dir("llama"))
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, "someone/tiny-llama", by_path],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    name_line, tokens, _, path_tokens = loaded.stdout.splitlines()[-4:]
    assert name_line == f"someone/tiny-llama {snapshot}"
    assert path_tokens == tokens  # the same model, the same tokens


def test_an_uncached_hub_id_offline_says_how_to_get_it(tmp_path):
    env = _env(tmp_path)
    failed = subprocess.run(
        [sys.executable, "-m", "etjax.cli", "generate", "x", "--model", "someone/absent"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert failed.returncode == 2
    assert "someone/absent is not in the Hugging Face cache" in failed.stderr
    assert "huggingface-cli download someone/absent" in failed.stderr


@pytest.mark.parametrize(
    "name, is_id",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
        ("meta-llama/Llama-3.1-8B@main", True),
        ("model.gguf", False),
        ("./local/dir", False),
        ("/abs/dir", False),
        ("a/b/c", False),
    ],
)
def test_what_reads_as_a_hub_id(name, is_id):
    assert hub.is_hub_id(name) is is_id


def test_a_revision_is_given_once():
    assert hub.split_revision("o/n@v1", None) == ("o/n", "v1")
    assert hub.split_revision("o/n", "v2") == ("o/n", "v2")
    with pytest.raises(ModelLoadError, match="revision"):
        hub.split_revision("o/n@v1", "v2")


def test_a_missing_pickle_path_is_reported_missing(tmp_path):
    import etjax

    with pytest.raises(ModelLoadError, match="file not found"):
        etjax.load_model(tmp_path / "foo.bin")
