"""How ``tests/data/broken/`` was made: small broken stores, each with the exact ``verify`` output
expected of it (restic's ``testdata`` for its checker; issue 35, item 8). Kept for provenance:
``tests/shardstore/verification/test_broken_stores.py`` unpacks the checked-in archives and compares ``verify``'s output
with the ``.txt`` beside each; it never runs this script.

Two clean bases hold the same state, one commit on ref ``main`` (job ``broken``, step 1, no
RNG): a parameter ``w`` of 1048577 float32 (4 MiB and 4 bytes: two blocks) and ``b`` of 4,
after one SGD step with momentum, so ``w``'s ``momentum_buffer`` is chunked too. Mostly zeros,
so each archive is a few KB.

- ``v3``: written by shardstore at commit 3066e75 (the last writer of the row-band grid):
  chunked torch-form state makes its commit version 3. The old package comes from this
  repository's history (``git archive``) and writes in a subprocess of its own.
- ``v4``: written by this checkout (the tile grid): version 4.

Each base is verified clean, then damaged one way (the name says which), by hand, as a
disk, a bug or an attacker would:

- ``flipped-byte``: one byte of ``w``'s first parameter block XOR 0x01 (CorruptObject);
- ``missing-object``: ``w``'s last parameter block (4 bytes) deleted (ObjectNotFound);
- ``forged-manifest``: the commit re-encoded with one hex digit of its ``learned_root``
  changed, stored under its own BLAKE3 (so it hashes clean) and ``main`` moved onto it:
  only recomputing the root catches it;
- ``orphan-shard``: a second shard manifest (the commit's, with ``step`` 2) stored but named
  by no commit, as a save that died before its commit leaves it: verify, which checks what
  refs reach, passes (gc removes it);
- ``missing-commit``: a second ref, ``dangling``, naming a commit id the store lacks.

Archives are written deterministically (sorted members, mtime 0, uid/gid 0, gzip mtime 0).
To regenerate (the ids of the v3 base are pinned by the old writer's bytes, so the .txt
files change only if verify's wording does)::

    rm -rf /tmp/ss3066 && mkdir /tmp/ss3066 && git archive 3066e75 shardstore | tar -x -C /tmp/ss3066
    python tests/data/make_broken_stores.py --old /tmp/ss3066
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "broken"

#: The state and the save, the same code for both writers (run by each in its own process).
WRITE = r"""
import sys, torch, shardstore as ss
torch.manual_seed(0)
w = torch.nn.Parameter(torch.zeros(1048577))
b = torch.nn.Parameter(torch.ones(4))
with torch.no_grad():
    w[:8] = torch.arange(8.0)
model = torch.nn.ParameterDict({"w": w, "b": b})
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
w.grad = torch.zeros_like(w)
w.grad[:8] = 1.0
b.grad = torch.full_like(b, 0.5)
opt.step()
store = ss.open_store(sys.argv[1], create=True)
print(ss.save(store, model, opt, step=1, job="broken", rng=False, ref="main"))
"""


def write_base(path: Path, pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath, "ATEN_CPU_CAPABILITY": "default"}
    done = subprocess.run(  # cwd: not the checkout, whose shardstore `python -c` would import first
        [sys.executable, "-c", WRITE, str(path)], env=env, cwd=path.parent, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def _object(root: Path, oid: str) -> Path:
    return root / "objects" / oid[:2] / oid


def _put(root: Path, data: bytes) -> str:
    from shardstore.format.tensors import hash_bytes

    oid = hash_bytes(data)
    _object(root, oid).parent.mkdir(exist_ok=True)
    _object(root, oid).write_bytes(data)
    return oid


def _commit(root: Path) -> tuple[str, object, object]:
    import shardstore as ss

    store = ss.open_store(str(root), create=False)
    lc = ss.load_commit(store, "main")
    return lc.id, lc.commit, lc.shards[0]


def _w_blocks(root: Path) -> list[str]:
    _, _, shard = _commit(root)
    (w,) = [e for e in shard.entries if e.name == "w"]
    return [block.object for block in w.param]


def flipped_byte(root: Path) -> None:
    path = _object(root, _w_blocks(root)[0])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def missing_object(root: Path) -> None:
    _object(root, _w_blocks(root)[-1]).unlink()


def forged_manifest(root: Path) -> None:
    import msgspec

    import shardstore as ss

    _, commit, _ = _commit(root)
    root_hex = commit.learned_root
    forged = msgspec.structs.replace(commit, learned_root=("0" if root_hex[0] != "0" else "1") + root_hex[1:])
    (root / "refs" / "main").write_text(_put(root, ss.encode(forged)) + "\n")


def orphan_shard(root: Path) -> None:
    import msgspec

    import shardstore as ss

    _, _, shard = _commit(root)
    _put(root, ss.encode(msgspec.structs.replace(shard, step=2)))


def missing_commit(root: Path) -> None:
    from shardstore.format.tensors import hash_bytes

    (root / "refs" / "dangling").write_text(hash_bytes(b"a commit this store never held") + "\n")


CASES: dict[str, Callable[[Path], None]] = {
    "flipped-byte": flipped_byte,
    "missing-object": missing_object,
    "forged-manifest": forged_manifest,
    "orphan-shard": orphan_shard,
    "missing-commit": missing_commit,
}


def write_archive(root: Path, dest: Path) -> None:
    """``root``'s files as a tar.gz whose bytes depend only on their names and contents."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in root.rglob("*")):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            info.mode = 0o755 if path.is_dir() else 0o644
            if path.is_dir():
                tar.addfile(info)
            else:
                with open(path, "rb") as f:
                    tar.addfile(info, f)
    with open(dest, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9, filename="") as gz:
        gz.write(buf.getvalue())


def verify_output(root: Path) -> str:
    """What ``shardstore verify STORE`` prints, the store's path written STORE, and its exit code."""
    from shardstore_cli.shardstore_cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(root)])
    text = "$ shardstore verify STORE\n" + out.getvalue() + err.getvalue() + f"exit {code}\n"
    return text.replace(str(root), "STORE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="shardstore at commit 3066e75 (a directory holding shardstore/)")
    args = parser.parse_args()
    OUT.mkdir(exist_ok=True)
    repo = str(HERE.parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        for version, pythonpath in (("v3", args.old), ("v4", repo)):
            base = Path(tmp) / version
            write_base(base, pythonpath)
            shutil.rmtree(base / "journal", ignore_errors=True)  # advisory notes holding wall-clock times
            assert verify_output(base).endswith("exit 0\n"), verify_output(base)
            version_seen = _commit(base)[1].version
            assert f"v{version_seen}" == version, (version, version_seen)
            for case, damage in CASES.items():
                root = Path(tmp) / f"{version}-{case}"
                shutil.copytree(base, root)
                damage(root)
                write_archive(root, OUT / f"{version}-{case}.tar.gz")
                (OUT / f"{version}-{case}.txt").write_text(verify_output(root))
                print(f"{version}-{case}: {(OUT / f'{version}-{case}.tar.gz').stat().st_size} bytes")


if __name__ == "__main__":
    main()
