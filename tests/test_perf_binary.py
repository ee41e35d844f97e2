"""The standalone microbenchmark (bench/perf): built with CMake against this torch, run on CPU.

Without a GPU the binary checks the core itself: plan, pack and unpack against seeded reference
values (path "pack"), the whole broadcast_plan between two threads (path "loop"), and, under
torchrun, across processes through its store-backed ProcessGroup (path "store").
The build directory is reused: a second run only re-links what changed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The binary mirrors the extension's build: CUDA where the extension was built with CUDA, else CPU only
# (a CPU-only build is what a torch whose CUDA differs from this nvcc gets: torch 2.4-2.9 are CUDA 12).
# One build directory per torch and kind, so that each venv of a version matrix reuses its own.
import torch  # noqa: E402

from coalesced_bcast import _C  # noqa: E402

PERF_CUDA = os.environ.get("COALESCED_BCAST_PERF_CUDA", "AUTO" if _C.with_cuda else "OFF")
BUILD = Path(os.environ.get("COALESCED_BCAST_PERF_BUILD",
                            ROOT / "build" / f"perf-torch{torch.__version__}-{'cpu' if PERF_CUDA == 'OFF' else 'cuda'}"))
SMALL_BUCKETS = ["--bucket-bytes", "64K", "--inplace-min-bytes", "256K"]
RUN_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    # The venv's ninja and python come first, as when CI activates the venv.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return dict(os.environ, PYTHON=sys.executable, PATH=path, COALESCED_BCAST_PERF_CUDA=PERF_CUDA)


@pytest.fixture(scope="module")
def binary() -> Path:
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed, so bench/perf cannot be built")
    header = Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d/ProcessGroup.hpp"
    if "setDefaultBackend" not in header.read_text():
        # The driver's store-backed ProcessGroup (store_backend.cpp) is built with the C++ API of torch >= 2.5.
        pytest.skip(f"torch {torch.__version__}'s C++ ProcessGroup lacks setDefaultBackend and the (store, rank, size) "
                    "constructor that bench/perf's store backend uses")
    proc = subprocess.run(["bash", str(ROOT / "bench" / "perf" / "build.sh"), str(BUILD)], env=_env(),
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"build failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    exe = BUILD / "coalesced_bcast_perf"
    assert exe.is_file(), f"build.sh succeeded but {exe} is missing"
    return exe


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def table(stdout: str) -> list[dict[str, str]]:
    """The nccl-tests style rows, keyed by the header's column names."""
    lines = stdout.splitlines()
    header = next((ln for ln in lines if ln.startswith("#") and "#wrong" in ln), None)
    assert header is not None, f"no table header in:\n{stdout}"
    labels = header[1:].split()
    rows = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert all(len(r) == len(labels) for r in rows), f"rows do not match {labels}:\n{stdout}"
    return [dict(zip(labels, r)) for r in rows]


def explain(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\nstdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-6000:]}"


def test_self_check_mixed_state_is_bitwise_exact(binary: Path) -> None:
    # 64K, 512K, 4M of every dtype, 0-dim, empty, strided and interleaved views, tied aliases,
    # tensors larger than a bucket, packed and in place.
    proc = run([str(binary), "--self-check", "-d", "mixed", "-b", "64K", "-e", "4M", "-f", "8", *SMALL_BUCKETS])
    assert proc.returncode == 0, explain(proc)
    rows = table(proc.stdout)
    assert [r["path"] for r in rows] == ["pack", "loop"] * 3, explain(proc)
    assert [int(r["#wrong"]) for r in rows] == [0] * 6, explain(proc)
    assert all(int(r["tensors"]) > 50 and int(r["size"]) >= 64 * 1024 for r in rows), explain(proc)
    assert "#wrong total: 0 OK" in proc.stdout


def test_self_check_benchmark_shapes(binary: Path) -> None:
    cases = {
        ("-d", "llama"): ("291", "bf16"),   # the Llama-8B list keeps its 291 tensors when scaled
        ("-d", "small"): ("16", "bf16"),    # one anchor-sized tensor per 64 KiB
        ("-t", "7", "-T", "f64"): ("7", "f64"),
    }
    for args, (tensors, dtype) in cases.items():
        proc = run([str(binary), "--self-check", *args, "-b", "1M", "-e", "1M"])
        assert proc.returncode == 0, explain(proc)
        rows = table(proc.stdout)
        assert len(rows) == 2, explain(proc)
        for r in rows:
            assert (r["tensors"], r["type"], int(r["#wrong"])) == (tensors, dtype, 0), explain(proc)
    bad = run([str(binary), "--no-such-flag"])
    assert bad.returncode == 2 and "unknown option" in bad.stderr, explain(bad)


def test_injected_fault_is_reported_and_fails(binary: Path) -> None:
    # One flipped byte in a bucket in transit (pack) and in a received tensor (loop) must be caught,
    # or the zeros above prove nothing.
    proc = run([str(binary), "--self-check", "-d", "mixed", "-b", "64K", "-e", "512K", "-f", "8", "--inject-fault",
                *SMALL_BUCKETS])
    assert proc.returncode != 0, explain(proc)
    rows = table(proc.stdout)
    assert len(rows) == 4 and all(int(r["#wrong"]) > 0 for r in rows), explain(proc)
    assert "FAILED" in proc.stdout and "differ from the source's" in proc.stderr, explain(proc)


def test_torchrun_two_ranks_over_the_store_backend(binary: Path, tmp_path: Path) -> None:
    # --standalone picks a free port; the agent serves the store and both ranks are clients.
    out = tmp_path / "rows.jsonl"
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
                str(binary), "--device", "cpu", "-d", "mixed", "-b", "64K", "-e", "512K", "-f", "8", "-n", "2", "-w",
                "1", *SMALL_BUCKETS, "-J", str(out)])
    assert proc.returncode == 0, explain(proc)
    rows = table(proc.stdout)
    assert [(r["path"], int(r["#wrong"])) for r in rows] == [("store", 0), ("store", 0)], explain(proc)
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert sorted((d["requested_bytes"], d["rank"]) for d in lines) == [
        (64 << 10, 0), (64 << 10, 1), (512 << 10, 0), (512 << 10, 1)]
    assert all(d["correct"] is True and d["world_size"] == 2 and d["seconds"] > 0 for d in lines), lines
