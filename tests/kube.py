"""A recording fake of the Kubernetes API for the ``kuberay`` backend's client calls (there is no API server here):
RayClusters (``ray.io/v1``) and Secrets in namespaces over real HTTP, spoken to by the real ``kubernetes`` client
through a kubeconfig. KubeRay's operator is stood in for by one rule: a RayCluster reports ``state: ready`` on its
``ready_after``-th read (never, with ``stuck``, where its head pod stays unschedulable)."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml

ROUTE = re.compile(r"^/(?:apis/ray\.io/v1|api/v1)/namespaces/(?P<ns>[^/]+)/(?P<kind>rayclusters|secrets)"
                   r"(?:/(?P<name>[^/]+))?$")  # fmt: skip
STUCK = {"state": "", "reason": "", "conditions": [{"type": "HeadPodReady", "status": "False",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu"}]}  # fmt: skip


class FakeKube:
    def __init__(self, ready_after: int = 3, stuck: bool = False):
        self.ready_after, self.stuck = ready_after, stuck
        self.objects: dict[tuple[str, str, str], dict] = {}  # (kind, namespace, name) -> object
        self.reads: dict[tuple[str, str, str], int] = {}
        self.calls: list[tuple[str, str]] = []  # (method, path) in order
        self.bodies: list[dict] = []  # what was created or replaced, in order
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }))  # fmt: skip
        return path

    def close(self) -> None:
        self.server.shutdown()

    def verbs(self, kind: str = "") -> list[str]:
        """The calls made, as ``METHOD kind[/name]`` (reads of a cluster being waited on collapsed)."""
        out = []
        for method, path in self.calls:
            m = ROUTE.match(urlparse(path).path)
            if m and (not kind or m["kind"] == kind):
                call = f"{method} {m['kind']}" + (f"/{m['name']}" if m["name"] else "")
                if not out or out[-1] != call or method != "GET":
                    out.append(call)
        return out

    def _answer(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        url = urlparse(path)
        m = ROUTE.match(url.path)
        if not m:
            return 404, _status(404, f"the fake has no route {url.path}")
        key = (m["kind"], m["ns"], m["name"])
        if method == "POST":
            key = (m["kind"], m["ns"], body["metadata"]["name"])
            if key in self.objects:
                return 409, _status(409, f'{m["kind"]} "{key[2]}" already exists', "AlreadyExists")
            obj = json.loads(json.dumps(body))
            obj["metadata"].update(namespace=m["ns"], uid=f"uid-{len(self.bodies)}")
            if m["kind"] == "rayclusters":
                obj["status"] = {}
            self.objects[key] = obj
            self.bodies.append(obj)
            return 201, obj
        if method == "GET" and m["name"] is None:
            wanted = dict(kv.split("=", 1) for kv in (parse_qs(url.query).get("labelSelector") or [""])[0].split(",")
                          if kv)  # fmt: skip
            items = [o for (k, ns, _), o in self.objects.items() if k == m["kind"] and ns == m["ns"]
                     and all((o["metadata"].get("labels") or {}).get(a) == b for a, b in wanted.items())]  # fmt: skip
            return 200, {"kind": "List", "apiVersion": "v1", "metadata": {}, "items": items}
        if key not in self.objects:
            return 404, _status(404, f'{m["kind"]} "{m["name"]}" not found', "NotFound")
        if method == "GET":
            obj = self.objects[key]
            if m["kind"] == "rayclusters":
                self.reads[key] = self.reads.get(key, 0) + 1
                if self.stuck:
                    obj["status"] = json.loads(json.dumps(STUCK))
                elif self.reads[key] >= self.ready_after:
                    obj["status"] = {"state": "ready", "conditions": [{"type": "RayClusterProvisioned",
                                                                       "status": "True"}]}  # fmt: skip
            return 200, obj
        if method == "PUT":
            self.objects[key] = body
            self.bodies.append(body)
            return 200, body
        if method == "DELETE":
            del self.objects[key]
            return 200, _status(200, "deleted", "", "Success")
        return 405, _status(405, f"the fake does not take {method}")

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _do(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.calls.append((self.command, self.path))
                code, answer = fake._answer(self.command, self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _do

            def log_message(self, *args) -> None:
                pass

        return Handler


def _status(code: int, message: str, reason: str = "", status: str = "Failure") -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": status, "message": message, "reason": reason, "code": code}
