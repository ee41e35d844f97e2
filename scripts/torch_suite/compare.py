"""Compare run.sh's two runs of torch's tests: OUT/without/*.xml against OUT/with/*.xml (pytest junit xml).

    python compare.py OUT

Prints, per file, the passed/failed/skipped/errors counts of each mode; every test whose outcome differs
(with the tail of its failure text); and, from OUT/with/*.calls.jsonl, how many syncs coalesced_bcast
served and how many it handed to torch's own function, and why.
"""
import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

KINDS = ("passed", "failed", "skipped", "errors")


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, message); a test listed twice (e.g. failed call and error in teardown) keeps the worst."""
    rank = {"passed": 0, "skipped": 1, "failed": 2, "errors": 3}
    res: dict[str, tuple[str, str]] = {}
    for tc in ET.parse(xml).iter("testcase"):
        tid = f"{tc.get('classname')}::{tc.get('name')}"
        kind, text = "passed", ""
        for child, k in (("error", "errors"), ("failure", "failed"), ("skipped", "skipped")):
            el = tc.find(child)
            if el is not None:
                kind, text = k, f"{el.get('message') or ''}\n{el.text or ''}"
                break
        if tid not in res or rank[kind] > rank[res[tid][0]]:
            res[tid] = (kind, text)
    return res


def tail(text: str, n: int = 12) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return "\n".join("      " + ln[:220] for ln in lines[-n:])


def main(out: Path) -> int:
    names = sorted({p.stem for m in ("without", "with") for p in (out / m).glob("*.rc")})
    diffs = []
    w = max([len(n) for n in names] + [4])
    print(f"{'file':<{w}} {'mode':<8} " + " ".join(f"{k:>7}" for k in KINDS))
    for name in names:
        runs = {}
        for mode in ("without", "with"):
            xml, rc = out / mode / f"{name}.xml", out / mode / f"{name}.rc"
            rc_text = rc.read_text().strip() if rc.exists() else "?"
            if not xml.exists():
                print(f"{name:<{w}} {mode:<8} no junit xml (rc {rc_text}: timeout or crash; see {mode}/{name}.log)")
                continue
            runs[mode] = outcomes(xml)
            count = collections.Counter(k for k, _ in runs[mode].values())
            note = "" if rc_text in ("0", "1") else f"  (rc {rc_text})"
            print(f"{name:<{w}} {mode:<8} " + " ".join(f"{count[k]:>7}" for k in KINDS) + note)
        if len(runs) == 2:
            a, b = runs["without"], runs["with"]
            for tid in sorted(a.keys() | b.keys()):
                ka, kb = a.get(tid, ("absent", ""))[0], b.get(tid, ("absent", ""))[0]
                if ka != kb:
                    diffs.append((name, tid, ka, kb, b.get(tid, a.get(tid))[1] if kb != "passed" else a[tid][1]))
    print(f"\n{len(diffs)} tests with different outcomes (without -> with):")
    for name, tid, ka, kb, text in diffs:
        print(f"  {tid}: {ka} -> {kb}")
        if text.strip():
            print(tail(text))

    served, fallback, procs, tests_served = collections.Counter(), collections.Counter(), 0, set()
    for log in sorted((out / "with").glob("*.calls.jsonl")):
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            procs += 1
            served.update(rec["served"])
            fallback.update(rec["fallback"])
            if rec["served"] and rec.get("test"):
                tests_served.add(rec["test"].rsplit(" (", 1)[0])
    print(f"\ncoalesced_bcast in the 'with' run: {procs} processes logged; syncs served: {dict(served) or 0}; "
          f"tests with a served sync: {len(tests_served)}")
    if not procs:
        print("  WARNING: no process logged its calls: was coalesced_bcast.install() active (see the logs' stderr)?")
    for reason, n in fallback.most_common():
        print(f"  handed to torch {n}x: {reason}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/torch_suite_out")))
