"""``tailcut jobs`` (run the arq worker for batch jobs) and ``tailcut jobs submit FILE`` (the producer).

``submit`` posts the file to ``POST /v1/jobs``, polls ``GET /v1/jobs/{id}`` behind a progress bar until
the job ends, then prints the answers (or the error). Ctrl-C deletes the job and exits with 130. It
uses the standard library's HTTP client: the producer needs nothing beyond tailcut's own install.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tailcut import logs
from tailcut.errors import ConfigError

DEFAULT_URL = "http://127.0.0.1:8000"
# Read by `submit` only: the bearer token for an API with TAILCUT_API_KEYS set.
API_KEY_ENV = "TAILCUT_API_KEY"
POLL_S = 0.5
HTTP_TIMEOUT_S = 30.0
TERMINAL = {"complete", "failed", "aborted"}

console = Console(stderr=True, highlight=False)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``jobs`` (and ``jobs submit``) on the ``tailcut`` sub-command parser."""
    jobs = sub.add_parser("jobs", help="run the batch-job worker (arq); `jobs submit FILE` submits a log")
    jobs.add_argument("--model", help="model folder or `smollm2` (TAILCUT_MODEL), for the tokenizer")
    jobs.add_argument("--redis-url", dest="redis_url")
    jobs.set_defaults(func=cmd_jobs)
    jobs_sub = jobs.add_subparsers(dest="jobs_command")
    submit = jobs_sub.add_parser("submit", help="analyse a log file through POST /v1/jobs, with a progress bar")
    submit.add_argument("file", help="log file to analyse (`-` reads standard input)")
    submit.add_argument(
        "--instruction",
        default="List the errors and warnings in these log lines and their likely causes.",
        help="what to look for in the log",
    )
    submit.add_argument("--url", default=DEFAULT_URL, help=f"tailcut API (default {DEFAULT_URL})")
    submit.add_argument("--chunk-lines", dest="chunk_lines", type=int, help="log lines per request")
    submit.add_argument("--max-tokens", dest="max_tokens", type=int, help="answer length per chunk")
    submit.add_argument("--reduce", action="store_true", help="combine the chunk answers into one at the end")
    submit.add_argument("--tenant")
    submit.add_argument("--json", dest="as_json", action="store_true", help="print the job as JSON")
    submit.set_defaults(func=cmd_submit)


def cmd_jobs(args: argparse.Namespace) -> None:
    from jobs.main import serve
    from jobs.settings import JobsSettings

    overrides = {name: getattr(args, name) for name in ("model", "redis_url") if getattr(args, name, None)}
    settings = JobsSettings(**overrides)
    logs.configure(settings.log_format)
    asyncio.run(serve(settings))


class ApiClient:
    def __init__(self, url: str, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = orjson.dumps(body) if body is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, headers=self._headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                answer: dict[str, Any] = orjson.loads(response.read())
                return answer
        except urllib.error.HTTPError as exc:
            raise ConfigError(f"{method} {path}: {error_message(exc.read(), exc.code)}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise ConfigError(f"the API at {self.url} does not answer ({exc}); is `tailcut up` running?") from exc


def error_message(raw: bytes, status: int) -> str:
    try:
        return f"{status} {orjson.loads(raw)['error']['message']}"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return f"{status} {raw[:200].decode(errors='replace')}"


def read_log(file: str) -> str:
    if file == "-":
        return sys.stdin.read()
    try:
        return Path(file).read_text(errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read {file}: {exc.strerror or exc}") from exc


def cmd_submit(args: argparse.Namespace) -> None:
    # Ctrl-C deletes the job; a process started in the background inherits SIGINT ignored, so the
    # handler is installed explicitly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    client = ApiClient(args.url, os.environ.get(API_KEY_ENV))
    body: dict[str, Any] = {"logs": read_log(args.file), "instruction": args.instruction, "reduce": args.reduce}
    for name in ("chunk_lines", "max_tokens", "tenant"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    job = client.call("POST", "/v1/jobs", body)
    job_id = job["id"]
    console.print(f"job {job_id}: {job['num_chunks']} chunks")
    try:
        view = follow(client, job_id)
    except KeyboardInterrupt:
        try:
            view = client.call("DELETE", f"/v1/jobs/{job_id}")
            if view["status"] in TERMINAL:
                console.print(f"\njob {job_id} {view['status']} (deleted on Ctrl-C)")
            else:
                console.print(f"\njob {job_id}: abort requested on Ctrl-C (still {view['status']})")
        except ConfigError as exc:
            console.print(f"\ncould not delete job {job_id}: {exc.message}")
        sys.exit(130)
    if args.as_json:
        sys.stdout.write(orjson.dumps(view, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_result(view)
    sys.exit(0 if view["status"] == "complete" else 1)


def follow(client: ApiClient, job_id: str) -> dict[str, Any]:
    """Poll the job behind a progress bar until it ends."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("queued", total=None)
        while True:
            view = client.call("GET", f"/v1/jobs/{job_id}")
            counts = view["progress"]
            description = view["status"] + (f" ({counts['failed']} failed)" if counts["failed"] else "")
            progress.update(
                task, description=description, completed=counts["done"] + counts["failed"], total=counts["total"]
            )
            if view["status"] in TERMINAL:
                return view
            time.sleep(POLL_S)


def print_result(view: dict[str, Any]) -> None:
    if view["status"] != "complete":
        error = view.get("error") or {}
        console.print(f"job {view['id']} {view['status']}: {error.get('message', '')}")
        return
    result = view["result"]
    out = Console(highlight=False, soft_wrap=True)
    for chunk in result["chunks"]:
        out.rule(f"lines {chunk['first_line']}-{chunk['last_line']}", style="dim")
        if chunk["error"]:
            out.print(f"[red]no answer:[/] {chunk['error']['message']}", markup=True)
        else:
            out.print(chunk["text"], markup=False)
    combined = result.get("combined")
    if combined:
        out.rule("combined", style="bold")
        if combined["error"]:
            out.print(f"[red]no combined answer:[/] {combined['error']['message']}", markup=True)
        else:
            out.print(combined["text"], markup=False)
    console.print(
        f"{result['num_chunks']} chunks, {result['num_failed']} failed, "
        f"{result['usage']['completion_tokens']} tokens generated"
    )
