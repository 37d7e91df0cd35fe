"""Running grpcurl against a real server (the e2e tests that check the API from outside Python).
Shared by several test modules (until now in tests/e2e/test_operations.py)."""

from __future__ import annotations

import asyncio


async def grpcurl_run(grpcurl: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        grpcurl, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return out.decode()
