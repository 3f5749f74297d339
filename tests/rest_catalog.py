"""An Iceberg REST catalog for the tests, on 127.0.0.1: the endpoints of the REST catalog spec that
PyIceberg's `RestCatalog` calls (config, namespaces, tables: create, list, load, exists, commit),
in front of a PyIceberg SQL catalog on SQLite, as Apache Iceberg's own REST test fixture
(`RESTCatalogServer`) puts the spec in front of a JDBC catalog. No REST catalog server can be
installed here (they ship as JVM images), and the client side, Argus's `RestCatalog`, is what is
under test: its commits travel as the spec's requirements and updates, and the server applies them
with the SQL catalog's compare-and-swap, answering 409 to a commit whose requirements no longer
hold, as the spec says.

    python tests/rest_catalog.py PORT SQLITE_URI WAREHOUSE      # serves until SIGTERM
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# At module level: FastAPI resolves the handlers' (postponed) annotations in these globals.
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse


def build_app(catalog_uri: str, warehouse: str):
    from pyiceberg.catalog.rest import CreateTableRequest, TableResponse
    from pyiceberg.catalog.sql import SqlCatalog
    from pyiceberg.exceptions import (
        CommitFailedException,
        NamespaceAlreadyExistsError,
        NoSuchNamespaceError,
        NoSuchTableError,
        TableAlreadyExistsError,
    )
    from pyiceberg.partitioning import UNPARTITIONED_PARTITION_SPEC
    from pyiceberg.table import CommitTableRequest
    from pyiceberg.table.sorting import UNSORTED_SORT_ORDER
    from starlette.concurrency import run_in_threadpool

    catalog = SqlCatalog("rest", uri=catalog_uri, warehouse=warehouse)
    app = FastAPI()
    answers = {
        NoSuchTableError: (404, "NoSuchTableException"),
        NoSuchNamespaceError: (404, "NoSuchNamespaceException"),
        TableAlreadyExistsError: (409, "AlreadyExistsException"),
        NamespaceAlreadyExistsError: (409, "AlreadyExistsException"),
        CommitFailedException: (409, "CommitFailedException"),
    }

    for error, (code, kind) in answers.items():

        def answer(_request, exc, code=code, kind=kind):
            return JSONResponse(
                {"error": {"message": str(exc), "type": kind, "code": code}}, status_code=code
            )

        app.add_exception_handler(error, answer)

    def model(value) -> Response:
        return Response(value.model_dump_json(by_alias=True), media_type="application/json")

    def loaded(table) -> Response:
        return model(
            TableResponse(metadata_location=table.metadata_location, metadata=table.metadata, config={})
        )

    @app.get("/v1/config")
    def config():
        return {"defaults": {}, "overrides": {}}

    @app.get("/v1/namespaces")
    def list_namespaces():
        return {"namespaces": [list(n) for n in catalog.list_namespaces()]}

    @app.post("/v1/namespaces")
    async def create_namespace(request: Request):
        body = await request.json()
        catalog.create_namespace(tuple(body["namespace"]), body.get("properties") or {})
        return {"namespace": body["namespace"], "properties": body.get("properties") or {}}

    @app.get("/v1/namespaces/{namespace}")
    def load_namespace(namespace: str):
        return {"namespace": [namespace], "properties": catalog.load_namespace_properties(namespace)}

    @app.head("/v1/namespaces/{namespace}")
    def namespace_exists(namespace: str):
        catalog.load_namespace_properties(namespace)
        return Response(status_code=204)

    @app.get("/v1/namespaces/{namespace}/tables")
    def list_tables(namespace: str):
        found = catalog.list_tables(namespace)
        return {"identifiers": [{"namespace": list(i[:-1]), "name": i[-1]} for i in found]}

    @app.post("/v1/namespaces/{namespace}/tables")
    async def create_table(namespace: str, request: Request):
        body = await request.json()  # the client leaves out what it does not set
        for optional in ("location", "partition-spec", "write-order"):
            body.setdefault(optional, None)
        asked = CreateTableRequest.model_validate(body)
        table = catalog.create_table(
            (namespace, asked.name),
            asked.table_schema,
            location=asked.location,
            partition_spec=asked.partition_spec or UNPARTITIONED_PARTITION_SPEC,
            sort_order=asked.write_order or UNSORTED_SORT_ORDER,
            properties=asked.properties,
        )
        return loaded(table)

    @app.get("/v1/namespaces/{namespace}/tables/{name}")
    def load_table(namespace: str, name: str):
        return loaded(catalog.load_table((namespace, name)))

    @app.head("/v1/namespaces/{namespace}/tables/{name}")
    def table_exists(namespace: str, name: str):
        catalog.load_table((namespace, name))
        return Response(status_code=204)

    @app.post("/v1/namespaces/{namespace}/tables/{name}")
    async def commit_table(namespace: str, name: str, request: Request):
        commit = CommitTableRequest.model_validate_json(await request.body())

        def apply():  # in a worker thread: commits race here as they do on a real server
            table = catalog.load_table((namespace, name))
            return catalog.commit_table(table, commit.requirements, commit.updates)

        return model(await run_in_threadpool(apply))

    return app


class RestCatalogServer:
    """`tests/rest_catalog.py` in a process group of its own on a free loopback port."""

    def __init__(self, process: subprocess.Popen, uri: str):
        self.process, self.uri = process, uri

    @classmethod
    def start(cls, folder: Path) -> RestCatalogServer:
        from app.net import accepts, free_port

        port = free_port()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "rest_catalog.log", "wb") as log:  # the child keeps its own handle
            process = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    str(port),
                    f"sqlite:///{folder / 'rest.db'}",
                    f"file://{folder / 'warehouse'}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while not accepts("127.0.0.1", port):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"the REST catalog did not start: {(folder / 'rest_catalog.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        return cls(process, f"http://127.0.0.1:{port}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


if __name__ == "__main__":
    import uvicorn

    port, catalog_uri, warehouse = sys.argv[1:]
    uvicorn.run(build_app(catalog_uri, warehouse), host="127.0.0.1", port=int(port), log_level="warning")
