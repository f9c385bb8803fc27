"""``llmgate batch INPUT.jsonl OUTPUT.jsonl``: run a file of OpenAI requests as a batch job.

With ``--url`` it is a client of a running gateway's Files and Batches API
(the job then lives in that gateway's state directory, and survives this
command). Without, it starts ``llmgate serve`` itself on free ports, with a
state directory of its own; flags it does not know, and engine flags after
``--``, go to ``llmgate serve``. Either way it writes OUTPUT (one line per
request that got an answer, in input order) and, if any failed, their lines
to ``OUTPUT``'s name with ``.errors.jsonl``; then it stops what it started.

Exit status: 0 when every request was answered, 1 when some failed (see the
errors file), 2 when the job could not run. Plain ``urllib``: the gateway
image has no HTTP client library.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gateway import errors
from gateway.batch import jsonl
from gateway.state.lines import CACHE_METADATA_KEY
from shared import routes
from shared.ports import free_port, free_port_range

READY_TIMEOUT = 900.0
POLL_SECONDS = 1.0
FINAL = ("completed", "failed", "expired", "cancelled")


class Client:
    """The few calls of OpenAI's Files and Batches API this command needs."""

    def __init__(self, base_url: str, api_key: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _call(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> bytes:
        headers = dict(self.headers)
        if content_type:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(
            self.base_url + path, data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                data: bytes = response.read()
                return data
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise SystemExit(f"llmgate batch: {method} {path}: {exc.code} {detail}") from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self._call(method, path, data, "application/json" if data else ""))

    def upload(self, name: str, data: bytes) -> str:
        boundary = secrets.token_hex(16)
        parts = [
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n',
            f"--{boundary}\r\nContent-Disposition: form-data; "
            f'name="file"; filename="{name}"\r\n'
            "Content-Type: application/jsonl\r\n\r\n",
        ]
        body = "".join(parts).encode() + data + f"\r\n--{boundary}--\r\n".encode()
        content_type = f"multipart/form-data; boundary={boundary}"
        file_id: str = json.loads(self._call("POST", routes.FILES.path, body, content_type))["id"]
        return file_id

    def content(self, file_id: str) -> bytes:
        return self._call("GET", routes.FILE_CONTENT.url(file_id=file_id))


def run_job(client: Client, input_path: Path, output: Path, cache_results: bool) -> int:
    """Upload, create, wait, download; the exit status."""
    data = input_path.read_bytes()
    try:
        lines = jsonl.parse(data)
    except errors.BadRequest as exc:
        raise SystemExit(f"llmgate batch: {input_path}: {exc.message}") from None
    file_id = client.upload(input_path.name, data)
    metadata = {CACHE_METADATA_KEY: "true"} if cache_results else None
    body = {
        "input_file_id": file_id,
        "endpoint": lines[0].url,
        "completion_window": "24h",
        "metadata": metadata,
    }
    batch = client.json("POST", routes.BATCHES.path, body)
    print(f"batch {batch['id']}: {len(lines)} requests", file=sys.stderr)
    shown = -1
    while batch["status"] not in FINAL:
        time.sleep(POLL_SECONDS)
        batch = client.json("GET", routes.BATCH.url(batch_id=batch["id"]))
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        if done != shown:
            print(f"  {done}/{counts['total']} done ({counts['failed']} failed)", file=sys.stderr)
            shown = done
    if batch["status"] != "completed":
        print(f"batch {batch['id']} ended {batch['status']}", file=sys.stderr)
    errors_path = output.with_suffix(".errors.jsonl")
    if batch["output_file_id"]:
        output.write_bytes(client.content(batch["output_file_id"]))
    if batch["error_file_id"]:
        errors_path.write_bytes(client.content(batch["error_file_id"]))
        print(f"failed requests: {errors_path}", file=sys.stderr)
    else:
        errors_path.unlink(missing_ok=True)  # not from an earlier run
    counts = batch["request_counts"]
    print(f"{output}: {counts['completed']} of {counts['total']} answered", file=sys.stderr)
    if batch["status"] != "completed":
        return 2
    return 1 if counts["failed"] else 0


def serve_and_run(args: argparse.Namespace, serve_args: list[str]) -> int:
    """Start ``llmgate serve`` on free ports, run the job through it, stop it."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llmgate-batch-") as state:
        log_path = Path(state) / "serve.log"
        argv = [
            *(sys.executable, "-m", "serve", "--port", str(port)),
            # Room for as many workers as --num-workers may ask on one machine.
            *("--worker-base-port", str(free_port_range(16)), "--state-dir", state),
            *serve_args,
        ]
        with log_path.open("wb") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            base_url = f"http://127.0.0.1:{port}"
            print(f"starting llmgate serve (log: {log_path})", file=sys.stderr)
            _wait_ready(proc, base_url, log_path)
            return run_job(Client(base_url, ""), args.input, args.output, args.cache_results)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise SystemExit(f"llmgate batch: llmgate serve exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(base_url + routes.READY.path, timeout=2) as response:
                if json.loads(response.read())["ready"]:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not up yet
        time.sleep(0.5)
    raise SystemExit(f"llmgate batch: no worker ready after {READY_TIMEOUT:.0f}s (see {log_path})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmgate batch",
        description="Run a JSONL file of OpenAI requests (the Batch API's format) as a "
        "batch job. Flags this command does not know, and engine flags after --, go to "
        "`llmgate serve` (without --url).",
    )
    parser.add_argument("input", type=Path, help="JSONL input: one request per line")
    parser.add_argument("output", type=Path, help="JSONL output: one answer per line")
    parser.add_argument(
        "--url", default="", help="a running gateway (http://HOST:PORT); default: start one"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY", ""),
        help="with --url: the gateway's API key [env OPENAI_API_KEY]",
    )
    parser.add_argument(
        "--cache-results",
        action="store_true",
        help="write every answer into the gateway's response cache (precompute: "
        "the same request later is a cache hit); needs the gateway's --cache",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args_in = sys.argv[1:] if argv is None else argv
    engine: list[str] = []
    if "--" in args_in:
        split = args_in.index("--")
        args_in, engine = args_in[:split], args_in[split + 1 :]
    args, serve_args = build_parser().parse_known_args(args_in)
    if args.url:
        if serve_args or engine:
            raise SystemExit(f"llmgate batch: unknown flags with --url: {serve_args + engine}")
        sys.exit(
            run_job(Client(args.url, args.api_key), args.input, args.output, args.cache_results)
        )
    sys.exit(serve_and_run(args, [*serve_args, *engine]))


if __name__ == "__main__":
    main()
