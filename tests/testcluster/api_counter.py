"""Counting a process's requests to the API server: a forwarding HTTP proxy in front of it.

The process under test (the operator) is given a kubeconfig whose server is this proxy, on
plain HTTP on 127.0.0.1; the proxy forwards every request to the real API server over TLS
with the admin kubeconfig's credentials, streams the answer back (watches included), and
records each request's method and path. So the test sees every request the process makes,
kopf's own included, on the wire: nothing inside the process is patched or trusted.

    counter = ApiCounter(cluster.kubeconfig).start()
    op = operator_factory(kubeconfig=counter.kubeconfig(tmp_path)).start()
    ...
    counter.requests(lambda r: "/lazarusjobs/bad-1" in r.path)
"""
from __future__ import annotations

import http.client
import http.server
import json
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

# Headers about one hop's connection, never forwarded (RFC 9110, section 7.6.1).
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te",
               "trailer", "upgrade", "host", "content-length"}


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic() when it arrived
    method: str
    path: str  # with its query

    @property
    def watch(self) -> bool:
        return "watch=true" in self.path or "watch=1" in self.path


class ApiCounter:
    def __init__(self, admin_kubeconfig: Path):
        from testcluster.kube import api_client

        conf = api_client(str(admin_kubeconfig)).configuration
        upstream = urlsplit(conf.host)
        self._host, self._port = upstream.hostname, upstream.port or 443
        self._tls = ssl.create_default_context(cafile=conf.ssl_ca_cert)
        if conf.cert_file:
            self._tls.load_cert_chain(conf.cert_file, conf.key_file)
        self._log: list[Request] = []
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True

    def start(self) -> "ApiCounter":
        threading.Thread(target=self._server.serve_forever, name="api-counter",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, directory: Path) -> Path:
        """A kubeconfig that reaches the API server through this proxy (no credentials of
        its own: the proxy holds them)."""
        path = directory / "counted-kubeconfig.yaml"
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "counted",
            "clusters": [{"name": "counted", "cluster": {"server": self.url}}],
            "users": [{"name": "counted", "user": {}}],
            "contexts": [{"name": "counted", "context": {"cluster": "counted",
                                                         "user": "counted"}}]}))
        return path

    def requests(self, where: Callable[[Request], bool] = lambda r: True,
                 since: float = 0.0) -> list[Request]:
        with self._lock:
            return [r for r in self._log if r.at >= since and where(r)]

    def _handler(self):
        counter = self

        class Forward(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect

            def log_message(self, *args) -> None:  # quiet
                pass

            def _forward(self) -> None:
                with counter._lock:
                    counter._log.append(Request(time.monotonic(), self.command, self.path))
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPSConnection(counter._host, counter._port,
                                                       context=counter._tls, timeout=600)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in _HOP_BY_HOP}
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    self.send_response(answer.status, answer.reason)
                    for k, v in answer.getheaders():
                        if k.lower() not in _HOP_BY_HOP:
                            self.send_header(k, v)
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    # Chunk by chunk: a watch answers for minutes, one event at a time.
                    while chunk := answer.read1(65536):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (OSError, http.client.HTTPException):
                    self.close_connection = True
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _forward

        return Forward
