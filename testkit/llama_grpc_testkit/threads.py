"""The llama.cpp thread count of the tests' engines and servers, in-process or as processes.

The tests run llama.cpp on one thread unless a test is about the thread count: the test process's
own event loop and gRPC threads (and, on a shared machine, everything else) compete with
llama.cpp's helpers, whose spin barriers then stall every forward pass (the embedded model's
64-token greedy decode on the loaded 2-core dev box: 7-10 s on one thread, 77-92 s on two)."""

from __future__ import annotations

TEST_THREADS = 1
