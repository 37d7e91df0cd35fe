"""Per-tenant limits (placeholder until the fair-share scheduler lands)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_concurrent: int = 0
    max_queued: int = 0
    weight: float = 1.0
