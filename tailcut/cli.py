"""The ``tailcut`` command: ``api``, ``worker``, ``jobs``, ``up`` and ``models``."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from pathlib import Path

from pydantic import ValidationError

from tailcut import aio, jobs_cli, keys_cli, logs
from tailcut.errors import ConfigError, TailcutError
from tailcut.processes import exit_without_a_last_collection

# Sub-commands that other distributions (or tailcut's own extras) add: `bench = "bench.cli:add_parser"`.
COMMANDS_GROUP = "tailcut.commands"
# The extra that installs each optional sub-command, for the message when it is missing.
OPTIONAL_COMMANDS = {"bench": "bench", "chaos": "bench"}


def _overrides(args: argparse.Namespace, names: list[str]) -> dict[str, object]:
    """Command-line values that were given; they win over TAILCUT_* environment variables."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def cmd_api(args: argparse.Namespace) -> None:
    from api.supervisor import serve

    overrides = _overrides(args, ["host", "port", "model", "redis_url", "api_processes"])
    serve(overrides)


def cmd_worker(args: argparse.Namespace) -> None:
    from workers.main import serve
    from workers.settings import WorkerSettings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    settings = WorkerSettings(**_overrides(args, ["model", "redis_url"]))  # type: ignore[arg-type]
    logs.configure(settings.log_format)
    aio.run(serve(settings))


def cmd_up(args: argparse.Namespace) -> None:
    from tailcut.up import up

    sys.exit(up(model=args.model, port=args.port, redis_url=args.redis_url, num_workers=args.workers))


def cmd_models_tiny(args: argparse.Namespace) -> None:
    from tailcut.models import build_tiny

    out = build_tiny(Path(args.dir))
    print(f"tiny model written to {out}")


def cmd_models_prepare(args: argparse.Namespace) -> None:
    from rich.console import Console

    from tailcut.models import prepare_smollm2
    from tailcut.settings import CommonSettings

    console = Console(stderr=True)
    cache_dir = Path(args.cache_dir) if args.cache_dir else CommonSettings().cache_dir
    with console.status("preparing SmolLM2-135M-Instruct"):
        path = prepare_smollm2(cache_dir, progress=console.log)
    print(path)


def add_entry_point_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The sub-commands registered under the ``tailcut.commands`` entry point group (``bench``); one that
    is not installed (or whose extra's packages are missing) answers with how to install it."""
    found = {entry.name: entry for entry in importlib.metadata.entry_points(group=COMMANDS_GROUP)}
    for name in sorted(found.keys() | OPTIONAL_COMMANDS.keys()):
        try:
            if name not in found:
                raise ImportError(f"no `{name}` entry point in group {COMMANDS_GROUP}")
            found[name].load()(sub)
        except ImportError as exc:
            _add_missing_command(sub, name, str(exc))


def _add_missing_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, why: str) -> None:
    extra = OPTIONAL_COMMANDS.get(name, name)
    hint = f"`tailcut {name}` needs the `{extra}` extra: pip install -e '.[{extra}]' ({why})"

    def missing(_args: argparse.Namespace) -> None:
        raise ConfigError(hint)

    command = sub.add_parser(name, help=f"(not installed: pip install -e '.[{extra}]')", add_help=False)
    command.add_argument("rest", nargs=argparse.REMAINDER)
    command.set_defaults(func=missing)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tailcut", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    api = sub.add_parser("api", help="run the HTTP API (OpenAI-compatible)")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.add_argument("--model", help="model folder or `smollm2` (TAILCUT_MODEL)")
    api.add_argument("--redis-url", dest="redis_url")
    api.add_argument(
        "--processes", dest="api_processes", type=int, help="API processes sharing the port (TAILCUT_API_PROCESSES)"
    )
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run one worker (one engine)")
    worker.add_argument("--model", help="model folder or `smollm2` (TAILCUT_MODEL)")
    worker.add_argument("--redis-url", dest="redis_url")
    worker.set_defaults(func=cmd_worker)

    jobs_cli.add_parser(sub)
    keys_cli.add_parser(sub)
    add_entry_point_commands(sub)

    up = sub.add_parser("up", help="run the whole stack locally: Redis if needed, workers, API")
    up.add_argument("--model", help="model folder or `smollm2` (TAILCUT_MODEL)")
    up.add_argument("--port", type=int, help="the API's HTTP port (TAILCUT_PORT)")
    up.add_argument(
        "--redis-url", dest="redis_url", help="use this Redis (TAILCUT_REDIS_URL; default: local, or a private one)"
    )
    up.add_argument("--workers", type=int, default=1, help="worker processes (one engine each)")
    up.set_defaults(func=cmd_up)

    models = sub.add_parser("models", help="build or prepare models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    tiny = models_sub.add_parser("tiny", help="build the tiny random-weight test model into DIR")
    tiny.add_argument("dir")
    tiny.set_defaults(func=cmd_models_tiny)
    prepare = models_sub.add_parser("prepare", help="convert the embedded SmolLM2 model once")
    prepare.add_argument("--cache-dir", dest="cache_dir")
    prepare.set_defaults(func=cmd_models_prepare)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    exit_without_a_last_collection()
    try:
        args.func(args)
    except TailcutError as exc:
        print(f"tailcut: {exc.message}", file=sys.stderr)
        sys.exit(2)
    except ValidationError as exc:
        print(f"tailcut: invalid configuration:\n{exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
