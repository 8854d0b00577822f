#!/usr/bin/env python3
"""Per-suite counts of an iscsi-test-cu run (its stdout in a file).

    iscsi-test-cu-table.py OUTPUT            # the markdown table
    iscsi-test-cu-table.py OUTPUT --list     # each test that did not pass

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


def main():
    out = results(open(sys.argv[1]).read())
    if "--list" in sys.argv:
        for t, s in out.items():
            if s != "pass":
                print(s, t)
        return
    suites = {}
    for t, s in out.items():
        suites.setdefault(t.split(".")[0], {"pass": 0, "fail": 0, "skip": 0})[s] += 1
    print("| suite | tests | passed | failed | skipped |")
    print("| --- | --- | --- | --- | --- |")
    tot = {"pass": 0, "fail": 0, "skip": 0}
    for name in sorted(suites, key=lambda s: (s.startswith("iSCSI") or s == "MultipathIO", s)):
        c = suites[name]
        for k in tot:
            tot[k] += c[k]
        print(f"| {name} | {sum(c.values())} | {c['pass']} | {c['fail']} | {c['skip']} |")
    print(f"| **total** | {sum(tot.values())} | {tot['pass']} | {tot['fail']} | {tot['skip']} |")


main()
