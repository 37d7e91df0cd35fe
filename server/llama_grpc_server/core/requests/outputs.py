"""Outputs: what each sampled token means for its request. It owns the per-request text
assembly (UTF-8 safe, stop strings held back) and judges a token: end of generation, a stop
token, or a delta (with its logprobs) that may complete a stop string or reach a length limit.
A resumed request's tokens (GenerationRequest.resumed) are judged the same way when it opens,
emitting nothing (replay). Pure Python; the scheduler applies the verdict (finishing frees the
slot)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llama_grpc_server import errors
from llama_grpc_server.core.requests import context_fit
from llama_grpc_server.core.requests.request import (
    FinishReason,
    Request,
    StoppingParams,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from llama_grpc_server.core.requests.text import TextAssembler
from llama_grpc_server.core.scheduling.plan import SampledLogprob, SamplerSpec


@dataclass(frozen=True, slots=True)
class Verdict:
    """A judged token: the delta to emit (None for EOS / a stop token, which are not output)
    and why the request ends now, if it does."""

    delta: TokenDelta | None = None
    reason: FinishReason | None = None
    matched_stop: str = ""
    matched_token_id: int | None = None


RESUME_FIELD = "params.resume.token_ids"


@dataclass(frozen=True, slots=True)
class Replay:
    """What a resumed request's tokens did when replayed: the text they released (the caller
    has it) and, when they end the answer at the last one, why (with the stop string or token
    that ended it)."""

    text: str = ""
    reason: FinishReason | None = None
    matched_stop: str = ""
    matched_token_id: int | None = None


class _ShownSpecials(Sequence[bytes]):
    """The piece table with some special tokens' texts shown (OutputParams.shown_specials)."""

    __slots__ = ("_pieces", "_shown")

    def __init__(self, pieces: Sequence[bytes], shown: tuple[tuple[int, str], ...]) -> None:
        self._pieces = pieces
        self._shown = {token: text.encode("utf-8") for token, text in shown}

    def __len__(self) -> int:
        return len(self._pieces)

    def __getitem__(self, token: int) -> bytes:  # type: ignore[override]  # ints only
        shown = self._shown.get(token)
        return self._pieces[token] if shown is None else shown


class Outputs:
    def __init__(self, pieces: Sequence[bytes], eog_ids: frozenset[int], n_ctx: int) -> None:
        self._pieces = pieces
        self._eog_ids = eog_ids
        self._n_ctx = n_ctx
        self._texts: dict[str, TextAssembler] = {}

    def open(self, request: Request) -> SamplerSpec:
        """Start a request's text state; returns the sampler the runner opens for it."""
        spec = request.spec
        pieces = self._pieces
        if spec.output.shown_specials:
            pieces = _ShownSpecials(pieces, spec.output.shown_specials)
        self._texts[request.key] = TextAssembler(pieces, spec.stopping.stop)
        return SamplerSpec(
            request.key,
            spec.sampling,
            request.seed,
            spec.output,
            spec.constraint,
            min_tokens=spec.stopping.min_tokens,
            suppressed=self.suppressed_until_min_tokens(spec.stopping),
            reasoning=spec.reasoning,
            resumed=spec.resumed,
        )

    def is_open(self, key: str) -> bool:
        return key in self._texts

    def replay(self, request: Request) -> Replay:
        """Judge an opened resumed request's resumed tokens (already in request.tokens) in
        order, as if it had just generated them, emitting nothing: the text state (held-back
        text, a stop string the next tokens may complete across the seam, min_tokens) is then
        where the cut stream left it. An end of generation or a stop token ending the answer
        is taken out of request.tokens (they are not output). InvalidRequest naming the first
        token past the end when the answer ended before the last one (the caller sent tokens
        this request would never have generated)."""
        resumed = request.spec.resumed
        stopping = request.spec.stopping
        text = self._texts[request.key]
        parts: list[str] = []
        for i, token in enumerate(resumed):
            num_output = i + 1
            matched, matched_token_id = "", None
            reason: FinishReason | None = None
            if token in self._eog_ids and not stopping.ignore_eos:
                reason, matched_token_id = FinishReason.EOS, token
            elif token in stopping.stop_token_ids:
                reason, matched_token_id = FinishReason.STOP_TOKEN, token
            else:
                out, matched = text.push(token, find_stops=num_output > stopping.min_tokens)
                parts.append(out)
                num_tokens = request.num_prompt + num_output
                reason = (
                    FinishReason.STOP_SEQUENCE
                    if matched
                    else context_fit.length_reason(num_output, num_tokens, self._n_ctx, stopping)
                )
            if reason is None:
                continue
            if num_output < len(resumed):
                raise errors.InvalidRequest(
                    f"the answer ends at {RESUME_FIELD}[{i}] ({reason.value}): "
                    f"the {len(resumed) - num_output} tokens after it were never generated",
                    field=f"{RESUME_FIELD}[{num_output}]",
                )
            if matched_token_id is not None:
                request.tokens.pop()  # an end of generation or a stop token is not output
            return Replay("".join(parts), reason, matched, matched_token_id)
        return Replay("".join(parts))

    def close(self, key: str) -> bool:
        """Forget a request's text state (by its key); False if it had none (never opened or
        closed)."""
        return self._texts.pop(key, None) is not None

    def suppressed_until_min_tokens(self, stopping: StoppingParams) -> tuple[int, ...]:
        """The tokens a request with min_tokens may not sample before it has that many: its
        stop tokens, and end-of-generation unless it ignores EOS."""
        if stopping.min_tokens <= 0:
            return ()
        eog = frozenset() if stopping.ignore_eos else self._eog_ids
        return tuple(sorted(eog | stopping.stop_token_ids))

    def flush(self, key: str) -> str:
        """Text held back for a possible stop string that never completed."""
        text = self._texts.get(key)
        return text.flush() if text is not None else ""

    def judge(self, request: Request, token: int, logprob: SampledLogprob | None) -> Verdict:
        """Append an output token to the request (unless it ends generation) and judge it."""
        stopping = request.spec.stopping
        if token in self._eog_ids and not stopping.ignore_eos:
            return Verdict(reason=FinishReason.EOS, matched_token_id=token)
        if token in stopping.stop_token_ids:
            return Verdict(reason=FinishReason.STOP_TOKEN, matched_token_id=token)
        request.tokens.append(token)
        # stop strings are looked for once min_tokens are generated (in the text after them)
        text, matched = self._texts[request.key].push(
            token, find_stops=request.num_output > stopping.min_tokens
        )
        logprobs = () if logprob is None else (self._token_logprob(token, logprob),)
        index = request.num_output - 1
        delta = TokenDelta((token,), text, logprobs, request.num_cached_prompt, index=index)
        if matched:
            return Verdict(delta, FinishReason.STOP_SEQUENCE, matched_stop=matched)
        reason = context_fit.length_reason(
            request.num_output, len(request.tokens), self._n_ctx, stopping
        )
        return Verdict(delta, reason)

    def _piece(self, token: int) -> str:
        return self._pieces[token].decode("utf-8", errors="replace")

    def _token_logprob(self, token: int, sampled: SampledLogprob) -> TokenLogprob:
        top = tuple(TopLogprob(t, self._piece(t), lp) for t, lp in sampled.top)
        return TokenLogprob(token, self._piece(token), sampled.logprob, top)
