"""Prefill/decode disaggregation through the store: a proxy in front of two vLLM OpenAI servers.

A prefill server computes the prompt and saves its pages to the store; a decode server, on
another GPU server of the same store, loads them and generates. This is vLLM's own pattern
(its disaggregated-prefill proxy examples), with kvstore's connector on both sides::

    # prefill machine (server a of store demo)
    python -m vllm.entrypoints.openai.api_server --model MODEL --port 8100 --kv-transfer-config \\
      '{"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
        "kv_role": "kv_producer", "kv_connector_extra_config": {"store": "demo"}}'
    # decode machine (server b of store demo)
    python -m vllm.entrypoints.openai.api_server --model MODEL --port 8200 --kv-transfer-config \\
      '{"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.engines.vllm",
        "kv_role": "kv_consumer", "kv_connector_extra_config": {"store": "demo"}}'
    python examples/pd_proxy.py --prefill http://PREFILL:8100 --decode http://DECODE:8200 --port 8000

Each ``POST /v1/completions`` is sent to the prefill server with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``; the prefill server's answer carries
``kv_transfer_params`` naming the pages it stored (the prompt's partial last page included),
and the proxy hands them to the decode server with the original request. The decode
server's connector waits (``pd_wait_s``, default 5 s) for announced pages its server has not
seen yet, loads the prompt up to the block holding its last token and computes that block.
The answer is the decode server's (its status too), with the two legs' seconds in the headers
``X-Prefill-Seconds`` and ``X-Decode-Seconds``; ``Authorization`` and ``X-Request-Id`` are
passed on to both servers. Non-streaming completions only; both servers must run the same
model with the same connector settings (``model_id``, ``page_tokens``, tenant).
"""

from __future__ import annotations

import argparse
import http.client
import json
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Upstream(Exception):
    """A server answered with an error: its status and body are passed on."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body


PASSED_HEADERS = ("Authorization", "X-Request-Id")


def post(url: str, body: dict[str, Any], timeout: float, headers: dict[str, str]) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url``; the JSON answer (``Upstream`` on an HTTP error)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise Upstream(e.code, e.read()) from None
    if not isinstance(out, dict):
        raise ValueError(f"{url} answered {type(out).__name__}, not a JSON object")
    return out


def handler(prefill: str, decode: str, timeout: float) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        def _answer(self, code: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._answer(200, {"status": "ok"})
            else:
                self._answer(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/completions":
                self._answer(404, {"error": f"this proxy serves POST /v1/completions, not {self.path}"})
                return
            try:
                length = int(self.headers.get("Content-Length", 0))
                if not 0 <= length <= 64 << 20:
                    raise ValueError(f"Content-Length {length} is not 0..64 MiB")
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise ValueError("the request body must be a JSON object")
                if body.get("stream"):
                    raise ValueError("this example proxies non-streaming completions only")
            except ValueError as e:
                self._answer(400, {"error": str(e)})
                return
            passed = {h: v for h in PASSED_HEADERS if (v := self.headers.get(h)) is not None}
            try:
                t0 = time.monotonic()
                first = post(prefill + "/v1/completions",
                             {**body, "max_tokens": 1, "min_tokens": 0,
                              "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}},
                             timeout, passed)
                t1 = time.monotonic()
                params = first.get("kv_transfer_params")  # None: the prefill stored nothing; decode computes
                out = post(decode + "/v1/completions", {**body, "kv_transfer_params": params}, timeout, passed)
                t2 = time.monotonic()
            except Upstream as e:  # the server's own answer (401, 400, ...), as it gave it
                self.send_response(e.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(e.body)))
                self.end_headers()
                self.wfile.write(e.body)
                return
            except (OSError, ValueError, http.client.HTTPException) as e:
                self._answer(502, {"error": f"{type(e).__name__}: {e}"})
                return
            self._answer(200, out, {"X-Prefill-Seconds": f"{t1 - t0:.4f}", "X-Decode-Seconds": f"{t2 - t1:.4f}"})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass  # quiet: one line per request is noise at any load

    return Proxy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", required=True, help="the prefill server's base URL (http://HOST:PORT)")
    ap.add_argument("--decode", required=True, help="the decode server's base URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per leg")
    a = ap.parse_args()
    server = ThreadingHTTPServer((a.host, a.port), handler(a.prefill.rstrip("/"), a.decode.rstrip("/"), a.timeout))
    print(f"P/D proxy on http://{a.host}:{a.port}: prefill {a.prefill}, decode {a.decode}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
