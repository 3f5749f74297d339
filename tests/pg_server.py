"""Debian's PostgreSQL on 127.0.0.1, a server of the test's own: the catalog that two Iceberg
writers in two processes share (as a production catalog database would be)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from app.net import free_port

from conftest import missing_dependency


def _binary(name: str) -> str:
    """PostgreSQL's own programs: Debian keeps them off PATH, under /usr/lib/postgresql/<major>/bin."""
    found = shutil.which(name) or next(
        iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None
    )
    if found is None:
        missing_dependency(f"PostgreSQL's {name} not found: apt-get install postgresql (.ci/run does)")
    return found


def _as_postgres() -> list[str]:
    """PostgreSQL refuses to run as root: there, run it as Debian's `postgres` user."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@dataclass
class PostgresServer:
    process: subprocess.Popen
    port: int
    directory: Path

    def new_database(self) -> str:
        """A database of its own (one test's catalog); the SQLAlchemy URI a SQL catalog takes."""
        import psycopg

        name = f"catalog_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(
            host="127.0.0.1", port=self.port, user="postgres", autocommit=True
        ) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    @classmethod
    def start(cls) -> PostgresServer:
        """initdb and start a throwaway cluster (trust on 127.0.0.1 only, no fsync: a test's data)."""
        # Not under pytest's tmp_path: its root is private to this user, and the server runs as postgres.
        directory = Path(tempfile.mkdtemp(prefix="argus-postgres-"))
        if os.geteuid() == 0:
            shutil.chown(directory, "postgres", "postgres")
        data = directory / "data"
        initdb = subprocess.run(
            [*_as_postgres(), _binary("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
             "-E", "UTF8", "--no-sync"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert initdb.returncode == 0, initdb.stdout[-2000:] + initdb.stderr[-2000:]
        port = free_port()
        process = subprocess.Popen(
            [*_as_postgres(), _binary("postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
             "-k", str(directory), "-F"],
            stdout=open(directory / "postgres.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        server = cls(process, port, directory)
        deadline = time.monotonic() + 60
        while not server.answers():
            assert process.poll() is None, (directory / "postgres.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (directory / "postgres.log").read_text()[-3000:]
            time.sleep(0.2)
        return server

    def answers(self) -> bool:
        import psycopg

        try:
            with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        """Fast shutdown (SIGINT to the server and its backends), then the folder goes."""
        try:
            os.killpg(self.process.pid, signal.SIGINT)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
