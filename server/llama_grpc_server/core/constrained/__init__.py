"""Constrained decoding: regex/choice and structural_tag constraints compiled to GBNF grammars."""
