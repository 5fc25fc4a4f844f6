"""Registers, shared memory and spills of every kernel (``nvcc --resource-usage``), and, with ``--against REV``,
which kernels' PTX changed since a git revision. No GPU needed.

Why: a change to a templated kernel family (e.g. lookup.cu's codec kinds) must leave the kernels it did not mean to
change as they were; identical PTX bodies (labels and shared-memory symbol names aside) prove it, and the resource
table shows what the new kernels cost.

With ``--define NAME=VALUE`` (repeatable) the current sources compile with those macros (a compile-time variant,
e.g. lookup.cu's ``IBP_EXP_LOOKUP_UNROLL``): its registers and spills, and with ``--against`` which kernels it
changes. The table also gives each kernel's resident warps per SM at the block size of its ``__launch_bounds__``
(sm_90 limits: ``occupancy``).

``python scripts/kernel_resources.py [--source lookup.cu] [--arch sm_90] [--against HEAD~3] [--define X=1]``
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "ibpcache/kernels"


def unit_text(name: str, read) -> str:
    """The text NVRTC compiles for ``name`` (its ``// requires:`` sources first), files read through ``read``."""
    own = read(name)
    deps: list[str] = []
    for line in own.splitlines():
        if not line.startswith("//"):
            break
        if line.startswith("// requires:"):
            deps += line[len("// requires:"):].split()
    return "\n".join([read(d) for d in deps] + [own])


def compile_unit(text: str, arch: str, ptx: bool, defines: "tuple[str, ...]" = ()) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "unit.cu"
        src.write_text(text)
        out = Path(tmp) / ("unit.ptx" if ptx else "unit.cubin")
        cmd = ["nvcc", "-std=c++17", f"-arch={arch}", *(f"-D{d}" for d in defines), "-ptx" if ptx else "--cubin",
               "-o", str(out), str(src)]
        if not ptx:
            cmd.insert(1, "--resource-usage")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            sys.exit(res.stderr)
        return out.read_text() if ptx else res.stdout + res.stderr


def resources(log: str) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
            table[cur] = {}
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if m and cur:
            table[cur].update(stack=int(m.group(1)), spills=int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            table[cur]["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            table[cur]["smem"] = int(s.group(1)) if s else 0
    return table


# Per-SM limits of sm_90 (H100 / H200; CUDA occupancy calculator rules): registers are allocated per warp in units
# of 256, each block's shared memory gets 1 KB reserved on top and is rounded to 128 bytes.
SM90 = {"regs": 65536, "smem": 228 * 1024, "warps": 64, "blocks": 32, "reg_unit": 256, "smem_reserved": 1024,
        "smem_unit": 128}


def occupancy(regs: int, smem: int, threads: int, sm: "dict[str, int] | None" = None) -> dict[str, int]:
    """Resident warps per SM of a kernel (``regs`` per thread, ``smem`` static bytes per block, ``threads`` per block)
    and which limit binds: ``{"warps": W, "by_regs": Br, "by_smem": Bs, "by_warps": Bw}`` (the b* are blocks)."""
    sm = sm or SM90
    wpb = -(-threads // 32)
    per_warp = -(-max(regs, 1) * 32 // sm["reg_unit"]) * sm["reg_unit"]
    by_regs = (sm["regs"] // per_warp) // wpb
    block_smem = -(-(smem + sm["smem_reserved"]) // sm["smem_unit"]) * sm["smem_unit"]
    by_smem = sm["smem"] // block_smem
    by_warps = min(sm["warps"] // wpb, sm["blocks"])
    return {"warps": min(by_regs, by_smem, by_warps) * wpb, "by_regs": by_regs, "by_smem": by_smem,
            "by_warps": by_warps}


def block_sizes(ptx: str) -> dict[str, int]:
    """Entry -> its ``__launch_bounds__`` block size (``.maxntid``); entries without one are left out."""
    out = {}
    for m in re.finditer(r"\.entry (\w+)\(", ptx):
        head = ptx[m.start(): ptx.find("{", m.start())]
        n = re.search(r"\.maxntid (\d+), (\d+), (\d+)", head)
        if n:
            out[m.group(1)] = int(n.group(1)) * int(n.group(2)) * int(n.group(3))
    return out


def ptx_bodies(ptx: str) -> dict[str, list[str]]:
    """Entry -> its PTX lines, with labels and shared-array symbols normalised (they carry template names)."""
    out = {}
    for m in re.finditer(r"\.entry (\w+)\(", ptx):
        body = ptx[m.start(): ptx.find("\n}\n", m.start())]
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        body = re.sub(r"_ZZ\w+E\d+\w+?(\[|;|,)", r"SMEM\1", body)
        out[m.group(1)] = body.splitlines()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default="lookup.cu", help="a .cu file of ibpcache/kernels")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--against", help="git revision to compare the PTX of every kernel with")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="a macro the current sources compile with (repeatable)")
    args = p.parse_args()
    defines = tuple(args.define)
    now = unit_text(args.source, lambda n: (ROOT / KERNELS / n).read_text())
    table = resources(compile_unit(now, args.arch, ptx=False, defines=defines))
    now_ptx = compile_unit(now, args.arch, ptx=True, defines=defines)
    threads = block_sizes(now_ptx)
    for name in sorted(table):
        r = table[name]
        line = (f"{name:36s} regs {r.get('regs', 0):4d}  smem {r.get('smem', 0):6d}  stack {r.get('stack', 0):3d}  "
                f"spills {r.get('spills', 0):3d}")
        if name in threads:
            o = occupancy(r.get("regs", 0), r.get("smem", 0), threads[name])
            line += (f"  block {threads[name]:4d}  warps/SM {o['warps']:2d} (blocks by regs {o['by_regs']}, "
                     f"smem {o['by_smem']}, warps {o['by_warps']})")
        print(line)
    if args.against:
        def old(n: str) -> str:
            return subprocess.run(["git", "show", f"{args.against}:{KERNELS}/{n}"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout

        before = ptx_bodies(compile_unit(unit_text(args.source, old), args.arch, ptx=True))
        after = ptx_bodies(now_ptx)
        for name in sorted(before):
            if name not in after:
                print(f"{name}: removed")
                continue
            diff = [d for d in difflib.unified_diff(before[name], after[name], lineterm="", n=0)
                    if d[:1] in "+-" and d[:3] not in ("+++", "---")]
            print(f"{name}: {'identical PTX' if not diff else f'{len(diff)} PTX lines differ'}")
            for d in diff[:6]:
                print("   ", d.strip())
        for name in sorted(set(after) - set(before)):
            print(f"{name}: new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
