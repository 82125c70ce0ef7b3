"""Transport failures the harness must name: a connection dropped without a response, and a
stream cut after a few chunks. A raw TCP socket plays the dying server, so the race that a
real kill leaves to chance (the kill landing between two requests, on a kept-alive
connection) is hit every time. The live-server version is in test_bench_server.py.
"""
import json
import socket
import threading
import types

import pytest

from qpn.benchmarks.client import ChatClient, ServerUnreachable, StreamCut
from qpn.benchmarks.suite import GREEDY, Bench

# The one-minute tier (pytest -m fast): nothing here boots an engine, builds a venv or downloads.
pytestmark = pytest.mark.fast


class DyingServer:
    """Accept connections; for each, read the request and send ``reply`` bytes, then close."""

    def __init__(self, reply: bytes):
        self.reply = reply
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    conn.recv(65536)
                    conn.sendall(self.reply)
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.sock.close()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture
def dropped():
    s = DyingServer(b"")  # closes without a byte of response
    yield s
    s.close()


def _chunk(text):
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                               "finish_reason": None}]}) + "\n\n"


@pytest.fixture
def cut_stream():
    body = (_chunk("Hello") + _chunk(" world")).encode()
    head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n"  # no terminating 0-chunk
    s = DyingServer(head + chunked)
    yield s
    s.close()


def test_metrics_scrape_on_a_dropped_connection_names_the_dead_server(dropped):
    args = types.SimpleNamespace(base_url=dropped.base_url, model="m", api_key=None, timeout=5,
                                 metrics_url=None)
    with pytest.raises(ServerUnreachable, match="stopped answering.*rerun"):
        Bench(args).scrape()


def test_model_listing_on_a_dropped_connection_names_the_dead_server(dropped):
    with pytest.raises(ServerUnreachable, match="server stopped answering"):
        ChatClient(dropped.base_url, "m", timeout_s=5).list_models()


def test_stream_cut_after_two_chunks_is_named(cut_stream):
    client = ChatClient(cut_stream.base_url, "m", timeout_s=5)
    with pytest.raises(StreamCut, match="server probably died") as info:
        client.stream_chat([{"role": "user", "content": "hi"}], GREEDY.with_(max_tokens=4))
    assert "rows finished before this one are kept" in str(info.value)
