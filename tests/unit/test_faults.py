"""The fault-injection tools the chaos tests rely on actually inject faults (and heal)."""

from __future__ import annotations

import http.client
import http.server
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tests.faults import FaultProxy, listening_pids, paused


@pytest.fixture
def upstream():
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "5")
            self.end_headers()
            self.wfile.write(b"hello")

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def get(url: str, timeout: float = 3) -> bytes:
    return urllib.request.urlopen(url, timeout=timeout).read()


def test_the_proxy_forwards_faults_and_heals(upstream) -> None:
    with FaultProxy("127.0.0.1", upstream) as proxy:
        assert get(proxy.url) == b"hello"
        proxy.set("http502")
        with pytest.raises(urllib.error.HTTPError) as e:
            get(proxy.url)
        assert e.value.code == 502
        proxy.set("reset")
        with pytest.raises((ConnectionError, http.client.RemoteDisconnected, urllib.error.URLError)):
            get(proxy.url)
        proxy.set("blackhole")
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            get(proxy.url, timeout=0.5)
        proxy.inject("http502", 0.5)
        time.sleep(0.8)
        assert get(proxy.url) == b"hello"
        assert proxy.faulted() == 3  # 502, reset, blackhole (nothing asked during the injected 502s)


def test_paused_stops_a_process_and_lets_it_go_on(tmp_path) -> None:
    out = tmp_path / "ticks"
    code = f"import time\nwhile True:\n    open({str(out)!r}, 'a').write('x'); time.sleep(0.05)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        with paused(proc.pid, 1.0):
            time.sleep(0.2)
            frozen = out.stat().st_size
            time.sleep(0.5)
            assert out.stat().st_size == frozen, "no progress while stopped"
            time.sleep(0.8)  # the timer continues it after 1 s
            assert out.stat().st_size > frozen
    finally:
        proc.kill()


def test_listening_pids_finds_the_server_process(upstream) -> None:
    import os

    assert listening_pids(upstream) == [os.getpid()]
