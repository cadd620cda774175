"""A small OpenAI-compatible model server for the local demo (a stand-in for vLLM).

It "loads" for `--load-seconds` before /health turns 200, like an engine reading weights, then
answers chat and text completions (streamed or not) with a deterministic echo. It is not a model;
it speaks the same protocol so the gateway and the `openai` client can be shown end to end.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_BODY = 1 << 20


class EchoModel:
    """Produces a deterministic reply from the last user message."""

    def __init__(self, name: str) -> None:
        self.name = name

    def reply_tokens(self, body: dict) -> list[str]:
        messages = body.get("messages") or []
        prompt = messages[-1].get("content", "") if messages else str(body.get("prompt", ""))
        words = str(prompt).split()[:16] or ["hello"]
        return ["You", " said:"] + [" " + w for w in words]


def _chunk(model: str, created: int, content: str | None, finish: str | None, chat: bool) -> bytes:
    if chat:
        delta = {"content": content} if content is not None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = {"id": "chatcmpl-demo", "object": "chat.completion.chunk", "created": created, "model": model}
    else:
        choice = {"index": 0, "text": content or "", "finish_reason": finish}
        obj = {"id": "cmpl-demo", "object": "text_completion", "created": created, "model": model}
    obj["choices"] = [choice]
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def make_handler(model: EchoModel, ready_at: float, token_delay: float,
                 root: str | None = None) -> type[BaseHTTPRequestHandler]:
    listed = {"id": model.name, "object": "model", "owned_by": "demo", **({"root": root} if root else {})}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet: the demo prints its own timeline
            return

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ready = time.monotonic() >= ready_at
                self._json(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/v1/models":
                # Like vLLM, `root` says where the weights were loaded from.
                self._json(200, {"object": "list", "data": [listed]})
            else:
                self._json(404, {"error": {"message": "not found", "type": "not_found"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                self._json(413, {"error": {"message": "body too large", "type": "invalid_request_error"}})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error"}})
                return
            chat = self.path == "/v1/chat/completions"
            if not chat and self.path != "/v1/completions":
                self._json(404, {"error": {"message": "not found", "type": "not_found"}})
                return
            tokens = model.reply_tokens(body)
            created = int(time.time())
            if body.get("stream"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for tok in tokens:
                    self._chunked(_chunk(model.name, created, tok, None, chat))
                    time.sleep(token_delay)
                self._chunked(_chunk(model.name, created, None, "stop", chat))
                self._chunked(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                return
            text = "".join(tokens)
            usage = {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": len(tokens) + 1}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                obj = {"id": "chatcmpl-demo", "object": "chat.completion", "created": created, "model": model.name}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "stop"}
                obj = {"id": "cmpl-demo", "object": "text_completion", "created": created, "model": model.name}
            obj.update(choices=[choice], usage=usage)
            self._json(200, obj)

        def _chunked(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def load_weights(model_dir: str) -> tuple[int, int]:
    """Read every file of a model directory the way an engine reads its weights: (files, bytes).
    A directory without config.json is not a model (an engine would refuse it too)."""
    root = Path(model_dir)
    if not (root / "config.json").is_file():
        raise SystemExit(f"demo backend: {model_dir} has no config.json: not a model directory")
    files = total = 0
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    total += len(chunk)
            files += 1
    return files, total


def serve(host: str, port: int, model_name: str, load_seconds: float, token_delay: float,
          root: str | None = None) -> ThreadingHTTPServer:
    """Start the server in a background thread and return it (call `.shutdown()` to stop)."""
    handler = make_handler(EchoModel(model_name), time.monotonic() + load_seconds, token_delay, root)
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--load-seconds", type=float, default=3.0, help="time before /health is ready")
    parser.add_argument("--token-delay", type=float, default=0.05, help="seconds between streamed tokens")
    parser.add_argument("--model-dir", default="", help="load (read) the weights from this directory first")
    args = parser.parse_args()
    if args.model_dir:
        files, total = load_weights(args.model_dir)
        print(f"demo backend: loaded {files} files ({total} bytes) from {args.model_dir}", file=sys.stderr, flush=True)
    server = serve(args.host, args.port, args.model, args.load_seconds, args.token_delay, args.model_dir or None)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()


if __name__ == "__main__":
    main()
