"""Tick costs measured on the 2-core box (BOX: rows -> ms) for the speculative policy's tests.
Shared by several test modules (until now in tests/unit/core/test_speculative.py)."""

from __future__ import annotations

# Measured on the development box (spec_policy.PRIOR_SHAPE's source): ms per decode-only tick of
# N rows, logits for every row; an odd number of rows >= 3 costs more than one row more.
BOX = {
    1: 12.8, 2: 25.3, 3: 42.1, 4: 33.2, 5: 50.4, 6: 41.6, 7: 58.2, 8: 50.4, 9: 67.9,
    10: 60.1, 11: 76.2, 12: 68.3, 13: 85.1, 14: 76.2, 15: 94.5, 16: 82.8, 17: 102.2, 18: 93.0,
}  # fmt: skip
