"""Slot: one llama.cpp sequence id, the request it serves and the tokens whose KV it holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from llama_grpc_server.core.requests.request import Request, RequestState


@dataclass(slots=True)
class Slot:
    """A sequence of the unified KV cache. Idle slots keep their KV as prefix cache."""

    slot_id: int
    request: Request | None = None
    idle_cache: list[int] = field(default_factory=list)  # token ids whose KV it keeps when idle
    cache_scope: str = ""
    session_id: str = ""
    last_used_ns: int = 0
    persisted_tokens: int = 0  # of idle_cache already saved to the disk tier

    @property
    def is_idle(self) -> bool:
        return self.request is None

    @property
    def state(self) -> str:
        if self.request is None:
            return "idle"
        return "generating" if self.request.state is RequestState.GENERATING else "prefilling"

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV is computed in this sequence right now."""
        if self.request is not None:
            return self.request.num_computed
        return len(self.idle_cache)

    def kv_tokens(self) -> list[int]:
        """The tokens whose KV this sequence holds, in position order."""
        if self.request is not None:
            return self.request.tokens[: self.request.num_computed]
        return self.idle_cache
