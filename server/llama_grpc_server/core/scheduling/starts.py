"""Starts: a request's way from the queue into its first placement. A generation request's
outputs and sampler open before it is placed; a resumed one's tokens are replayed through its
outputs first (Outputs.replay, then its Resumed event), which may end it at once (its resumed
tokens end the answer, or run past its end). At its first placement it is counted as started and
its speculation chosen (a preempted request placed again is neither). Pure Python; the
Scheduler's admission step calls it on the engine thread."""

from __future__ import annotations

from collections.abc import Callable

from llama_grpc_server import errors
from llama_grpc_server.core.requests.outputs import Outputs
from llama_grpc_server.core.requests.request import Emitted, Request, Resumed
from llama_grpc_server.core.scheduling.endings import Endings
from llama_grpc_server.core.scheduling.plan import SamplerSpec
from llama_grpc_server.core.speculation.drafts import Drafts
from llama_grpc_server.core.stats import Counters


class Starts:
    def __init__(
        self,
        outputs: Outputs,
        endings: Endings,
        drafts: Drafts,
        counters: Counters,
        clock_ns: Callable[[], int],
    ) -> None:
        self.samplers_to_open: list[SamplerSpec] = []  # for the next plan
        self._outputs = outputs
        self._endings = endings
        self._drafts = drafts
        self._counters = counters
        self._clock_ns = clock_ns

    def open(self, request: Request) -> tuple[Emitted, bool]:
        """A generation request's outputs and sampler, before its first placement; a resumed
        one's tokens replayed (Outputs.replay, then its Resumed event). True when that ends it
        already, with no sampler opened and no token computed: its resumed tokens end the
        answer (finished at once), or run past its end (InvalidRequest)."""
        sampler = self._outputs.open(request)
        if not request.spec.resumed:
            self.samplers_to_open.append(sampler)
            return [], False
        try:
            replay = self._outputs.replay(request)
        except errors.ServiceError as exc:
            self._count(request)
            self._outputs.close(request.key)  # no sampler to close either
            return self._endings.end_failed(request, exc), True
        events: Emitted = [(request, Resumed(replay.text))]
        if replay.reason is None:
            self.samplers_to_open.append(sampler)
            return events, False
        self._count(request)
        # (the finish asks the runner to close a sampler it never opened: a no-op there)
        events += self._endings.finish(
            request,
            replay.reason,
            matched_stop=replay.matched_stop,
            matched_token_id=replay.matched_token_id,
        )
        return events, True

    def start(self, request: Request) -> None:
        """A request's first placement: its speculation (none for an embedding request: it
        samples nothing), its counts."""
        if not request.spec.is_embedding:
            self._drafts.admitted(request)
        self._count(request)

    def take_samplers(self) -> tuple[SamplerSpec, ...]:
        """The samplers opened since the last plan, for the next one."""
        samplers, self.samplers_to_open = tuple(self.samplers_to_open), []
        return samplers

    def _count(self, request: Request) -> None:
        request.admitted_ns = self._clock_ns()
        self._counters.started += 1
        self._counters.prompt_tokens += request.num_prompt
        self._counters.count_adapters(request.spec.adapters, requests=1)
