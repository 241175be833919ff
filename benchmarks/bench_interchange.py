"""Peak memory of ``shardstore export`` / ``import`` against the largest tensor and the model size.

Each operation runs in a fresh child process that resets its peak-RSS counter
(``/proc/self/clear_refs``) after its imports, runs the operation once, and reports
``VmHWM - VmRSS-before`` (the peak resident memory the operation added, file-backed
mappings included) and the wall time. Peers measured in the same run:
``safetensors.torch.load_file`` with every tensor touched (the whole model in memory) and
``load_file`` + ``save_file`` (the naive conversion). Prints one table.

    python benchmarks/bench_interchange.py [--mib 512] [--largest-mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

__all__ = ["main"]

MIB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _model(tmp: str, total_mib: int, largest_mib: int) -> dict[str, Any]:
    """Write a Llama-shaped directory: embedding and head of ``largest_mib``, layers of 4 quarter-size matrices."""
    import torch
    from safetensors.torch import save_file

    side = int((largest_mib * MIB // 4) ** 0.5)
    big = (largest_mib * MIB // 4 // side, side)
    small = (side // 2, side // 2)
    layer_bytes = 4 * small[0] * small[1] * 4
    layers = max(1, (total_mib * MIB - 2 * big[0] * big[1] * 4) // layer_bytes)
    g = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(big, generator=g),
        "lm_head.weight": torch.randn(big, generator=g),
    }
    for i in range(layers):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"model.layers.{i}.self_attn.{p}.weight"] = torch.randn(small, generator=g)
    src = os.path.join(tmp, "src")
    os.makedirs(src)
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json"), "w") as f:
        json.dump({"model_type": "llama", "num_hidden_layers": int(layers), "hidden_size": side}, f)
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    return {"src": src, "model_bytes": sum(sizes), "largest_bytes": max(sizes), "tensors": len(sizes)}


def _child(op: str, tmp: str) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    import shardstore as ss
    from shardstore.ops.interchange import export_commit, import_directory

    src, store_url = os.path.join(tmp, "src"), os.path.join(tmp, "store")
    reset = _reset_peak()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    if op == "import":
        import_directory(ss.open_store(store_url), src, slots=2)
    elif op == "export":
        export_commit(ss.open_store(store_url, create=False), "main", os.path.join(tmp, "out"), overwrite=True)
    elif op == "export-sharded":
        export_commit(
            ss.open_store(store_url, create=False),
            "main",
            os.path.join(tmp, "out-sharded"),
            max_shard_bytes=100 * MIB,
            overwrite=True,
        )
    elif op == "load_file":
        tensors = load_file(os.path.join(src, "model.safetensors"))
        for t in tensors.values():
            t.sum()  # touch every byte, as any use of the weights would
        del tensors
    elif op == "load_file+save_file":
        save_file(load_file(os.path.join(src, "model.safetensors")), os.path.join(tmp, "copy.safetensors"))
    else:
        raise SystemExit(f"unknown op {op}")
    seconds = time.perf_counter() - t0
    return {"op": op, "peak_added": _status("VmHWM") - before, "seconds": seconds, "reset": reset}


def _run(op: str, tmp: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", op, tmp], capture_output=True, text=True, env=env, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="model size in MiB (default 512)")
    parser.add_argument("--largest-mib", type=int, default=64, help="largest tensor in MiB (default 64)")
    parser.add_argument("--child", nargs=2, metavar=("OP", "TMP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-interchange-") as tmp:
        info = _model(tmp, args.mib, args.largest_mib)
        rows = [_run(op, tmp) for op in ("import", "export", "export-sharded", "load_file", "load_file+save_file")]
    m, big = info["model_bytes"], info["largest_bytes"]
    print(
        f"# {info['tensors']} fp32 tensors, model {m / MIB:.0f} MiB, largest tensor {big / MIB:.0f} MiB; "
        f"python {platform.python_version()}, {os.cpu_count()} CPUs; peak reset: {all(r['reset'] for r in rows)}"
    )
    print(
        f"| {'operation':<22} | {'peak added (MiB)':>16} | {'/ largest tensor':>16} | {'/ model':>8} | {'seconds':>8} |"
    )
    print(f"|{'-' * 24}|{'-' * 18}:|{'-' * 18}:|{'-' * 10}:|{'-' * 10}:|")
    for r in rows:
        p = r["peak_added"]
        print(f"| {r['op']:<22} | {p / MIB:>16.1f} | {p / big:>16.2f} | {p / m:>8.2f} | {r['seconds']:>8.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
