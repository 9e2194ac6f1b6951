"""Several processes (hosts) on one batch job, with JAX's own multi-process runtime.

Each process joins the job with `jax.distributed.initialize` (a coordinator address, or JAX's
auto-detection on TPU VM pod slices and Slurm), runs its own engine on its own devices over
its shard of the input (etjax/jobs/batch.py), then waits for the others at a barrier of the
distributed runtime's key-value service; process 0 merges the part files into the output, in
input order. No device collective crosses processes: a shard's results never depend on
another's, and a dead or stuck process shows up as a barrier timeout that names it, instead of
a hang.
"""

from __future__ import annotations

import json
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from etjax.errors import EtjaxError


class ProcessGroupError(EtjaxError):
    """A process of a multi-process job failed to join, died or timed out."""


@dataclass(frozen=True)
class ProcessGroup:
    index: int
    count: int
    distributed: bool  # joined through jax.distributed (else independent processes)


def join(
    coordinator: str,
    count: int | None,
    index: int | None,
    timeout_s: int,
) -> ProcessGroup:
    """Join a multi-process job. `coordinator` is "HOST:PORT" (process 0 serves it) or "auto"
    (JAX detects the cluster: TPU pod slices, Slurm, ...)."""
    import jax

    auto = coordinator == "auto"
    try:
        jax.distributed.initialize(
            coordinator_address=None if auto else coordinator,
            num_processes=None if auto else count,
            process_id=None if auto else index,
            initialization_timeout=timeout_s,
            # A peer's death must surface as our barrier's clear timeout, before the runtime's
            # own heartbeat check aborts the survivors with a terser message.
            heartbeat_timeout_seconds=2 * timeout_s,
            shutdown_timeout_seconds=min(timeout_s, 30),
        )
    except Exception as e:  # the runtime raises several types for an unreachable coordinator
        raise ProcessGroupError(
            f"cannot join the job at coordinator {coordinator!r} as process {index} of "
            f"{count} within {timeout_s}s: {e}"
        ) from None
    return ProcessGroup(jax.process_index(), jax.process_count(), True)


def barrier(group: ProcessGroup, name: str, timeout_s: int) -> None:
    """Wait until every process of `group` reaches barrier `name`."""
    if not group.distributed or group.count == 1:
        return
    from jax._src import distributed  # the runtime's client: no public barrier without devices

    try:
        distributed.global_state.client.wait_at_barrier(name, timeout_in_ms=1000 * timeout_s)
    except Exception as e:
        raise ProcessGroupError(
            f"process {group.index} of {group.count}: not every process reached {name!r} "
            f"within {timeout_s}s; a process died or is stuck (its own log says why). "
            f"Rerun the same command on every process to resume. ({e})"
        ) from None


def merge_shards(input_path: Path, output: Path, parts: list[Path]) -> int:
    """Write the results of every part file into `output`, in input order (records whose id
    the input does not name go last); returns the number of results. Written to a temporary
    file and renamed, so `output` is either absent or complete. Holds the input's ids and
    three integers per result, never the results themselves: lines are copied by offset."""
    from etjax.jobs.records import record_id
    from etjax.jobs.results_file import result_key

    order: dict[str | int, int] = {}
    with open(input_path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    raw = json.loads(line.decode("utf-8"))
                except (ValueError, RecursionError):  # not JSON or not UTF-8: its line number
                    raw = None
                order.setdefault(record_id(raw, number)[0], number)

    def position(rid: str | int) -> int:
        # A duplicated id was renamed "ID@lineN" by the job: its own line is its position.
        if isinstance(rid, str) and "@line" in rid and rid.rsplit("@line", 1)[1].isdigit():
            return int(rid.rsplit("@line", 1)[1])
        return order.get(rid, len(order) + 1)

    positions, owners, offsets = array("q"), array("q"), array("q")
    for index, part in enumerate(parts):
        if not part.is_file():
            raise ProcessGroupError(f"{part}: missing; did every process finish its shard?")
        with open(part, "rb") as f:
            offset = 0
            for line in f:
                if line.strip():
                    positions.append(position(result_key(json.loads(line))))
                    owners.append(index)
                    offsets.append(offset)
                offset += len(line)
    # By input position; equal positions keep the parts' order and each part's own order.
    ranked = np.lexsort((np.asarray(offsets), np.asarray(owners), np.asarray(positions)))
    temporary = output.with_name(output.name + ".merging")
    sources = [open(part, "rb") for part in parts]  # noqa: SIM115 - closed below
    try:
        with open(temporary, "wb") as target:
            for i in ranked:
                source = sources[owners[i]]
                source.seek(offsets[i])
                line = source.readline()
                target.write(line if line.endswith(b"\n") else line + b"\n")
            target.flush()
            os.fsync(target.fileno())
    finally:
        for source in sources:
            source.close()
    temporary.replace(output)
    return len(ranked)
