"""The store host: load saved compressed stores into shared memory once per node and keep them there.

Every training process of the node then ``CompressedRows.attach(name)``-es them (no copy; a client's writes stay
private to it), so N processes use the store's host bytes once instead of N times. The host owns the segments: it
is the only process that writes the shared bytes, and it keeps every store until it stops; on SIGTERM/SIGINT (or
``stop``) it marks every store STOPPED (attached readers get ``StaleStoreError`` saying the store host stopped, on
their next fetch) and removes it. Clients never remove a segment, so a client that dies leaves the stores as
they were; a host that dies without stopping (kill -9, an OOM kill) leaves them until the next
``share``/``attach``/``serve`` on the machine or ``python -m ibpcache task=gc`` sweeps them away.

Run it with ``python -m ibpcache.cache.service --store feats=/path/feats.ibp [--store ...]`` or from Python
with :func:`serve`; the Hydra job can call :func:`serve_config` with its ``serve`` node.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import _shm
from ..compressed import CompressedRows
from ..errors import InvalidArgumentError

__all__ = ["StoreHost", "serve", "serve_config", "main"]


class StoreHost:
    """Owns the published segments of a set of stores until :meth:`close`, which stops and removes them all."""

    def __init__(self, stores: Mapping[str, "str | os.PathLike[str]"], *, replace: bool = True) -> None:
        if not stores:
            raise InvalidArgumentError("serve: no stores given (expected name -> saved store file)")
        self.segments: dict[str, _shm.Segment] = {}
        self.info: dict[str, dict[str, Any]] = {}
        try:
            for name, path in stores.items():
                self._publish(str(name), Path(path), replace)
        except BaseException:
            self.close()
            raise

    def _publish(self, name: str, path: Path, replace: bool) -> None:
        t0 = time.perf_counter()
        rows = CompressedRows.load(path, pin=False)  # verifies the file's CRC32 and every size
        t_load = time.perf_counter() - t0
        seg = rows.share(name, replace=replace)
        self.segments[name] = seg
        self.info[name] = {"file": str(path), "segment": str(seg.path), "generation": seg.generation,
                           "n_rows": rows.n_rows, "row_bytes": rows.row_bytes, "ratio": round(rows.ratio, 4),
                           "shm_bytes": seg.nbytes, "load_s": round(t_load, 3),
                           "share_s": round(time.perf_counter() - t0 - t_load, 3)}
        del rows  # the private copy goes; only the shared segment remains

    def close(self) -> None:
        """Mark every segment this host published STOPPED and remove it (idempotent)."""
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()

    def __enter__(self) -> "StoreHost":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(stores: Mapping[str, "str | os.PathLike[str]"], *, ready_file: "str | os.PathLike[str] | None" = None,
          stop: "threading.Event | None" = None, replace: bool = True, log: Any = None) -> dict[str, dict]:
    """Publish ``stores`` (name -> file written by ``CompressedRows.save``) and block until stopped.

    Stops on SIGTERM/SIGINT (handlers are installed when called from the main thread) or when ``stop`` is
    set; then marks every segment STOPPED (attached readers are told the host stopped) and removes it.
    ``ready_file``: once all stores are published, a JSON description of them is written there (atomically), so a
    launcher can wait for it before starting clients. Returns that description.
    """
    stop = stop if stop is not None else threading.Event()
    log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda signum, frame: stop.set())
    try:
        with StoreHost(stores, replace=replace) as host:
            info = dict(host.info)
            if ready_file is not None:
                tmp = Path(f"{ready_file}.tmp")
                tmp.write_text(json.dumps({"pid": os.getpid(), "stores": info}, indent=1))
                os.replace(tmp, ready_file)
            for name, d in info.items():
                log(f"ibpcache serve: {name!r} generation {d['generation']} ({d['n_rows']} rows, "
                    f"{d['shm_bytes']} bytes at {d['segment']})")
            while not stop.wait(0.5):
                pass
            log("ibpcache serve: stopping, removing segments")
        log(f"ibpcache serve: stopped; removed {', '.join(repr(n) for n in info)}")
        return info
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_config(cfg: Any) -> dict[str, dict]:
    """Entry for the Hydra job: ``cfg`` has ``stores`` (name -> path) and optional ``ready_file``/``replace``."""
    get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
    stores = {str(k): str(v) for k, v in dict(get("stores") or {}).items()}
    return serve(stores, ready_file=get("ready_file", None), replace=bool(get("replace", True)))


def _parse_store(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--store expects NAME=PATH, got {text!r}")
    return name, path


def main(argv: "Sequence[str] | None" = None) -> int:
    """``python -m ibpcache.cache.service --store NAME=PATH [...] [--ready-file F] [--no-replace]``."""
    ap = argparse.ArgumentParser(prog="python -m ibpcache.cache.service", description=__doc__.split("\n")[0])
    ap.add_argument("--store", action="append", type=_parse_store, required=True, metavar="NAME=PATH",
                    help="publish the saved store file PATH as shared store NAME (repeatable)")
    ap.add_argument("--ready-file", default=None, help="write a JSON description here once all are published")
    ap.add_argument("--no-replace", action="store_true", help="fail if a store of that name already exists")
    args = ap.parse_args(argv)
    serve(dict(args.store), ready_file=args.ready_file, replace=not args.no_replace)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
