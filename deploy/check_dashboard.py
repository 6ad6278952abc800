#!/usr/bin/env python3
"""Every metric the dashboard queries must be exported by the code (lockd/, probes/, supervisor/).

Metric names are matched as literal strings in the Rust sources after stripping the
histogram suffixes (_bucket, _sum, _count), so a renamed metric fails CI here instead of
leaving an empty panel. Usage: check_dashboard.py DASHBOARD.json
"""
import json
import pathlib
import re
import sys

dash = json.load(open(sys.argv[1]))
exprs = []


def walk(panels):
    for p in panels:
        exprs.extend(t["expr"] for t in p.get("targets", []))
        walk(p.get("panels", []))


walk(dash["panels"])
exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
names = set()
for e in exprs:
    for m in re.findall(r"\b((?:supervisor|lockd)_[a-z_]+)\b", e):
        names.add(re.sub(r"_(bucket|sum|count)$", "", m))
sources = ""
for crate in ("lockd", "probes", "supervisor"):
    for f in pathlib.Path(crate).rglob("*.rs"):
        sources += f.read_text(errors="replace")
missing = sorted(n for n in names if n not in sources)
for n in sorted(names):
    print(("MISSING " if n in missing else "ok ") + n)
if missing:
    print(f"FAIL: the dashboard queries metrics no crate exports: {missing}")
sys.exit(1 if missing else 0)
