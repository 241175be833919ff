"""The benchmark scripts still run and still check what they measure (tiny sizes; nothing is timed here).

`bench_checkpoint.py` restores every method's output and compares it with the saved state
(a mismatch exits non-zero), so a smoke run is also an end-to-end check of the paths it
compares; `bench_s3.py` verifies its round trip against a moto server it starts itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_checkpoint_benchmark_smoke(tmp_path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    done = _run(
        [
            "benchmarks/bench_checkpoint.py",
            "--scale",
            "0.002",
            "--params",
            "1",
            "--reps",
            "1",
            "--warm",
            "--dir",
            str(tmp_path),
            "--results",
            str(results),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert "<!-- bench_checkpoint:begin -->" in text and "<!-- bench_checkpoint:end -->" in text
    assert "Page cache before each restore: NOT dropped (--warm)" in text
    for shape in ("many", "few"):
        section = text.split(f"**targets** — {shape}")[1].split("\n\n")[1]
        rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| target")]
        names = [r.split("|")[1].strip() for r in rows]
        for want in (
            "save ≥ 1.5× dcp.save default",
            "restore ≥ 1.5× dcp.load",
            "verify ≥ 0.8× BLAKE3 max_threads=2",
            "async blocking ≤ 1.5× memcpy (time)",
            "second save writes 0 tensor bytes",
        ):
            assert want in names, (shape, names)
        zero = next(r for r in rows if "second save writes 0 tensor bytes" in r)
        assert zero.rstrip().endswith("| yes |"), zero  # write-once holds at any size
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bench-ckpt-")]  # scratch removed


@pytest.mark.long  # .ci/run's second step
def test_checkpoint_benchmark_busy_smoke(tmp_path) -> None:
    """--busy: spinning processes for the run's length, stopped at its end; its own block of
    RESULTS.md (the quiet block untouched), saying so, with save CPU seconds and the 1.0x
    run-by-run target; --methods runs the chosen peers and shardstore only."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n\n<!-- bench_checkpoint:begin -->\nquiet\n<!-- bench_checkpoint:end -->\n")
    args = ["--scale", "0.002", "--params", "1", "--reps", "1", "--shapes", "many", "--warm"]
    args += ["--busy", "2", "--methods", "safetensors", "--dir", str(tmp_path), "--results", str(results)]
    done = _run(["benchmarks/bench_checkpoint.py", *args])
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stderr.split("busy: 2 spinning, pids ")[1].split()[0].split(",")]
    assert len(pids) == 2
    for pid in pids:  # stopped and reaped: gone, or (pid reused since) not a spinner
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"while True" not in f.read()
        except FileNotFoundError:
            pass
    text = results.read_text()
    assert "<!-- bench_checkpoint:begin -->\nquiet\n<!-- bench_checkpoint:end -->" in text
    block = text.split("<!-- bench_checkpoint_busy:begin -->")[1].split("<!-- bench_checkpoint_busy:end -->")[0]
    assert "--busy 2 --methods shardstore,safetensors`" in block
    assert "CPU: busy, 2 processes spinning on it for the whole run" in block and "load average" in block
    cpu = block.split("**save CPU** — many")[1].split("\n\n")[1]
    assert {r.split("|")[1].strip() for r in cpu.splitlines()[2:]} == {
        "shardstore.save",
        "shardstore.save, next step (every tensor changed, same store)",
        "safetensors save_file + fsync",
    }
    assert "| (not a target) next save, same store, against every peer |" in block
    assert "| save ≥ 1.0× every peer in every run |" in block
    assert "torch.save" not in block and "dcp.save" not in block  # not chosen


def test_checkpoint_run_targets_with_some_peers_left_out(monkeypatch) -> None:
    """The run-by-run table of a run whose --methods left out every save peer (or whose next
    save is missing) names what was run and nothing else. Failed before: min() of nothing
    (--methods async)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import bench_checkpoint as bench

    class Run:
        shape = "many"
        samples = {
            ("save", "shardstore.save"): [1.0, 2.0],
            ("save", bench.NEXT_SAVE): [1.0, 4.0],
            ("restore", "shardstore.restore (verifies every byte)"): [1.0, 1.0],
            ("restore", "dcp.load"): [3.0, 2.0],
        }

    rows = [r for r in bench.run_targets(Run(), want=1.0) if r.startswith("| ") and "---" not in r][1:]
    assert rows == ["| restore ≥ 1.0× every peer in every run | 2.00×, dcp.load | 3.00, 2.00 | yes |"]
    Run.samples[("save", "torch.save + fsync")] = [2.0, 2.0]
    rows = [r for r in bench.run_targets(Run(), want=1.0) if r.startswith("| ") and "---" not in r][1:]
    assert rows[:2] == [
        "| save ≥ 1.0× every peer in every run | 1.00×, torch.save + fsync | 2.00, 1.00 | yes |",
        "| (not a target) next save, same store, against every peer | 0.50×, torch.save + fsync | 2.00, 0.50 | — |",
    ]


def test_slice_check_benchmark_smoke() -> None:
    """Both layouts, one small size, this tree: each case checks its slices are accepted."""
    done = _run(["benchmarks/bench_slices.py", "--sizes", "200", "--reps", "1"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| rows | 200 | this tree |" in done.stdout and "| mixed | 200 | this tree |" in done.stdout


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_s3_benchmark_smoke() -> None:
    done = _run(["benchmarks/bench_s3.py", "--mib", "4", "--repeat", "1"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "upload" in done.stdout and "download" in done.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SHARDSTORE_SLOW"), reason="two more spawned processes (~10-17 s); SHARDSTORE_SLOW=1 runs it"
)
def test_dtensor_benchmark_smoke(tmp_path) -> None:
    """Two Gloo processes save and restore one FSDP2 tensor both ways; a restore that differs exits non-zero.

    Behind the slow marker: tests/shardstore/sharded/test_dtensor.py already runs these code paths, and the
    suite's time budget is shared."""
    results = tmp_path / "RESULTS.md"
    done = _run(
        [
            "benchmarks/bench_dtensor.py",
            "--mib",
            "16",
            "--reps",
            "1",
            "--warm",
            "--dir",
            str(tmp_path),
            "--results",
            str(results),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert (
        "<!-- bench_dtensor:begin -->" in text
        and "| dcp.save |" in text
        and "| shardstore.restore (verifies every block) |" in text
    )
    assert "24.0 / 24.0 MiB, 24.0 / 24.0 MiB" in text  # each rank reads exactly its share (2 whole blocks x 3)
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bench-dtensor-")]  # scratch removed


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SHARDSTORE_SLOW"), reason="four spawned processes (~35 s); SHARDSTORE_SLOW=1 runs it"
)
def test_mesh_benchmark_smoke(tmp_path) -> None:
    """Four Gloo processes on a 2 x 2 mesh save, restore into three meshes (each restore checked
    slice by slice: a difference exits non-zero) and copy each slot; the tables come out."""
    results = tmp_path / "RESULTS.md"
    done = _run(
        [
            "benchmarks/bench_mesh.py",
            "--mib",
            "16",
            "--reps",
            "1",
            "--warm",
            "--dir",
            str(tmp_path),
            "--results",
            str(results),
        ]
    )
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert (
        "<!-- bench_mesh:begin -->" in text and "copy --shard K reads" in text and "where each rank's save went" in text
    )
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bench-mesh-")]  # scratch removed


@pytest.mark.long
def test_scale_sim_quick(tmp_path) -> None:
    """bench_scale_sim.py --quick: both systems' metadata path for Llama-3 8B at 64 and 512 ranks,
    extrapolated from 0 and 1 layers. The script itself checks that its generated descriptions are
    what ``describe`` gives the sampled ranks' DTensors, and its synthetic DCP plans what
    ``create_local_plan`` gives them (an assertion error exits non-zero); the tables come out."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    done = _run(["benchmarks/bench_scale_sim.py", "--quick", "--results", str(results)])
    assert done.returncode == 0, done.stderr[-3000:]
    text = results.read_text()
    assert "<!-- bench_scale_sim:begin -->" in text and "**Growth exponents**" in text
    rows = [line for line in text.splitlines() if line.startswith("| Llama-3 8B | 512 (256 × 2) |")]
    assert [r.split("|")[4].strip() for r in rows] == ["shardstore", "dcp"], rows
    assert "| Llama-3 8B | shardstore |" in text and "| Llama-3 8B | dcp |" in text  # the exponents' rows


def test_scale_sim_exchange_restore_model() -> None:
    """bench_scale_sim.py --exchange-restore: SPEC.md §16.2's assignment computed over Llama-3 8B's
    blocks into 32 dp ranks; every block once, and the reads spread to within a few blocks."""
    done = _run(["benchmarks/bench_scale_sim.py", "--exchange-restore", "--models", "8B", "--ranks", "64"])
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("| Llama-3 8B | 64 → 32 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    lo, mean, hi = (float(x.replace(",", "")) for x in cells[3].split(" / "))
    assert int(cells[2].replace(",", "")) > 0 and abs(mean * 32 - int(cells[2].replace(",", ""))) < 1
    assert hi - lo <= 32
    # SPEC.md §16.3's accounting: on its own each of 32 ranks reads the ref, the commit, the 64 shard
    # manifests and the config; in the group rank 0 reads the ref and the commit, each shard manifest is
    # read once (2 a rank), and each rank reads the config
    blocks = int(cells[2].replace(",", ""))
    assert cells[9] == f"{32 * 67:,} / {2 + 64 + 32:,}" and cells[10] == "2"
    assert cells[11] == f"{2 + 64 + 32 + 2 * blocks:,} (was {32 * 67 + 2 * blocks:,})"


@pytest.mark.long  # spawns 2 Gloo processes
def test_restore_exchange_benchmark_smoke() -> None:
    """bench_restore_exchange.py at tiny sizes: it checks every restored tensor bitwise (a mismatch
    exits non-zero) and prints both methods' rows; by exchange each rank reads its share."""
    done = _run(["benchmarks/bench_restore_exchange.py", "--world", "2", "--tensors", "1", "--rows", "8",
                 "--cols", "262144", "--reps", "1"])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in done.stdout.splitlines() if line.startswith("| ")}
    read = {k: rows[k].split("|")[4].strip() for k in ("alone", "exchange")}
    assert read == {"alone": "8.0–8.0", "exchange": "4.0–4.0"}, read  # 2 tiles of 4 MiB, each spanning both ranks' rows


@pytest.mark.long
def test_s3_request_budget_quick(tmp_path) -> None:
    """bench_s3_requests.py --quick: a save, a second save, a restore (on its own, then by exchange
    in the ranks' group, checked bitwise against the first) and DCP's save and load on 2
    Gloo ranks against moto, counted by the server; the script exits non-zero unless the server's
    count equals what each rank's storage calls predict (the rule its extrapolation applies), and
    it extrapolates 8B at 64 ranks through bench_scale_sim."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    done = _run(["benchmarks/bench_s3_requests.py", "--quick", "--results", str(results)])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    text = results.read_text()
    assert "<!-- bench_s3_requests:begin -->" in text
    want = {"open": "yes", "commit 1": "yes", "commit 2": "yes", "commit 3": "yes", "restore": "yes",
            "restore (group)": "yes", "dcp save": "—", "dcp load": "—"}  # fmt: skip
    rows = [line for line in text.splitlines() if line.startswith("| 2 | ") and line.split("|")[2].strip() in want]
    # "yes (1 retried)": equal once the requests S3Storage retried after losing their answer are
    # counted apart, as the script does (a loaded machine makes moto drop a connection now and then)
    got = {
        r.split("|")[2].strip(): re.sub(r" \(\d+ retried\)$", "", r.rstrip().rsplit("|", 2)[1].strip()) for r in rows
    }
    assert got == want, rows
    # each rank's tensor bytes read: by exchange never more than on its own, and about its share
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| N | tensor bytes read per rank"))
    alone, grouped, share = (float(c.split("–")[-1]) for c in lines[head + 2].split("|")[2:5])
    assert grouped <= alone and abs(grouped - share) <= 0.1 * share, lines[head + 2]
    assert any(line.startswith("| Llama-3 8B | 64 |") for line in text.splitlines())
    assert any(line.startswith("| Llama-3 8B | 64 → 32 |") for line in text.splitlines())


def test_gpu_check_without_cuda_says_so_and_exits_0() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: gpu_check would run its checks")
    done = _run(["benchmarks/gpu_check.py"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "needs a CUDA device" in done.stdout and "nothing was checked" in done.stdout


@pytest.mark.long
def test_gpu_check_logic_on_cpu() -> None:
    """gpu_check.py --device cpu runs every check that does not need CUDA on tiny sizes (three
    worker processes for the pipeline); each must pass, and the memory check says it is CUDA only."""
    done = _run(["benchmarks/gpu_check.py", "--device", "cpu"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert len(rows) == 6, done.stdout
    assert not [r for r in rows if r.rstrip().endswith("| **no** |")], done.stdout  # every check run passed
    ran = [r.split("|")[1].strip() for r in rows if r.rstrip().endswith("| yes |")]
    assert any(name.startswith("2-worker pipeline, gloo on cpu") for name in ran), ran
    assert any(name.startswith("bf16-autocast bitwise replay") for name in ran), ran
    assert sum(name.startswith(("shardstore AsyncSaver", "dcp.async_save")) for name in ran) == 2, ran


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("SHARDSTORE_SLOW"), reason="two more spawned processes (~30 s); SHARDSTORE_SLOW=1 runs it"
)
def test_dcp_benchmark_smoke(tmp_path) -> None:
    """Two Gloo processes save and load FSDP2 state through StoreWriter/StoreReader and DCP's
    FileSystemWriter/Reader; a load that differs exits non-zero; the half-frozen save writes the
    changed half and manifests only. Behind the slow marker: tests/shardstore/dcp/test_dcp_distributed.py runs these paths."""
    results = tmp_path / "RESULTS.md"
    args = ["--mib", "32", "--reps", "1", "--warm", "--dir", str(tmp_path), "--results", str(results)]
    done = _run(["benchmarks/bench_dcp.py", *args])
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert "<!-- bench_dcp:begin -->" in text and "| dcp.save → FileSystemWriter |" in text
    assert "| StoreReader, default (" in text and "each as constructed by default" in text  # default vs default
    assert "the changed half is 48.00 MiB" in text and "| the frozen half written zero times" in text
    assert "KiB beyond it | yes |" in text


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_peer_recovery_benchmark_smoke(tmp_path) -> None:
    """Both group sizes, tiny state: each method's restore is checked bitwise inside the script
    (a mismatch exits non-zero) and recovering through peers reads no tensor byte from the store."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    args = ["benchmarks/bench_peer_recovery.py", "--mib", "48", "--reps", "1", "--warm", "--results", str(results)]
    done = _run(args)
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    for world in (2, 3):
        row = next(r for r in text.splitlines() if r.startswith(f"| {world} workers: 0 tensor bytes"))
        assert row.rstrip().endswith("| yes |"), row
        assert f"| {world} | " in text and "| peers |" in text and "| S3 |" in text
    assert "On paper" in text and "| 70 B | 64 |" in text


@pytest.mark.long  # .ci/run's second step (the README's test command keeps its 8 minutes)
def test_adapters_benchmark_smoke(tmp_path) -> None:
    """Lightning's and the Hugging Face Trainer's own checkpoints against the adapters, tiny: every
    restore is checked bitwise inside the script (a mismatch exits non-zero); the Hugging Face restore
    is timed as the resume's own work, apart from the whole train() call, and the second save with
    half frozen writes the changed half only."""
    pytest.importorskip("lightning.pytorch", reason="the Lightning adapter's benchmark")
    results = tmp_path / "RESULTS.md"
    results.write_text("# results\n")
    done = _run(["benchmarks/bench_adapters.py", "--mib", "24", "--reps", "1", "--warm", "--results", str(results)])
    assert done.returncode == 0, done.stderr[-2000:]
    text = results.read_text()
    assert "<!-- bench_adapters:begin -->" in text and "| restore s | restore CPU s | whole call s |" in text
    for row in ("| Lightning | ShardstoreCheckpointIO |", "| Hugging Face Trainer | ShardstoreTrainer |"):
        assert row in text, text
    hf = next(r for r in text.splitlines() if r.startswith("| Hugging Face Trainer | ShardstoreTrainer |"))
    cells = hf.split("|")
    restore, cpu, call = (float(cells[i].split()[0]) for i in (4, 5, 6))
    assert 0 < restore < call and cpu > 0, hf  # the resume is part of the call, not all of it
    for framework in ("Lightning", "Hugging Face Trainer"):
        row = next(r for r in text.splitlines() if r.startswith(f"| {framework}: the second save writes"))
        assert row.rstrip().endswith("| yes |"), row


def test_dcp_load_timeline_report(monkeypatch) -> None:
    """The timeline's report (dcp_load_timeline.py; the runs themselves need root to drop the page
    cache): the device line from /sys/block stat samples around a load, the rank line from its marks."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "benchmarks"))
    import dcp_load_timeline as tl

    # time, read I/Os, merges, sectors read, read ticks, 4 write fields, in flight, io_ticks
    samples = [
        [t, reads, 0, sectors, 0, 0, 0, 0, 0, flight, ticks]
        for t, reads, sectors, flight, ticks in (
            (99.99, 0, 0, 0, 0),
            (100.1, 10, 20480, 4, 100),
            (100.4, 20, 40960, 2, 350),
            (100.6, 20, 40960, 0, 350),
        )
    ]
    marks = [
        ("ss.meta<", 100.002),
        ("ss.plan<", 100.01),
        ("ss.data<", 100.02),
        ("ss.check<", 100.021),
        ("ss.check>", 100.03),
        ("ss.run<", 100.031),
        ("blk<", 100.032),
        ("blk>", 100.1),
        ("blk<", 100.15),
        ("blk>", 100.3),
        ("ss.data>", 100.31),
        ("load>", 100.4),
        ("set>", 100.45),
    ]
    run = {"name": "ss1", "t0": 100.0, "t1": 100.5, "user": 0.2, "sys": 0.1, "marks": marks}
    lines = tl._report([[run], [dict(run, t1=100.45)]], samples)
    assert lines[0] == (
        "ss1  wall   500 ms | device: reads +100..+400 ms, 21 MB, busy 350 ms, requests 1024 KiB, "
        "in flight mean 1.5, none 0.50"
    )
    assert (
        lines[1]
        == lines[2]
        == (
            "    cpu 300 ms (sys 100)  ss.meta<2 ss.plan<10 ss.data<20 ss.check<21 ss.check>30 ss.run<31 ss.data>310 "
            "load>400 set>450 | 2 reads, 50 ms between them"
        )
    )
