"""Shared stores: share/attach across processes, permissions, generations, killed clients, the serve host."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

CLIENT = Path(__file__).with_name("shm_client.py")
ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _compressed(rows: torch.Tensor, layout: str = "inplace") -> Any:
    from ibpcache import Codec

    return Codec.fit(rows).compress(rows, layout=layout, pin=False)


def _run_clients(name: str, seeds: list[int], tmp_path: Path) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, str(CLIENT), name, "fetch", str(s), str(tmp_path / f"c{s}.npz")],
                              env=_env(), stderr=subprocess.PIPE) for s in seeds]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    return [dict(np.load(tmp_path / f"c{s}.npz")) for s in seeds]


def _check_exact(results: list[dict], rows: torch.Tensor) -> None:
    raw = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).numpy()
    for r in results:
        expect = raw[r["ids"]]
        assert np.array_equal(r["cache"].reshape(expect.shape), expect)
        assert np.array_equal(r["gather"].reshape(expect.shape), expect)


@pytest.mark.parametrize("n_clients,dataset,layout", [(2, "cora", "packed"), (4, "pubmed", "inplace")])
def test_clients_attach_and_fetch_bit_exact(real_rows: Any, store_name: str, tmp_path: Path, n_clients: int,
                                            dataset: str, layout: str) -> None:
    rows = real_rows(dataset)
    packed = _compressed(rows, layout)
    seg = packed.share(store_name)
    try:
        results = _run_clients(store_name, list(range(n_clients)), tmp_path)
        _check_exact(results, rows)
        assert {int(r["generation"]) for r in results} == {seg.generation}
        assert len({r["ids"].tobytes() for r in results}) == n_clients  # each client asked for other rows
    finally:
        seg.unlink()
        seg.close()


def test_segment_is_private_to_its_user(cora: Any, store_name: str) -> None:
    old = os.umask(0)  # even a permissive umask must not widen the mode
    try:
        seg = _compressed(cora.features).share(store_name)
    finally:
        os.umask(old)
    try:
        mode = stat.S_IMODE(os.stat(seg.path).st_mode)
        assert mode == 0o600, oct(mode)
        assert os.stat(seg.path).st_uid == os.getuid()
    finally:
        seg.unlink()
        seg.close()


def test_attach_is_zero_copy_and_read_only(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    try:
        att = CompressedRows.attach(store_name, verify=True)
        base = np.frombuffer(att.shared.mm, dtype=np.uint8, count=1).ctypes.data
        assert base <= att.data.data_ptr() < base + att.shared.nbytes  # the payload is the mapping itself
        assert base <= att.lengths.data_ptr() < base + att.shared.nbytes
        cache = FeatureCache(att, budget_bytes=0.1, device="cpu")
        assert cache.host.data.data_ptr() == att.data.data_ptr()  # the host store kept the mapping, no copy
        ids = torch.randint(0, rows.shape[0], (3000,), generator=torch.Generator().manual_seed(1))
        assert torch.equal(cache.fetch(ids).view(torch.uint8), rows[ids].view(torch.uint8))
        with pytest.raises(ValueError, match="read-only"):
            att.shared.sections["data"][0] = 1
        with pytest.raises(TypeError):
            att.shared.mm[0:1] = b"x"
    finally:
        seg.unlink()
        seg.close()


def test_raw_write_into_an_attached_store_faults_only_the_writer(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows

    packed = _compressed(cora.features)
    seg = packed.share(store_name)
    try:
        code = ("import sys, torch; from ibpcache import CompressedRows; "
                f"r = CompressedRows.attach({store_name!r}); r.data.fill_(0)")
        res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, timeout=120)
        assert res.returncode == -signal.SIGSEGV, res.stderr.decode()[-2000:]
        assert torch.equal(CompressedRows.attach(store_name).data, packed.data)
    finally:
        seg.unlink()
        seg.close()


def test_killed_client_leaves_the_store_usable(real_rows: Any, store_name: str, tmp_path: Path) -> None:
    rows = real_rows("cora")
    seg = _compressed(rows, "packed").share(store_name)
    ready = tmp_path / "ready"
    victim = subprocess.Popen([sys.executable, str(CLIENT), store_name, "loop", "7", str(ready)], env=_env())
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert victim.poll() is None and time.monotonic() < deadline, "looping client never attached"
            time.sleep(0.05)
        time.sleep(0.3)  # well inside its fetch loop
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(timeout=30) == -signal.SIGKILL
        assert seg.path.exists()
        seg.check()  # still the published generation
        _check_exact(_run_clients(store_name, [11, 12], tmp_path), rows)
    finally:
        if victim.poll() is None:
            victim.kill()
        seg.unlink()
        seg.close()


def test_recreated_store_gives_new_generation_or_clear_error(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache
    from ibpcache._shm import StaleStoreError

    rows = cora.features
    first = _compressed(rows).share(store_name)
    old = CompressedRows.attach(store_name)
    cache = FeatureCache(old, budget_bytes=0.05, device="cpu")
    ids = torch.arange(0, rows.shape[0], 7)
    assert torch.equal(cache.fetch(ids), rows[ids])
    changed = rows.clone()
    changed[:, 0] += 1.0
    second = _compressed(changed, "packed").share(store_name)
    try:
        assert second.generation == first.generation + 1
        with pytest.raises(StaleStoreError, match="replaced"):
            cache.fetch(ids)
        with pytest.raises(StaleStoreError):
            old.gather(ids, device="cpu")
        new = CompressedRows.attach(store_name)
        assert new.shared.generation == second.generation
        assert torch.equal(new.gather(ids, device="cpu"), changed[ids])
        with pytest.raises(FileExistsError):
            _compressed(rows).share(store_name, replace=False)
    finally:
        second.unlink()
        second.close()
        first.close()
    with pytest.raises(StaleStoreError):
        new.gather(ids, device="cpu")  # the host removed it
    with pytest.raises(FileNotFoundError, match="no shared store"):
        CompressedRows.attach(store_name)


def test_corrupt_or_foreign_segments_are_refused(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, _shm
    from ibpcache.errors import FormatError

    seg = _compressed(cora.features).share(store_name)
    try:
        with open(seg.path, "r+b") as f:  # flip one payload byte: only the full verify can see it
            off = seg.manifest["sections"]["data"][0]
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(FormatError, match="checksum"):
            CompressedRows.attach(store_name, verify=True)
        with open(seg.path, "r+b") as f:  # break the manifest: every attach refuses
            f.seek(100)
            f.write(b"}")
        with pytest.raises(FormatError, match="manifest"):
            CompressedRows.attach(store_name)
    finally:
        seg.unlink()
        seg.close()
    with pytest.raises(ValueError, match="name"):
        _shm.segment_path("../etc/passwd")


def test_serve_publishes_and_sigterm_removes_segments(cora: Any, store_name: str, tmp_path: Path) -> None:
    from ibpcache import CompressedRows, _shm

    rows = cora.features
    names = [store_name, store_name + "-b"]
    files = []
    for i, n in enumerate(names):
        f = tmp_path / f"{n}.ibp"
        _compressed(rows[i::2].contiguous(), "packed").save(f)
        files.append(f)
    ready = tmp_path / "ready.json"
    args = [a for n, f in zip(names, files) for a in ("--store", f"{n}={f}")]
    host = subprocess.Popen([sys.executable, "-m", "ibpcache.cache.service", *args, "--ready-file", str(ready)],
                            env=_env(), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert host.poll() is None, host.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == host.pid and set(info["stores"]) == set(names)
        for i, n in enumerate(names):
            att = CompressedRows.attach(n)
            assert torch.equal(att.decompress(), rows[i::2])
            assert stat.S_IMODE(os.stat(_shm.segment_path(n)).st_mode) == 0o600
        host.send_signal(signal.SIGTERM)
        assert host.wait(timeout=60) == 0, host.stderr.read().decode()[-2000:]
        for n in names:
            assert not _shm.segment_path(n).exists()
        with pytest.raises(_shm.StaleStoreError):
            att.gather(torch.tensor([0]), device="cpu")
    finally:
        if host.poll() is None:
            host.kill()
        for n in names:
            _shm.segment_path(n).unlink(missing_ok=True)


def test_serve_refuses_a_corrupt_file(cora: Any, store_name: str, tmp_path: Path) -> None:
    from ibpcache import _shm
    from ibpcache.cache.service import StoreHost
    from ibpcache.errors import FormatError

    f = tmp_path / "s.ibp"
    _compressed(cora.features).save(f)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="checksum"):
        StoreHost({store_name: f})
    assert not _shm.segment_path(store_name).exists()
    with pytest.raises(ValueError, match="no stores"):
        StoreHost({})


def test_attached_rows_feed_the_dgl_adapter(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache
    from ibpcache.loaders.dgl import attach, import_dgl

    try:
        dgl = import_dgl()
    except ImportError as exc:
        pytest.skip(f"dgl cannot be imported: {exc}")

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    try:
        g = dgl.graph((torch.tensor([0, 1]), torch.tensor([1, 2])), num_nodes=rows.shape[0])
        cache = FeatureCache(CompressedRows.attach(store_name), budget_bytes=0.05, device="cpu")
        attach(g, {"feat": cache}, device="cpu")
        ids = torch.tensor([5, 0, 2707, 5])
        assert torch.equal(g.ndata["feat"][ids], rows[ids])
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.gpu
def test_attached_store_is_registered_not_copied_on_cuda(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    try:
        att = CompressedRows.attach(store_name)
        ptr = att.data.data_ptr()
        cache = FeatureCache(att, budget_bytes=0.05, device="cuda")
        assert cache.host.data.data_ptr() == ptr  # registered in place, not pinned into a new buffer
        assert att.shared._registered
        ids = torch.randint(0, rows.shape[0], (4096,), generator=torch.Generator().manual_seed(3))
        got = cache.fetch(ids.cuda())
        assert torch.equal(got.cpu().view(torch.uint8), rows[ids].view(torch.uint8))
        assert torch.equal(att.gather(ids.cuda(), device="cuda").cpu(), rows[ids])
    finally:
        seg.unlink()
        seg.close()
