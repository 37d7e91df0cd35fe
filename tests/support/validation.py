"""A text request as the servicer validates it (text_request) and the limits it is checked against
(N_CTX, LIMITS, INFO). Shared by several test modules (until now in
tests/unit/rpc/test_validation.py)."""

from __future__ import annotations

from typing import Any

from llama_grpc.v1 import llm_service_pb2 as pb
from llama_grpc_server.config import SchedulerSettings
from llama_grpc_server.core.requests.request import GenerationRequest, SamplingParams
from llama_grpc_server.rpc.shared import checks
from llama_grpc_server.rpc.v1 import validation
from llama_grpc_server.testing import fake_model_info

N_CTX = 64


INFO = fake_model_info(n_ctx=N_CTX)


LIMITS = SchedulerSettings(
    default_max_tokens=16,
    max_stop_strings=2,
    max_stop_length=8,
    default_sampling=SamplingParams(temperature=0.7, top_k=20, seed=None),
)


def text_request(num_prompt: int = 3, **fields: Any) -> GenerationRequest:
    """Validate a GenerateRequest as the servicer does, with `num_prompt` prompt tokens."""
    message = pb.GenerateRequest(**{"prompt": "hi", **fields})
    checked = validation.parse_text_request(message, INFO, LIMITS)
    return checks.complete_request(checked, [10] * num_prompt, request_id="r1", deadline=None)
