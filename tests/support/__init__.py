"""Helpers the test tiers share (unit, model, e2e) and bench/ reuses: import them from here,
never from another test module. The model generators and the test servers are in
llama_grpc_testkit (testkit/)."""
