"""The trainer's numbers that must be finite, checked before the trainer is built.

Lightning takes a NaN or infinite ``gradient_clip_val`` as given: the first update is applied with NaN gradients and
the run stops a step later on a non-finite loss that does not name the field. The batch limits and the validation
interval are fractions or counts, which no NaN or infinity is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: The trainer's fields of a float value that must be finite, and what each expects.
FINITE_TRAINER_FIELDS = {
    "gradient_clip_val": "a finite number >= 0, or null (no clipping)",
    "val_check_interval": "a fraction of an epoch in (0, 1] or a count of batches",
    "limit_train_batches": "a fraction in [0, 1] or a count of batches",
    "limit_val_batches": "a fraction in [0, 1] or a count of batches",
    "limit_test_batches": "a fraction in [0, 1] or a count of batches",
    "limit_predict_batches": "a fraction in [0, 1] or a count of batches",
    "overfit_batches": "a fraction in [0, 1] or a count of batches",
}


def non_finite_trainer_field(trainer: Mapping[str, Any]) -> str | None:
    """The error line for the first field of :data:`FINITE_TRAINER_FIELDS` that the parsed ``trainer`` config gives a
    NaN, an infinity or (``gradient_clip_val``) a negative number; None when there is none."""
    for name, expected in FINITE_TRAINER_FIELDS.items():
        value = trainer.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if (isinstance(value, float) and not math.isfinite(value)) or (name == "gradient_clip_val" and value < 0):
            return f"trainer.{name}={value!r} is not {expected}"
    return None
