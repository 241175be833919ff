"""The device's own figures, from fio (the Debian package), for the benchmarks' "limit" rows.

Writes are sequential and end in fsync (fio counts the final fsync in the job's runtime:
without ``end_fsync`` the same write reports page-cache speed); reads are sequential from a
cold page cache (the caller drops it; fio's ``invalidate`` drops the files' own pages too).
Each job walks its files in order (``file_service_type=sequential``), as a checkpoint
writer walks its tensors. Without fio installed, ``FIO`` is None and the rows are left out.
"""

from __future__ import annotations

import json
import shutil
import subprocess

__all__ = ["FIO", "FIO_JOBS", "fio_run"]

MIB = 1 << 20
FIO = shutil.which("fio")
#: The several-jobs figure of the single-process benchmark.
FIO_JOBS = 4


def fio_run(directory: str, rw: str, jobs: int, size: int, nrfiles: int) -> float:
    """Seconds fio took for ``jobs`` x ``size`` bytes in ``nrfiles`` files per job (its own
    runtime, the final fsync included); ``rw`` is ``write`` or ``read`` (of the files a
    ``write`` with the same arguments left in ``directory``)."""
    assert FIO is not None, "fio is not installed"
    bs = max(4096, min(MIB, size // nrfiles // 4096 * 4096))  # fio does no I/O on files smaller than a block
    cmd = [
        FIO,
        "--name=bench",
        f"--directory={directory}",
        f"--rw={rw}",
        f"--bs={bs}",
        f"--size={size}",
        f"--numjobs={jobs}",
        f"--nrfiles={nrfiles}",
        "--file_service_type=sequential",
        "--ioengine=psync",
        "--fallocate=none",
        "--invalidate=1",
        "--group_reporting",
        "--output-format=json",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0][rw]
    return job["runtime"] / 1000 * (jobs * size) / job["io_bytes"]  # scaled, should fio round the size down
