"""Speculative decoding: the n-gram drafter, when drafting pays, and the drafts and pad rows of a
pass."""
