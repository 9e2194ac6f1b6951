"""`run_batch`: a JSONL file of prompts through the engine into a durable JSONL of results.

Process `index` of `count` takes the input lines whose 0-based number is congruent to its
index, and writes its own results file (see `shard_path`), so several processes (or hosts)
split one input without coordinating. Rerunning the same command resumes: ids already in the
results file are skipped, so a killed job loses nothing and duplicates nothing.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from etjax import path_checks
from etjax.errors import ConfigError
from etjax.jobs.progress import Progress
from etjax.jobs.records import ParsedRecord, parse_record
from etjax.jobs.results_file import ResultsFile
from etjax.loaders.loaded_model import Model
from etjax.run_config import RunConfig
from etjax.runtime.generate import build_engine, workload_pages
from etjax.runtime.options import SequenceOutput


def shard_path(output: Path, index: int, count: int) -> Path:
    """The results file of process `index` of `count` (the output itself for one process)."""
    if count == 1:
        return output
    return output.with_name(f"{output.stem}.part{index:03d}-of-{count:03d}{output.suffix}")


def run_batch(
    input_path: Path,
    output_path: Path,
    config: RunConfig,
    model: Model,
    process_index: int = 0,
    process_count: int = 1,
    show_progress: bool = True,
    redo_changed: bool = False,
) -> dict:
    """Run the job (or resume it); returns the run's summary (also written beside the output
    as `<output>.summary.json`).

    On a rerun, records whose stored result is an error run again. A record whose stored
    result came from a different request (its fingerprint differs: the prompt or a setting
    changed) stops the job with ConfigError, unless `redo_changed`, which runs it again."""
    if not 0 <= process_index < process_count:
        raise ConfigError(
            f"process index {process_index} out of range for {process_count} processes"
        )
    path_checks.input_file(input_path)
    path_checks.output_file(output_path, input_path)
    output = shard_path(output_path, process_index, process_count)
    results = ResultsFile(output)
    records: list[ParsedRecord] = []
    seen: set[str] = set()
    # Bytes, decoded line by line: one line that is not UTF-8 becomes an error result
    # instead of stopping the job.
    with open(input_path, "rb") as f:
        for number, raw_line in enumerate(f):
            if number % process_count != process_index or not raw_line.strip():
                continue
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                rec = ParsedRecord(
                    number + 1,  # no id can be read: known by its line number
                    number + 1,
                    error=f"line {number + 1}: not UTF-8 (byte {raw_line[e.start]:#04x} at "
                    f"column {e.start + 1})",
                    fingerprint="line:" + hashlib.sha256(raw_line).hexdigest()[:16],
                )
            else:
                rec = parse_record(text, number + 1, model, config)
            if rec.id in seen:
                rec.error = f"line {rec.line}: duplicate id {rec.id!r}"
                rec.id = f"{rec.id}@line{rec.line}"
            seen.add(rec.id)
            records.append(rec)
    changed = [
        r
        for r in records
        if r.id in results.done and results.fingerprints.get(r.id) not in (None, r.fingerprint)
    ]
    if changed and not redo_changed:
        results.close()
        first = changed[0]
        raise ConfigError(
            f"{output} holds a result for id {first.id!r} (line {first.line}) made from a "
            f"different request: its prompt or settings changed ({len(changed)} such records). "
            "Write to a new --output, or pass --redo-changed to run those records again"
        )
    retried = {r.id for r in records if r.id in results.errors}
    results.forget(retried | {r.id for r in changed})
    if retried:
        print(
            f"retrying {len(retried)} records whose earlier result in {output} was an error",
            file=sys.stderr,
        )
    pending = [r for r in records if r.id not in results.done]
    progress = Progress(len(records), len(records) - len(pending)) if show_progress else None
    for rec in pending:
        if rec.error is not None:
            results.append({"id": rec.id, "error": rec.error, "fingerprint": rec.fingerprint})
            if progress:
                progress.update(requests=1)
    valid = [r for r in pending if r.error is None]
    started = time.perf_counter()
    outputs = _generate(valid, config, model, results, progress) if valid else []
    wall = time.perf_counter() - started
    if progress:
        progress.close()
    results.close()
    summary = _summary(outputs, wall, len(records), len(pending), output)
    summary["retried_errors"] = len(retried)
    summary["redone_changed"] = len(changed)
    Path(f"{output}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _generate(valid, config, model, results, progress) -> list[SequenceOutput]:
    options = config.options
    prompts = [r.prompt_ids for r in valid]
    settings = [r.settings for r in valid]
    pages = options.num_pages or workload_pages(prompts, settings, options)
    engine = build_engine(model.weights, model.config, model.tokenizer, options, pages)
    handles = [engine.submit(r.prompt_ids, r.settings, r.priority) for r in valid]
    written = [False] * len(valid)
    counted = [0] * len(valid)
    while True:
        busy = engine.step()
        for i, (rec, h) in enumerate(zip(valid, handles, strict=True)):
            if progress:
                n = len(h.output.token_ids)
                progress.update(tokens=n - counted[i])
                counted[i] = n
            if h.done and not written[i]:
                results.append(_result_record(rec, h.result()))
                written[i] = True
                if progress:
                    progress.update(requests=1)
        if not busy:
            break
    return [h.result() for h in handles]


def _result_record(rec: ParsedRecord, out: SequenceOutput) -> dict:
    n = len(out.token_ids)
    return {
        "id": rec.id,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "token_ids": out.token_ids,
        "prompt_tokens": len(rec.prompt_ids),
        "metrics": out.metrics | {"mean_entropy": float(np.mean(out.entropy)) if n else 0.0},
        "error": None,
        "fingerprint": rec.fingerprint,
    }


def _summary(outputs: list[SequenceOutput], wall: float, total: int, ran: int, path) -> dict:
    latencies = [o.metrics["end_to_end_latency"] for o in outputs]
    ttft = [o.metrics["time_to_first_token"] for o in outputs]
    tokens = sum(len(o.token_ids) for o in outputs)

    def pct(values, q):
        return float(np.percentile(values, q)) if values else 0.0

    return {
        "results_file": str(path),
        "records": total,
        "run_now": ran,
        "generated_tokens": tokens,
        "wall_seconds": wall,
        "throughput_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "latency_mean_s": float(np.mean(latencies)) if latencies else 0.0,
        "latency_p50_s": pct(latencies, 50),
        "latency_p99_s": pct(latencies, 99),
        "time_to_first_token_mean_s": float(np.mean(ttft)) if ttft else 0.0,
    }
