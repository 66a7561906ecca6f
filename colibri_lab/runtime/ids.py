"""Token ids and batch entries as the library's C calls take them: the ``colibri_batch_entry``
layout as a numpy dtype, and token-id sequences checked and made contiguous int32 (shared by
the engine and the interventions module)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .errors import ColibriInvalidArgError, ColibriTokenRangeError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

#: colibri_batch_entry: token, seq, pos, logits flag, reserved
ENTRY_DTYPE = np.dtype([("token", "<i4"), ("seq", "<i4"), ("pos", "<i8"), ("logits", "<i4"),
                        ("reserved", "<i4")])


def as_ids(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous int32 array, checking only what int32 needs."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ColibriInvalidArgError(
            f"token ids must be a 1-D sequence, got an array of shape {arr.shape}"
        )
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype == object:
        try:
            vals = [int(x) for x in arr.tolist()]
        except (TypeError, ValueError) as e:
            raise ColibriInvalidArgError(f"token ids must be integers: {e}") from None
        lo, hi = min(vals), max(vals)
    elif arr.dtype.kind in "iu":
        lo, hi = int(arr.min()), int(arr.max())
    else:
        raise ColibriInvalidArgError(f"token ids must be integers, got dtype {arr.dtype}")
    if lo < INT32_MIN or hi > INT32_MAX:
        bad = lo if lo < INT32_MIN else hi
        raise ColibriTokenRangeError(f"token id {bad} does not fit in int32")
    return np.ascontiguousarray(arr, dtype=np.int32)
