"""Shared stores: share/attach across processes, permissions, generations, killed clients, the serve host, and the
lifecycle: a segment goes with its owner (closed, dropped, normal exit, or swept after the owner died), never with a
client; a CUDA registration goes before its mapping."""

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


def test_attach_is_zero_copy(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    try:
        att = CompressedRows.attach(store_name, verify=True)
        assert att.shared.contains(att.data.data_ptr()) and att.shared.contains(att.lengths.data_ptr())
        assert not seg.contains(att.data.data_ptr()) and not att.shared.contains(rows.data_ptr())
        cache = FeatureCache(att, budget_bytes=0.1, device="cpu")
        assert cache.host.data.data_ptr() == att.data.data_ptr()  # the host store kept the mapping, no copy
        ids = torch.randint(0, rows.shape[0], (3000,), generator=torch.Generator().manual_seed(1))
        assert torch.equal(cache.fetch(ids).view(torch.uint8), rows[ids].view(torch.uint8))
        with pytest.raises(ValueError, match="read-only"):
            att.shared.sections["data"][0] = 1
    finally:
        seg.unlink()
        seg.close()


def test_write_into_an_attached_store_stays_in_the_writer(cora: Any, store_name: str, tmp_path: Path) -> None:
    """``rows.data[0] = 1`` (and fills of every attached tensor) in a client: no signal, the writer sees its own
    bytes, and the shared bytes that the owner and every other client see are unchanged."""
    from ibpcache import CompressedRows

    packed = _compressed(cora.features)
    seg = packed.share(store_name)
    out = tmp_path / "w.npz"
    try:
        res = subprocess.run([sys.executable, str(CLIENT), store_name, "write", "0", str(out)], env=_env(),
                             capture_output=True, timeout=120)
        assert res.returncode == 0, (res.returncode, res.stderr.decode()[-2000:])  # not killed by SIGSEGV
        own = np.load(out)
        assert bool(own["private"]) and own["data_head"][0] == 1 and (own["data_tail"] == 0xAB).all()
        assert (own["lengths"] == 5).all()
        other = CompressedRows.attach(store_name, verify=True)  # every section's CRC still holds
        for key in ("data", "lengths", "offsets", "flags"):
            assert torch.equal(getattr(other, key), getattr(packed, key)), key
            assert np.array_equal(seg.sections[key], getattr(packed, key).numpy()), key
        other.check_shared()
    finally:
        seg.unlink()
        seg.close()


def test_killed_client_leaves_the_store_usable(real_rows: Any, store_name: str, tmp_path: Path) -> None:
    from ibpcache import _shm

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
        assert seg.path.name in _shm.sweep().kept  # a sweep never touches a live owner's store
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
    with pytest.raises(StaleStoreError, match="stopped"):
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
        with pytest.raises(_shm.StaleStoreError, match=f"store host \\(pid {host.pid}\\) stopped"):
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


def _start_owner(name: str, tmp_path: Path, mode: str = "own") -> tuple[subprocess.Popen, Path]:
    """A process that shares Cora as ``name``; returns it and the segment path once it is published."""
    ready = tmp_path / f"ready-{name}"
    proc = subprocess.Popen([sys.executable, str(CLIENT), name, mode, "0", str(ready)], env=_env(),
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None:
            assert mode == "own-exit" and proc.returncode == 0, proc.stderr.read().decode()[-2000:]
            break
        assert time.monotonic() < deadline, "owner never published"
        time.sleep(0.05)
    return proc, Path(ready.read_text())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_dead_owners_segment_is_swept_by_the_next_process(cora: Any, store_name: str, tmp_path: Path,
                                                              sig: int) -> None:
    """kill -9 (or SIGTERM of a script with no handler) of the owner leaves the file; the next process that
    attaches finds /dev/shm clean of it and says why, and a reader attached before is told the owner died."""
    from ibpcache import CompressedRows, _shm

    owner, path = _start_owner(store_name, tmp_path)
    try:
        reader = CompressedRows.attach(store_name)
        assert reader.shared.published_by.pid == owner.pid
        owner.send_signal(sig)
        assert owner.wait(timeout=30) == -sig
        assert path.exists()  # nothing ran in the dead owner
        code = ("import sys; from ibpcache import CompressedRows\n"
                "try:\n    CompressedRows.attach(sys.argv[1])\nexcept FileNotFoundError as exc:\n"
                "    print(exc)\nelse:\n    sys.exit('attached a dead owner\\'s store')")
        res = subprocess.run([sys.executable, "-c", code, store_name], env=_env(), capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"pid {owner.pid}, which is gone" in res.stdout
        assert not path.exists() and not list(_shm.SHM_DIR.glob(path.name + "*"))
        with pytest.raises(_shm.StaleStoreError, match=f"the process that shared it \\(pid {owner.pid}\\) died"):
            reader.gather(torch.tensor([0, 5]), device="cpu")
        assert torch.equal(reader.data, _compressed(cora.features, "packed").data)  # its mapping still reads
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()


def test_owner_exit_or_dropped_handle_removes_the_segment(cora: Any, store_name: str, tmp_path: Path) -> None:
    import gc

    from ibpcache import CompressedRows, _shm

    owner, path = _start_owner(store_name, tmp_path, "own-exit")  # a normal exit without unlink()
    assert owner.wait(timeout=60) == 0
    assert not path.exists()
    handle = _compressed(cora.features).share(store_name)
    reader = CompressedRows.attach(store_name)
    del handle
    gc.collect()
    assert not _shm.segment_path(store_name).exists()
    with pytest.raises(_shm.StaleStoreError, match=f"pid {os.getpid()}\\) stopped or dropped it"):
        reader.check_shared()


def test_owner_identity_tells_a_recycled_pid_from_the_owner() -> None:
    from dataclasses import replace

    from ibpcache._shm import Owner

    me = Owner.current()
    assert me.pid == os.getpid() and me.alive() is True
    assert Owner.from_manifest(me.to_manifest()) == me
    if me.start is None:
        pytest.skip("no /proc here: liveness rests on the pid alone")
    assert replace(me, start=me.start + 1).alive() is False  # same pid, another process
    assert replace(me, boot="an-earlier-boot").alive() is False
    assert replace(me, pidns=me.pidns + 1).alive() is None  # another pid namespace: cannot tell
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert Owner(child.pid).alive() is False
    assert Owner.from_manifest({"pid": "1"}) is None and Owner.from_manifest(None) is None


def test_sweep_removes_a_dead_writers_half_written_file_and_keeps_foreign_ones(store_name: str) -> None:
    from ibpcache import _shm

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    tmp = _shm.SHM_DIR / f"ibpcache.{store_name}.{child.pid}.0a1b2c3d.tmp"  # its writer died before any header
    legacy = _shm.segment_path(store_name + "-legacy")  # no owner recorded: cannot be judged
    try:
        tmp.write_bytes(b"\0" * 100)
        legacy.write_bytes(b"\0" * 4096)
        assert tmp.name in _shm.sweep(dry_run=True).removed and tmp.exists()
        report = _shm.sweep()
        assert tmp.name in report.removed and not tmp.exists()
        assert legacy.name in report.kept and legacy.exists()
    finally:
        tmp.unlink(missing_ok=True)
        legacy.unlink(missing_ok=True)


def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


def test_cuda_registration_goes_before_its_mapping(cora: Any, store_name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The "resource already mapped" poisoning: a registered mapping must never be unmapped while registered.
    With the CUDA calls recorded (no GPU here): registered once however often asked, unregistered exactly once,
    while still mapped, when the last view goes; close() unregisters at once and the drop does not again."""
    import gc

    from ibpcache import CompressedRows
    from ibpcache.kernels import _build

    calls: list[tuple[str, int, bool]] = []
    monkeypatch.setattr(_build, "host_register_read_only", lambda ptr, n: calls.append(("register", ptr, _mapped(ptr))))
    monkeypatch.setattr(_build, "host_unregister", lambda ptr: calls.append(("unregister", ptr, _mapped(ptr))))
    seg = _compressed(cora.features).share(store_name)
    att = CompressedRows.attach(store_name)
    gpu = att.host_data_for_gpu()
    assert att.host_data_for_gpu() is gpu and att.shared.registered
    assert att.shared.contains(gpu.data_ptr()) and gpu.data_ptr() != att.data.data_ptr()  # the shared mapping
    assert torch.equal(gpu, att.data)
    base = calls[0][1]
    assert calls == [("register", base, True)]
    del att
    gc.collect()
    assert calls == [("register", base, True)]  # a view (gpu) still reads it: still registered and mapped
    del gpu
    gc.collect()
    assert calls == [("register", base, True), ("unregister", base, True)] and not _mapped(base)

    calls.clear()
    att = CompressedRows.attach(store_name)
    att.host_data_for_gpu()
    base = calls[0][1]
    att.shared.close()
    assert calls[-1] == ("unregister", base, True)
    del att
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"] and not _mapped(base)
    seg.close()


def test_a_failed_registration_leaves_nothing_registered(cora: Any, store_name: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from ibpcache import CompressedRows
    from ibpcache.kernels import _build

    unregistered: list[int] = []

    def refuse(ptr: int, n: int) -> None:
        raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")

    monkeypatch.setattr(_build, "host_register_read_only", refuse)
    monkeypatch.setattr(_build, "host_unregister", unregistered.append)
    seg = _compressed(cora.features).share(store_name)
    att = CompressedRows.attach(store_name)
    with pytest.raises(RuntimeError, match="AlreadyRegistered"):
        att.host_data_for_gpu()
    assert not att.shared.registered
    del att
    gc.collect()
    assert unregistered == []
    seg.close()


def test_release_closes_every_handle_of_this_process(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, _shm

    seg = _compressed(cora.features).share(store_name)
    att = CompressedRows.attach(store_name)
    assert _shm.release(store_name) == 2
    assert not seg.path.exists()
    with pytest.raises(_shm.StaleStoreError, match="closed"):
        att.check_shared()
    assert torch.equal(att.data[:8], _compressed(cora.features).data[:8])  # its views still read the bytes


@pytest.mark.gpu
def test_attached_store_is_registered_not_copied_on_cuda(cora: Any, store_name: str) -> None:
    from ibpcache import CompressedRows, FeatureCache

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    try:
        att = CompressedRows.attach(store_name)
        cache = FeatureCache(att, budget_bytes=0.05, device="cuda")
        ptr = cache.host.data.data_ptr()
        assert att.shared.contains(ptr) and ptr == att.host_data_for_gpu().data_ptr()  # in place, not a pinned copy
        assert att.shared.registered
        ids = torch.randint(0, rows.shape[0], (4096,), generator=torch.Generator().manual_seed(3))
        got = cache.fetch(ids.cuda())
        assert torch.equal(got.cpu().view(torch.uint8), rows[ids].view(torch.uint8))
        assert torch.equal(att.gather(ids.cuda(), device="cuda").cpu(), rows[ids])
        att.data[: att.data.numel() // 2].fill_(0)  # a private write: the GPU keeps reading the shared bytes
        assert torch.equal(cache.fetch(ids.cuda()).cpu().view(torch.uint8), rows[ids].view(torch.uint8))
    finally:
        seg.unlink()
        seg.close()


@pytest.mark.gpu
def test_dropped_attached_stores_do_not_poison_pinned_allocations(cora: Any, store_name: str) -> None:
    """Attach, read on the GPU, drop, then allocate pinned memory of the segment's size (the kernel tends to hand
    the freed range out again): with a registration left past munmap this fails with "resource already mapped"."""
    import gc

    from ibpcache import CompressedRows, FeatureCache
    from ibpcache.kernels._build import host_alloc, host_free

    rows = cora.features
    seg = _compressed(rows).share(store_name)
    ids = torch.randint(0, rows.shape[0], (2048,), generator=torch.Generator().manual_seed(4)).cuda()
    try:
        for _ in range(20):
            att = CompressedRows.attach(store_name)
            cache = FeatureCache(att, budget_bytes=0.02, device="cuda")
            assert torch.equal(cache.fetch(ids).cpu(), rows[ids.cpu()])
            torch.cuda.synchronize()
            nbytes = att.shared.nbytes
            del att, cache
            gc.collect()
            ptr = host_alloc(nbytes)  # cudaHostAlloc, as torch's pinned allocator does
            host_free(ptr)
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            del pinned
    finally:
        seg.unlink()
        seg.close()
