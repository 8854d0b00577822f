#!/usr/bin/env python3
"""Per-suite counts of an iscsi-test-cu run (its stdout in a file).

    iscsi-test-cu-table.py OUTPUT            # the markdown table
    iscsi-test-cu-table.py OUTPUT --list     # each test that did not pass
    iscsi-test-cu-table.py 512=A 4096=B      # several runs side by side

CUnit counts a test that skipped itself as passed; here a test that printed
[SKIPPED] before its result counts as skipped.
"""
import re
import sys


def results(text):
    suite, cur, order, body = None, None, [], {}
    for line in text.splitlines():
        m = re.match(r"^Suite: (\S+)", line)
        if m:
            suite = m.group(1)
            continue
        m = re.match(r"^\s+Test: (\S+) \.\.\.(.*)$", line)
        if m:
            cur = suite + "." + m.group(1)
            order.append(cur)
            body[cur] = m.group(2) + "\n"
            continue
        if cur:
            body[cur] += line + "\n"
    out = {}
    for t in order:
        b = body[t]
        m = re.search(r"(?m)(?:^|\.\.\.)(passed|FAILED)\b", b)
        before = b[: m.start()] if m else b
        if m and m.group(1) == "FAILED":
            out[t] = "fail"
        elif "[SKIPPED]" in before:
            out[t] = "skip"
        else:
            out[t] = "pass"
    return out


def counts(out):
    suites = {}
    for t, s in out.items():
        suites.setdefault(t.split(".")[0], {"pass": 0, "fail": 0, "skip": 0})[s] += 1
    return suites


def main():
    files = [a for a in sys.argv[1:] if not a.startswith("--")]
    runs = []
    for f in files:
        label, _, path = f.rpartition("=")
        runs.append((label, results(open(path).read())))
    if "--list" in sys.argv:
        for label, out in runs:
            for t, s in out.items():
                if s != "pass":
                    print(f"{label}: {s} {t}" if label else f"{s} {t}")
        return
    per = [counts(out) for _, out in runs]
    head = " | ".join(
        f"{label + ': ' if label else ''}passed | failed | skipped" for label, _ in runs
    )
    print(f"| suite | tests | {head} |")
    print("| --- | --- |" + " --- | --- | --- |" * len(runs))
    tot = [{"pass": 0, "fail": 0, "skip": 0} for _ in runs]
    names = sorted(per[0], key=lambda s: (s.startswith("iSCSI") or s == "MultipathIO", s))
    for name in names:
        cells = []
        for c, t in zip(per, tot):
            c = c.get(name, {"pass": 0, "fail": 0, "skip": 0})
            for k in t:
                t[k] += c[k]
            cells.append(f"{c['pass']} | {c['fail']} | {c['skip']}")
        print(f"| {name} | {sum(per[0][name].values())} | {' | '.join(cells)} |")
    cells = [f"{t['pass']} | {t['fail']} | {t['skip']}" for t in tot]
    print(f"| **total** | {sum(tot[0].values())} | {' | '.join(cells)} |")


main()
