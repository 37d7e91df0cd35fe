"""Scheduling: the queue, admission, the per-tick plan and its token budget (strategies), how
requests end, expire or are held back, tenants' shares."""
