"""Carry shipped tuning entries across a kernel or search-space change that leaves what they measured unchanged.

An entry goes stale whenever its op's kernel source changes, even where the change cannot reach the entry's problem
(code under a compile-time constant it never sets, such as the GELU epilogue for a linear without activation). For
each entry of the shipped files that is stale for its kernel source, this compiles its (problem, config) for its
arch under the tilekit of OLD (the git commit whose kernels it was tuned for: its kernel hash must match OLD's) and
under this checkout, and gives it this checkout's kernel hash only where every launch compiles to the same cubin,
debug sections aside (they hold the source's line numbers, which any edit above a kernel shifts), so its measurement
is a measurement of the very code that runs now. Where only the digest changed (what it hashes, not the code), OLD's
code hashed by this checkout's digest equals this checkout's: such entries are carried whatever their cubins (a few
kernels, e.g. moe_down_combine, compile to different cubins each time). Likewise an entry stale for its search space
alone (or for both) is carried where the space admits exactly the same configs for its problem as OLD's did (a
change of the fp32 rule, say, leaves a bf16 problem's candidates alone): its tuner chose among the very configs it
would choose among now. The rest stays stale, for `tilekit tune --stale`.

    python scripts/carry_unchanged.py OLD_COMMIT
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run under one tree's tilekit: JSON tasks [op, problem, config, arch] on stdin -> JSON on stdout:
# each op's kernel and space hashes; per task the sha256 of every launch's device code or the compile error, and
# the configs the op's space admits for the problem. Device code: the cubin's sections (ELF64 section headers)
# without its debug sections, string tables, symbol table and host stub (.nv.host), the kernel's mangled name
# taken out of the section names: that name spells out every constant, so a constant added to a kernel changes
# it even where the problem leaves the code as it was.
COMPILE = r"""
import hashlib, io, json, struct, sys
import tilekit.kernels
from cuda.tile.compilation import export_kernel
from tilekit.autotune.compile import signature
from tilekit.autotune.registry import registered_ops
ops, tasks, out = registered_ops(), json.load(sys.stdin), []

def code_digest(elf):
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    size, count, names = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * size) for i in range(count)]
    table = headers[names][4]
    named = [(elf[table + h[0]:elf.index(b"\0", table + h[0])], h) for h in headers]
    kernels = [name[len(b".text."):] for name, _ in named if name.startswith(b".text.")]
    digest = hashlib.sha256()
    for name, (_, kind, _, _, offset, length, *_) in named:
        if b"debug" not in name and name not in (b".strtab", b".shstrtab", b".symtab", b".nv.host"):
            for kernel in kernels:
                name = name.replace(kernel, b"<kernel>")
            digest.update(name + b"\0" + (str(length).encode() if kind == 8 else elf[offset:offset + length]))
    return digest.hexdigest()

for name, problem, config, arch in tasks:
    try:
        digests = []
        for kernel, args in ops[name].compile_args(problem, config):
            buf = io.BytesIO()
            export_kernel(kernel, [signature(kernel, args)], buf, gpu_code=arch, output_format="cubin")
            digests.append(code_digest(buf.getvalue()))
        out.append(digests)
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
json.dump({"hashes": {n: op.kernel_hash() for n, op in ops.items()},
           "spaces": {n: op.space_hash() for n, op in ops.items()}, "cubins": out,
           "candidates": [ops[name].space.candidates(problem) for name, problem, _, _ in tasks]}, sys.stdout)
"""


def compile_under(tree: Path, tasks: list, cache: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "CUDA_TILE_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(tasks), env=env, cwd=tree,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"compiling under {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def main(old: str) -> int:
    import tilekit.kernels  # noqa: F401  (declares the ops)
    from tilekit.autotune.db import TuningDB
    from tilekit.autotune.entries import entry_reason
    from tilekit.autotune.keys import parse_key
    from tilekit.autotune.op import STALE_KERNEL, STALE_SPACE
    from tilekit.autotune.registry import registered_ops
    ops = registered_ops()
    shipped = TuningDB(ROOT / "tuning_db", "maintainer", writable=True)
    candidates = []            # (device file, key, entry, task); files read and checked as lookup reads them
    for file in shipped.device_files():
        device = file.device()
        for key, entry in file.read().items():
            if entry_reason(key, entry, "shipped") in (STALE_KERNEL, STALE_SPACE):   # sound; stale for these alone?
                name, problem = parse_key(key)
                task = [name, ops[name].tuning_problem(problem), entry["config"], device.arch]
                candidates.append((file, key, entry, task))
    print(f"{len(candidates)} entries stale for their kernel source or search space; compiling each under {old} "
          f"and here")
    tasks = [task for *_, task in candidates]
    with tempfile.TemporaryDirectory() as tmp:
        # Both versions compile from the same path: cubins carry source locations.
        tree = Path(tmp) / "src"
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", old, "tilekit"], capture_output=True, check=True)
        tree.mkdir()
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        before = compile_under(tree, tasks, str(Path(tmp) / "cache-old"))
        shutil.copy2(ROOT / "tilekit" / "autotune" / "digest.py", tree / "tilekit" / "autotune" / "digest.py")
        rehashed = compile_under(tree, [], str(Path(tmp) / "cache-old"))      # OLD's code, this digest
        shutil.rmtree(tree / "tilekit")
        shutil.copytree(ROOT / "tilekit", tree / "tilekit", ignore=shutil.ignore_patterns("__pycache__"))
        now = compile_under(tree, tasks, str(Path(tmp) / "cache-now"))   # compiled again, not looked up
    carried: dict = {}
    kept = 0
    for (file, key, entry, task), a, b, was, now_admits in zip(candidates, before["cubins"], now["cubins"],
                                                            before["candidates"], now["candidates"]):
        name = task[0]
        same_code = rehashed["hashes"].get(name) == now["hashes"][name] and \
            rehashed["spaces"].get(name) == now["spaces"][name]
        if (entry["kernel_hash"] == before["hashes"].get(name) and entry["space_hash"] == before["spaces"].get(name)
                and (isinstance(a, list) and a == b or same_code) and was == now_admits):
            carried.setdefault(file, {})[key] = {**entry, "kernel_hash": now["hashes"][name],
                                                 "space_hash": now["spaces"][name]}
        else:
            kept += 1
    for file, entries in carried.items():
        shipped.store(file.device(), entries)
        file.path.with_name(file.path.name + ".lock").unlink(missing_ok=True)     # not part of the repository
        print(f"{file.path.relative_to(ROOT)}: carried {len(entries)} entries with unchanged code and candidates")
    print(f"left stale (code changed, or tuned for a source other than {old}'s): {kept}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
