"""What a request's result line must not hide: a failed output, a value JSON cannot hold.

`failure`: a sample the grammar engine failed on (finish reason "error", its `error` naming
the constraint and llguidance's reason) makes the whole line an error, in either format, so it
is never read as a success (and a rerun retries it). `non_finite`: JSON has no NaN or
infinity (`json.dumps` would write `NaN`, which strict parsers refuse); a line holding one is
written as an error naming where, not as invalid JSON.
"""

from __future__ import annotations

import math

from etjax.runtime.options import SequenceOutput


def failure(outs: list[SequenceOutput]) -> str | None:
    """The error of the first failed sample of a request ("sample j: " before it when there
    are several), or None."""
    for j, out in enumerate(outs):
        if out.error is not None:
            return out.error if len(outs) == 1 else f"sample {j}: {out.error}"
    return None


def non_finite(value: object, where: str = "") -> str | None:
    """Where in a result line (dicts, lists, tuples, numbers) the first NaN or infinity is,
    as `key[index].key=value`, or None."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where or 'value'}={value}"
    if isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
    elif isinstance(value, list | tuple):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for path, v in items if (found := non_finite(v, path))), None)
