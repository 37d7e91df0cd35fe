"""The regex cases (a pattern and the body of its grammar's root rule) that the unit tests of the
regex-to-grammar compiler and the vLLM engine e2e tests both run. Shared by several test modules
(until now in tests/unit/core/test_regex_grammar.py)."""

from __future__ import annotations

# (pattern, the body of its root rule); e2e compiles each with llama.cpp too
REGEX_CASES = [
    ("abc", '"abc"'),
    ("^abc$", '"abc"'),
    (r"\d{3}-\d{4}", '[0-9]{3} "\\x2D" [0-9]{4}'),
    ("(cat|dog)s?", '("cat" | "dog") "s"?'),
    ("cat|dog", '"cat" | "dog"'),
    ("(?:ab)+", '("ab")+'),
    ("(?P<word>ab)*?", '("ab")*'),
    ("(?<word>a)", '("a")'),
    ("a|b|", '("a" | "b")?'),
    ("x(a|)", '"x" (("a")?)'),
    (".*", "[^\\x0A]*"),
    (r"[A-Za-z_][\w-]*", "[A-Za-z_] [a-zA-Z0-9_\\x2D]*"),
    (r"[^\]\\]", "[^\\x5D\\x5C]"),
    ("[]a]", "[\\x5Da]"),
    ("[a-]", "[a\\x2D]"),
    (r"\s+\S", "[ \\x09\\x0A\\x0D\\x0C\\x0B]+ [^ \\x09\\x0A\\x0D\\x0C\\x0B]"),
    (r"\D\W", "[^0-9] [^a-zA-Z0-9_]"),
    (r"\u00e9\x41\n\.", '"\\u00E9A\\x0A\\x2E"'),
    ("😀", '"\\U0001F600"'),
    ('say "hi"', '"say \\x22hi\\x22"'),
    ("a{2}b{1,}c{0,3}d{,2}", '"a"{2} "b"{1,} "c"{0,3} "d"{0,2}'),
    ("x{", '"x\\x7B"'),
    ("[0-9]{1,3}(\\.[0-9]{1,3}){3}", '[0-9]{1,3} ("\\x2E" [0-9]{1,3}){3}'),
]
