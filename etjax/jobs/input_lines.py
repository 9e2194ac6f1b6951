"""`input_lines`: a batch job's input, read lazily, one line at a time.

Each line of this process's shard is known by its id before it is parsed (a JSON decode, no
tokenizing), so a rerun can skip finished records cheaply; `InputLine.parse` does the rest.
Only the set of ids seen so far is kept, to catch duplicates: a later line with an id already
seen becomes an error result under the id `ID@lineN`. Read twice, a file gives the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from etjax.jobs.records import ParsedRecord, RecordId, parse_record, record_id
from etjax.loaders.loaded_model import Model
from etjax.run_config import RunConfig


@dataclass(frozen=True)
class InputLine:
    number: int  # 1-based
    id: RecordId
    raw: bytes
    duplicate: bool

    def parse(self, model: Model, config: RunConfig) -> ParsedRecord:
        """The validated record; a bad line gives a record with `error` set."""
        n = self.number
        try:
            text = self.raw.decode("utf-8")
        except UnicodeDecodeError as e:
            rec = ParsedRecord(
                self.id,
                n,
                error=f"line {n}: not UTF-8 (byte {self.raw[e.start]:#04x} at column "
                f"{e.start + 1})",
                fingerprint="line:" + hashlib.sha256(self.raw).hexdigest()[:16],
            )
        else:
            rec = parse_record(text, n, model, config)
        if self.duplicate:
            rec.id = self.id
            rec.error = f"line {n}: duplicate id {self.id.rsplit('@line', 1)[0]!r}"
        return rec


def input_lines(path: Path, process_index: int, process_count: int) -> Iterator[InputLine]:
    """The non-blank lines whose 0-based number is congruent to `process_index`."""
    seen: set[RecordId] = set()
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if (number - 1) % process_count != process_index or not raw.strip():
                continue
            try:
                key = record_id(json.loads(raw.decode("utf-8")), number)[0]
            except (ValueError, RecursionError):  # not UTF-8, not JSON: known by its number
                key = number
            duplicate = key in seen
            if duplicate:
                key = f"{key}@line{number}"
            seen.add(key)
            yield InputLine(number, key, raw, duplicate)
