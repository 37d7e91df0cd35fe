"""bench/embeddings_nomic.py's pieces that need neither the model nor llama-server: the peer's
command (same slots, a context per input, a ubatch that holds a whole input), the vectors of a
batch put back in input order from llama-server's answer, and the rate of one call."""

from __future__ import annotations

import http.server
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import embeddings_nomic


def test_llama_server_gets_the_same_slots_context_and_threads() -> None:
    cmd = embeddings_nomic.llama_server_cmd("/bin/llama-server", "/m.gguf", 8123, 2)
    assert cmd == [
        "/bin/llama-server", "-m", "/m.gguf", "--host", "127.0.0.1", "--port", "8123",
        "--embedding", "--pooling", "mean", "-c", "8192", "-np", "4", "-b", "2048", "-ub",
        "2048", "-t", "2", "-tb", "2", "--no-webui", "--fit", "off", "--log-disable",
    ]  # fmt: skip


class _Shuffled(http.server.BaseHTTPRequestHandler):
    """/v1/embeddings answering each input's first id as its vector, in reverse order."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        data = [{"index": i, "embedding": [float(ids[0])]} for i, ids in enumerate(body["input"])]
        reply = json.dumps({"data": data[::-1]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Shuffled)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def test_llama_server_vectors_come_back_in_input_order(port: int) -> None:
    embed = embeddings_nomic.server_embed(port)
    assert embed([[7, 1], [3], [9, 9]]) == [[7.0], [3.0], [9.0]]
    assert embeddings_nomic.timed(embed, [[1], [2]]) > 0


def test_a_call_that_loses_a_vector_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="1 vectors for 2 inputs"):
        embeddings_nomic.timed(lambda inputs: [[0.0]], [[1], [2]])


def test_cosine() -> None:
    assert embeddings_nomic.cosine([1.0, 0.0], [1.0, 0.0]) == 1.0
    assert embeddings_nomic.cosine([1.0, 0.0], [0.0, 2.0]) == 0.0
