"""`run_batch`: a JSONL file of prompts through the engine into a durable JSONL of results.

Process `index` of `count` takes the input lines whose 0-based number is congruent to its
index, and writes its own results file (see `shard_path`), so several processes (or hosts)
split one input without coordinating. Rerunning the same command resumes: ids already in the
results file are skipped, so a killed job loses nothing and duplicates nothing.

Built for inputs of millions of lines. The input is read twice, lazily: a survey (which records
run now, which reruns are errors retried or changed records, and the page pool the largest of
them need) and the run. The engine is fed within its feed window (4 requests per resident
row), so a round costs time in that window, not in the input; a record's `priority`
orders it within the window. Finished requests leave only their result line and streaming
statistics (RunSummary). The job holds its output's lock throughout (output_lock.py), and on
SIGTERM or SIGINT it saves every completed result and stops (stop_signals.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from etjax import path_checks
from etjax.engine.engine import Engine, RequestHandle
from etjax.engine.feed import run_fed
from etjax.engine_build import build_engine, pool_pages, request_pages
from etjax.errors import ConfigError, JobError, JobInterrupted, RequestError
from etjax.jobs import openai_format, result_checks
from etjax.jobs.input_lines import input_lines
from etjax.jobs.output_lock import output_lock
from etjax.jobs.records import ParsedRecord
from etjax.jobs.results_file import ResultsFile
from etjax.jobs.run_summary import RunSummary
from etjax.jobs.stop_signals import StopSignals
from etjax.loaders.loaded_model import Model
from etjax.progress import Progress
from etjax.run_config import RunConfig
from etjax.runtime.options import DRAFT_COUNTS, SequenceOutput

log = logging.getLogger("etjax")

EngineFactory = Callable[[int], Engine]  # num_pages -> an engine


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
    make_engine: EngineFactory | None = None,
) -> dict:
    """Run the job (or resume it); returns the run's summary (also written beside the output
    as `<output>.summary.json`).

    On a rerun, records whose stored result is an error run again. A record whose stored
    result came from a different request (its fingerprint differs: the prompt or a setting
    changed) stops the job with ConfigError, unless `redo_changed`, which runs it again.
    `make_engine(num_pages)` builds the engine (default: `model` on the default device).
    Raises JobError when the output cannot be written or another process holds it, and
    JobInterrupted on SIGTERM or SIGINT, each after saving every completed result."""
    if not 0 <= process_index < process_count:
        raise ConfigError(
            f"process index {process_index} out of range for {process_count} processes"
        )
    path_checks.input_file(input_path)
    path_checks.output_file(output_path, input_path)
    output = shard_path(output_path, process_index, process_count)
    if make_engine is None:
        # The model's entropy calibration, if it was loaded with one, is an engine setting.
        options = dataclasses.replace(config.options, calibration=model.calibration)
        make_engine = lambda pages: build_engine(  # noqa: E731
            model.weights, model.config, model.tokenizer, options, pages
        )
    job = _Job(input_path, output, config, model, process_index, process_count)
    with output_lock(output), StopSignals() as job.stop:
        job.results = ResultsFile(output)
        try:
            survey = job.survey()
            if survey.changed and not redo_changed:
                raise ConfigError(
                    f"{output} holds a result for id {survey.first_changed} made from a "
                    f"different request: its prompt or settings changed ({len(survey.changed)} "
                    "such records). Write to a new --output, or pass --redo-changed to run "
                    "those records again"
                )
            job.results.forget(survey.retried | survey.changed)
            if survey.retried:
                log.warning(
                    "retrying %d records whose earlier result in %s was an error",
                    len(survey.retried),
                    output,
                )
            started = time.perf_counter()
            progress = None
            if show_progress:
                progress = Progress(survey.runnable, "records")
            try:
                stats = job.run(make_engine, survey.pool_pages(config), progress)
            finally:
                if progress:
                    progress.close()
            wall = time.perf_counter() - started
        finally:
            job.results.close()
    summary = stats.as_dict(output, survey.records, survey.pending, wall)
    summary["retried_errors"] = len(survey.retried)
    summary["redone_changed"] = len(survey.changed)
    _write_summary(Path(f"{output}.summary.json"), summary)
    return summary


@dataclass
class _Survey:
    records: int = 0  # this process's records
    pending: int = 0  # records that run now
    runnable: int = 0  # of those, the valid ones: the work the progress bar counts
    retried: set = field(default_factory=set)  # ids whose stored result is an error
    changed: set = field(default_factory=set)  # ids whose stored result is from another request
    first_changed: str = ""
    needs: list[int] = field(default_factory=list)  # heap: the largest page needs, resident_rows

    def pool_pages(self, config: RunConfig) -> int:
        """A pool that holds the largest requests at once, up to the resident limit."""
        return config.options.num_pages or pool_pages(self.needs, config.options)


@dataclass
class _Job:
    input_path: Path
    output: Path
    config: RunConfig
    model: Model
    process_index: int
    process_count: int
    results: ResultsFile | None = None
    stop: StopSignals | None = None

    def _lines(self):
        return input_lines(self.input_path, self.process_index, self.process_count)

    def survey(self) -> _Survey:
        results, options = self.results, self.config.options
        s = _Survey()
        for line in self._lines():
            self._check_stop(None)
            s.records += 1
            stored = results.fingerprints.get(line.id, "absent")
            if line.id in results.done and stored is None:
                continue  # written before fingerprints: nothing to compare with
            rec = line.parse(self.model, self.config)
            if line.id in results.done:
                if stored == rec.fingerprint:
                    continue
                s.changed.add(line.id)
                s.first_changed = s.first_changed or f"{line.id!r} (line {line.number})"
            elif line.id in results.errors:
                s.retried.add(line.id)
            s.pending += 1
            if rec.error is None:
                s.runnable += 1
                need = request_pages(len(rec.prompt_ids), rec.settings, options)
                if len(s.needs) < options.resident_rows:
                    heapq.heappush(s.needs, need)
                else:
                    heapq.heappushpop(s.needs, need)
        return s

    def run(self, make_engine: EngineFactory, pages: int, progress: Progress | None) -> RunSummary:
        results, stats = self.results, RunSummary()
        records = (
            line.parse(self.model, self.config)
            for line in self._lines()
            if line.id not in results.done
        )
        # Records before the first valid one are answered without an engine, so none is built
        # when every record left is invalid.
        first = next((rec for rec in records if self._submittable(rec, progress)), None)
        if first is None:
            results.sync()
            return stats
        engine = make_engine(pages)
        counted: dict[int, int] = {}  # tokens already shown by the progress line, per record

        def submit(rec: ParsedRecord) -> list[RequestHandle] | None:
            if not self._submittable(rec, progress):
                return None
            try:
                return _submit(engine, rec)
            except RequestError as e:
                rec.error = f"line {rec.line}: {e}"
                results.append(_error_record(rec))
                if progress:  # refused by the engine: part of the surveyed work
                    progress.update(requests=1)
                return None

        def show_tokens(in_flight: list[tuple[ParsedRecord, list[RequestHandle]]]) -> None:
            for rec, handles in in_flight:
                tokens = sum(len(h.output.token_ids) for h in handles)
                progress.update(tokens=tokens - counted.get(rec.line, 0))
                counted[rec.line] = tokens

        def finished(rec: ParsedRecord, handles: list[RequestHandle]) -> None:
            outs = [h.output for h in handles]
            record = self._result_record(rec, outs)
            where = result_checks.non_finite(record)
            if where is not None:  # a bug upstream; JSON has no NaN: the record says so
                rec.error = f"line {rec.line}: the result holds {where}, not a finite number"
                record = _error_record(rec)
            results.append(record)
            for out in outs:
                stats.add(out)
            counted.pop(rec.line, None)
            if progress:
                progress.update(requests=1)

        def checkpoint(in_flight: int) -> None:
            results.sync()
            self._check_stop(in_flight)

        run_fed(
            engine,
            itertools.chain([first], records),
            submit,
            on_done=finished,
            on_round=show_tokens if progress else None,
            after_round=checkpoint,
        )
        results.sync()
        return stats

    def _submittable(self, rec: ParsedRecord, progress: Progress | None) -> bool:
        # Whether `rec` can be submitted; an invalid one is answered with its error record.
        if rec.error is None:
            return True
        self.results.append(_error_record(rec))
        if progress:
            progress.reject()
        return False

    def _result_record(self, rec: ParsedRecord, outs: list[SequenceOutput]) -> dict:
        failed = result_checks.failure(outs)
        if failed is not None:  # the grammar engine failed: an error line, never a success
            failed = f"line {rec.line}: {failed}"
        if rec.openai_url is not None:
            if failed is not None:
                return openai_format.error_line(
                    rec.id, failed, rec.fingerprint, "generation_failed"
                )
            model = rec.openai_model or self.model.name
            tokenizer = self.model.tokenizer
            return openai_format.output_line(
                rec.id,
                rec.openai_url,
                model,
                outs,
                len(rec.prompt_ids),
                rec.fingerprint,
                (lambda t: tokenizer.decode([t])) if rec.openai_logprobs else None,
            )
        samples = [_sample(out, seed) for out, seed in zip(outs, rec.sample_seeds(), strict=True)]
        line = {"id": rec.id} | samples[0] | {"prompt_tokens": len(rec.prompt_ids)}
        if rec.n > 1:
            line["samples"] = samples
        return line | {"error": failed, "fingerprint": rec.fingerprint}

    def _check_stop(self, dropped: int | None) -> None:
        # After a round's results are synced (or while surveying): stop if a signal came.
        if self.stop is None or self.stop.received is None:
            return
        self.results.sync()
        lost = f"; the {dropped} requests in flight will run again" if dropped else ""
        raise JobInterrupted(
            f"stopped by {self.stop.name}: the {self.results.written} results in "
            f"{self.output} are complete and on disk{lost}. Rerun the same command to resume",
            self.stop.received,
        )


def _submit(engine: Engine, rec: ParsedRecord) -> list[RequestHandle]:
    # One request per sample, each with its own seed; all or none (a refusal cancels the rest).
    handles = []
    for seed in rec.sample_seeds():
        sampler = dataclasses.replace(rec.settings.sampler, seed=seed)
        settings = dataclasses.replace(rec.settings, sampler=sampler)
        try:
            handles.append(engine.submit(rec.prompt_ids, settings, rec.priority))
        except RequestError:
            for handle in handles:
                handle.cancel()
            raise
    return handles


def _sample(out: SequenceOutput, seed: int) -> dict:
    n = len(out.token_ids)
    return {
        "text": out.text,
        "finish_reason": out.finish_reason,
        "token_ids": out.token_ids,
        # Counts as integers (what drafting did: DRAFT_COUNTS).
        "metrics": out.metrics
        | {"mean_entropy": float(np.mean(out.entropy)) if n else 0.0}
        | {name: int(out.metrics[name]) for name in DRAFT_COUNTS if name in out.metrics},
        "seed": seed,
    } | {
        name: getattr(out, name)
        for name in ("top_logprobs", "prompt_logprobs", "error")
        if getattr(out, name) is not None
    }


def _error_record(rec: ParsedRecord) -> dict:
    if rec.openai_url is not None:
        return openai_format.error_line(rec.id, rec.error, rec.fingerprint)
    return {"id": rec.id, "error": rec.error, "fingerprint": rec.fingerprint}


def _write_summary(path: Path, summary: dict) -> None:
    temporary = path.with_name(path.name + ".writing")
    try:
        temporary.write_text(json.dumps(summary, indent=2) + "\n")
        temporary.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise JobError(
            f"cannot write the summary {path}: {e.strerror or e}; the results are complete"
        ) from e
