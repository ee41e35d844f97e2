"""Does an error raised inside the compiled module reach Python as an exception on this machine?

On the GPU image (torch 2.11) the first session saw processes die with SIGSEGV whenever the
extension threw; this probe raises from the core in one process, with and without CUDA initialised,
and exits 0 only if every case raised the expected Python exception.

    python3 bench/probe_errors.py
"""
from __future__ import annotations

import faulthandler
import sys

import torch

faulthandler.enable()
import coalesced_bcast  # noqa: E402

CASES = {
    "meta tensor": lambda: coalesced_bcast._C.Plan([torch.empty(3, device="meta")], ["m.w"], 4096, 1, 1 << 40, 0, 0),
    "bad bucket bytes": lambda: coalesced_bcast._C.Plan([torch.zeros(3)], ["c.w"], 0, 1, 1 << 40, 0, 0),
    "hash of float words": lambda: coalesced_bcast._C.hash_words(torch.zeros(4)),
}


def main() -> int:
    ok = True
    rounds = [("cpu only", None)]
    if torch.cuda.is_available():
        rounds.append(("cuda initialised", lambda: torch.zeros(1, device="cuda")))
    for label, setup in rounds:
        if setup is not None:
            setup()
        for name, fn in CASES.items():
            try:
                fn()
            except (ValueError, TypeError, RuntimeError) as e:
                print(f"probe [{label}] {name}: raised {type(e).__name__}: {str(e)[:120]}", flush=True)
            else:
                print(f"probe [{label}] {name}: did NOT raise", flush=True)
                ok = False
    print("probe: OK" if ok else "probe: FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
