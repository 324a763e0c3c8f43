"""The Admin service (proto/slmrank/v1/ranker.proto): operations on a running server.

ReplaceCatalog swaps one of the artifact's catalogs for a catalog file under the server's
--catalog-dir (ServerConfig.catalog_dir), without a restart:

  1. checks the request (a known name, a file inside the directory) and that no other replacement
     runs (ABORTED otherwise: one at a time, so at most one new catalog is in host memory);
  2. parses the file and builds its trie off the event loop (catalog.read_catalog; requests are
     served meanwhile, the old catalog still answers them);
  3. Scheduler.replace_catalog: batches with constrained requests stop starting, those in flight
     finish, the runtime writes the new forest over the old one on the device (the same tensors:
     CUDA graphs keep their addresses, and no second copy is ever held there), and they start
     again with the new catalog; unconstrained batches go on throughout;
  4. ModelInfo lists the new version; each constrained BeamSearchResponse names the version its
     beams are items of (catalog_version).

Off (FAILED_PRECONDITION) without --catalog-dir: a client may then name no file of the server's.
Errors name the request field: INVALID_ARGUMENT (name, file: a path outside the directory, no
such file, a catalog file that does not parse, another code length), RESOURCE_EXHAUSTED (the new
catalog does not fit the room the runtime holds: serve --catalog-headroom), ABORTED (another
replacement is running), UNAVAILABLE (the model is not loaded yet).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from ..artifact.catalog import CatalogError, read_catalog
from ..sched.batcher import CatalogReplaceError, Scheduler
from .model_info import catalog_entries

log = logging.getLogger("slmrank.admin")

ADMIN = "slmrank.v1.Admin"
_CODES = {"name": grpc.StatusCode.INVALID_ARGUMENT, "file": grpc.StatusCode.INVALID_ARGUMENT,
          "room": grpc.StatusCode.RESOURCE_EXHAUSTED, "busy": grpc.StatusCode.ABORTED,
          "runtime": grpc.StatusCode.FAILED_PRECONDITION}


class AdminServicer:
    """server: the RankerServer (its config, model and servicer: what is loaded now)."""

    def __init__(self, server: Any, pb2: Any) -> None:
        self.server, self.pb2 = server, pb2
        self._replacing: str | None = None

    async def ReplaceCatalog(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        catalog_dir = self.server.config.catalog_dir
        if catalog_dir is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "catalog replacement is off: start the server with --catalog-dir DIR")
        scheduler, model = self.server.servicer.scheduler, self.server.model
        if scheduler is None or model is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is loading")
        names = [c.name for c in scheduler.catalogs]
        if request.name not in names:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"name: no catalog {request.name!r} here (the "
                                f"artifact has {', '.join(repr(n) for n in names) or 'none'})")
        path = await self._path(catalog_dir, request.file, context)
        if self._replacing is not None:
            await context.abort(grpc.StatusCode.ABORTED, f"catalog {self._replacing!r} is being replaced; one at a time")
        self._replacing = request.name
        try:
            t0 = time.monotonic()
            log.info("replacing catalog %s with %s: reading it", request.name, request.file)
            try:
                catalog = await asyncio.to_thread(read_catalog, request.name, path, model.artifact.config.vocab_size)
            except CatalogError as e:  # its message names the file by its path here: the caller's name instead
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "file: " + str(e).replace(str(path), request.file))
            t1 = time.monotonic()
            try:
                old = await scheduler.replace_catalog(catalog)
            except CatalogReplaceError as e:
                await context.abort(_CODES[e.reason], (f"{e.reason}: " if e.reason in ("name", "file") else "") + str(e))
            t2 = time.monotonic()
        finally:
            self._replacing = None
        entry = self.pb2.Catalog(name=catalog.name, num_items=catalog.num_items, code_length=catalog.code_length,
                                 version=catalog.version)
        if self.server.servicer.info is not None:  # a new message: a ModelInfo being written keeps the old one
            info = self.pb2.ModelInfoResponse()
            info.CopyFrom(self.server.servicer.info)
            del info.catalogs[:]
            info.catalogs.extend(catalog_entries(self.pb2, scheduler.catalogs))
            self.server.servicer.info = info
            if self.server.metrics is not None:
                self.server.metrics.set_model(info)
        log.info("catalog %s replaced: version %s (%d items) for %s; read in %.0f ms, constrained batches held "
                 "%.0f ms", catalog.name, catalog.version, catalog.num_items, old.version, (t1 - t0) * 1e3,
                 (t2 - t1) * 1e3)
        return self.pb2.ReplaceCatalogResponse(catalog=entry, previous_version=old.version, read_ms=(t1 - t0) * 1e3,
                                               pause_ms=(t2 - t1) * 1e3)

    @staticmethod
    async def _path(catalog_dir: str, file: str, context: grpc.aio.ServicerContext) -> Path:
        """The file under the directory (INVALID_ARGUMENT "file: ..." for anything else)."""
        if not file:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "file: required (a path under the server's "
                                "--catalog-dir)")
        root = Path(catalog_dir).resolve()
        path = (root / file).resolve()
        if Path(file).is_absolute() or not path.is_relative_to(root):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"file: {file!r} is not a path under the server's "
                                "--catalog-dir")
        if not path.is_file():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"file: no catalog file {file!r} in the server's "
                                "--catalog-dir")
        return path


class CatalogStartError(ValueError):
    """A current catalog file under --catalog-dir that cannot replace the artifact's at start-up."""


async def apply_current_catalogs(catalog_dir: str, scheduler: Scheduler, vocab_size: int) -> list[str]:
    """At start-up, before SERVING: each of the artifact's catalogs NAME with a file DIR/NAME.tsv
    under --catalog-dir is replaced by it (what a restarted server would otherwise lose: a
    replacement lives in memory). Returns the names replaced. CatalogStartError naming the file
    when one cannot be (it does not parse, another code length, no room): a server that would
    serve a catalog other than the one its operator put there does not start."""
    replaced = []
    for name in [c.name for c in scheduler.catalogs]:
        path = Path(catalog_dir) / f"{name}.tsv"
        if not path.is_file():
            continue
        log.info("catalog %s: replacing the artifact's with %s (--catalog-dir)", name, path)
        try:
            catalog = await asyncio.to_thread(read_catalog, name, path, vocab_size)
            old = await scheduler.replace_catalog(catalog)
        except (CatalogError, CatalogReplaceError) as e:
            raise CatalogStartError(f"--catalog-dir: {path}: {e}") from None
        log.info("catalog %s: version %s (%d items) serves instead of the artifact's %s", name, catalog.version,
                 catalog.num_items, old.version)
        replaced.append(name)
    return replaced

