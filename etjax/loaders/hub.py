"""Hugging Face hub ids: `load_model("HuggingFaceTB/SmolLM2-135M-Instruct")`.

An id is fetched with `huggingface_hub` into its standard cache (HF_HOME / HF_HUB_CACHE), then
loaded as the local Hugging Face directory it becomes. Only what etjax reads is downloaded:
config.json, the safetensors weights (and their index), the tokenizer files; never a pickle
checkpoint, which etjax refuses to load anyway. `huggingface_hub` honours HF_HUB_OFFLINE (the
cache only) and HF_TOKEN (gated and private repositories). A revision (branch, tag or commit)
is given as `repo@revision` or `revision=`.
"""

from __future__ import annotations

import re
from pathlib import Path

from etjax.errors import ModelLoadError

WANTED_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]
# owner/name, as the hub spells repository ids, with an optional @revision.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


def is_hub_id(name: str) -> bool:
    """Whether `name` reads as a hub id (it is only taken as one when no local path exists)."""
    return bool(_HUB_ID.match(name)) and not name.startswith((".", "/", "~"))


def split_revision(name: str, revision: str | None) -> tuple[str, str | None]:
    repo, _, at = name.partition("@")
    if at and revision and at != revision:
        raise ModelLoadError(f"{name!r} names revision {at!r} but revision={revision!r}")
    return repo, at or revision


def fetch(name: str, revision: str | None = None) -> Path:
    """The local snapshot directory of hub id `name`, downloaded if it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = split_revision(name, revision)
    where = f"{repo}" + (f"@{revision}" if revision else "")
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=WANTED_FILES))
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"{where} is not in the Hugging Face cache and cannot be downloaded here (offline, "
            "or HF_HUB_OFFLINE is set). On a machine with network run `huggingface-cli "
            f"download {repo} --include '*.safetensors' '*.json'` and copy the cache "
            "(HF_HOME), or pass the local directory of the model instead"
        ) from None
    except GatedRepoError:
        raise ModelLoadError(
            f"{where} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelLoadError(f"{where}: no such revision on the hub") from None
    except RepositoryNotFoundError:
        raise ModelLoadError(
            f"{where}: no such repository on the hub (or it is private: set HF_TOKEN)"
        ) from None
