"""The CLI's entry: `python -m app <command>` (also `argus <command>`), CONTRACT.md §3.

`build_parser` makes one subcommand per entry of `app.commands.COMMANDS`; `configure` builds and
validates the command's typed configs (exit 2 with one line when one is bad) and `run` hands them to
its handler. A failed run exits 1 with its cause. Stage modules (and their configs) are imported
only when a command runs, so `--help` answers without importing Ray or torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import warnings

from app import options
from app.commands import COMMANDS
from app.config import Settings, build_settings, from_namespace
from app.errors import ConfigError
from app.net import check_reachable

log = logging.getLogger("argus")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One clear line and exit 2, as CONTRACT.md §3 promises (argparse's default adds usage).
        self.exit(2, f"argus: error: {message} (see `argus {self.prog.split()[-1]} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="argus", description="Argus: train vision models on behaviour images from Kafka, with Ray."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="<command>", parser_class=_Parser)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.help, description=command.help)
        if command.add_options:
            command.add_options(sub)
        options.add_common(sub)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("kafka", "urllib3", "alembic", "mlflow.store", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # Argus's own lines on the console; Ray's logs, its workers' output and its progress in files
    # (their folder is printed once) unless -v. Progress bars only on a terminal.
    from app.cluster import ray_logs_to_files

    ray_logs_to_files(not verbose)
    if not verbose:
        # Ray Data gives torch read-only arrays it never writes to and silences this with
        # catch_warnings, which its prefetch threads race: the warning slips through.
        warnings.filterwarnings(
            "ignore", "The given NumPy array is not writable", UserWarning, r"ray\.data\.util\.torch_utils"
        )
    if not sys.stderr.isatty():
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # Ray colours its prefixes even in a pipe


def configure(args: argparse.Namespace) -> tuple[Settings, list]:
    """The settings (environment, then flags) and the command's typed configs (flags over their
    defaults), each validated as it is built: a bad value stops here with a ConfigError."""
    settings, configs = build_settings(args), []
    for path in COMMANDS[args.command].configs:
        module, name = path.split(":")
        configs.append(from_namespace(getattr(importlib.import_module(module), name), args))
    return settings, configs


def run(args: argparse.Namespace) -> int:
    command = COMMANDS[args.command]
    settings, configs = configure(args)
    if settings.bootstrap_servers and command.needs_kafka:
        check_reachable(settings.bootstrap_servers)
        settings.kafka_connection().check_tls()
    return command.handler(settings, args, *configs)


def _registry_refusal(exc: Exception) -> str | None:
    """An MLflow tracking server refusing this client (HTTP 401 or 403) as one line naming what to
    set; None for any other failure."""
    exceptions = sys.modules.get("mlflow.exceptions")  # not imported: not MLflow's error
    if exceptions is None or not isinstance(exc, exceptions.MlflowException):
        return None
    status = exc.get_http_status_code()
    if status not in (401, 403):
        return None
    import mlflow

    return (
        f"the MLflow server at {mlflow.get_tracking_uri()} refused this client (HTTP {status}): set "
        "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to a user "
        "it knows with permission on the model"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(getattr(args, "verbose", False))
    try:
        return run(args)
    except ConfigError as exc:
        print(f"argus: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("argus: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run: exit 1 with the cause, the traceback in the log
        if (refusal := _registry_refusal(exc)) is not None:
            print(f"argus: error: {refusal}", file=sys.stderr)
            return 2
        log.debug("failure", exc_info=True)
        print(f"argus: {args.command} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
