"""Helpers the test tiers share (unit, model, e2e) and bench/ reuses: import them from here,
never from another test module. hanging_runner and crashing_strategy also run as top-level
modules in a server subprocess, with this directory on PYTHONPATH (fault_support.support_env)."""
