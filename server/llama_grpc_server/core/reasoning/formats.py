"""How a model family marks its thinking, read off its chat template.

- `think` (Qwen 3 and 3.5, QwQ, DeepSeek R1 and its distills): `<think>` thinking `</think>`,
  then the answer. Qwen 3.5's and the R1 distills' templates open the section themselves at the
  end of the prompt (`<think>\\n`); Qwen 3's model writes `<think>` itself; with
  `enable_thinking: false` the Qwen templates write an empty, closed section (`<think>\\n\\n
  </think>\\n\\n`).
- `channel` (Gemma 4): `<|channel>thought\\n` thinking `<channel|>`; its template closes an empty
  channel at the end of the prompt unless `enable_thinking` is true.

Whether a request thinks is read off its prompt (`thinks`): the section is open at the end of
the prompt, or the model opens it itself (its prompt does not end with a closed section)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    opener: str
    closer: str
    label: str = ""  # written right after the opener, not thinking ("thought\n")

    def forced_end(self, message: str = "") -> str:
        """What a budget forces to end a section: an optional message, then the closer (and
        the blank line the template puts before an answer)."""
        if self.name == "channel":
            return f"{message}{self.closer}"
        lead = f"\n{message}" if message else ""
        return f"{lead}\n{self.closer}\n\n"

    def forced_empty(self) -> str:
        """A whole empty section (budget 0 for a model that opens its section itself)."""
        if self.name == "channel":
            return f"{self.opener}{self.label}{self.closer}"
        return f"{self.opener}\n\n{self.closer}\n\n"

    def opened_by_prompt(self, prompt: str) -> bool:
        """The prompt ends inside an open section (the template opened it)."""
        tail = prompt.rstrip()
        return tail.endswith(self.opener + self.label.rstrip()) or tail.endswith(self.opener)

    def thinks(self, prompt: str) -> bool:
        """A request with this prompt thinks: its section is open, or the model opens one (the
        prompt does not end with a closed section)."""
        return not prompt.rstrip().endswith(self.closer)


THINK = ReasoningFormat("think", "<think>", "</think>")
CHANNEL = ReasoningFormat("channel", "<|channel>", "<channel|>", label="thought\n")
FORMATS = (CHANNEL, THINK)


def reasoning_format_for(template: str) -> ReasoningFormat | None:
    """The template's thinking format, or None for a model that does not think."""
    for fmt in FORMATS:
        if fmt.opener in template and fmt.closer in template:
            return fmt
    return None


def reasoning_format_named(name: str) -> ReasoningFormat:
    for fmt in FORMATS:
        if fmt.name == name:
            return fmt
    raise KeyError(f"no reasoning format {name!r}")
