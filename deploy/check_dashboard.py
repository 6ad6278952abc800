#!/usr/bin/env python3
"""Every metric the dashboard queries must be exported by something real.

* The project's own series (supervisor_*, lockd_*) and Dynamo's failover series that the
  supervisor exports (dynamo_component_*) are matched as literal strings in the Rust sources
  (lockd/, probes/, supervisor/) after stripping the histogram suffixes (_bucket, _sum, _count),
  so a renamed metric fails CI here instead of leaving an empty panel.
* The router's series (haproxy_*) come from HAProxy's built-in Prometheus exporter (the chart's
  router config serves it with `http-request use-service prometheus-exporter`). When an haproxy
  binary is present, a tiny config with the same proxy names is run on 127.0.0.1 and scraped:
  every haproxy_* name the dashboard queries must be in the scrape, and every exact label
  matcher of it (proxy="engines", code="5xx", state="UP", ...) must match a sample. Every
  proxy="X" the dashboard names must also be a frontend/backend of the rendered router config
  (deploy/rendered/vllm.yaml) when that file is there. Without haproxy this part prints a SKIP
  line with the reason (the names are then unchecked).

Usage: check_dashboard.py DASHBOARD.json [--haproxy PATH] [--router-config RENDERED.yaml]
"""
import argparse
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent

ap = argparse.ArgumentParser()
ap.add_argument("dashboard")
ap.add_argument("--haproxy", default=None, help="haproxy binary (default: haproxy on $PATH)")
ap.add_argument("--router-config", default=str(ROOT / "deploy/rendered/vllm.yaml"),
                help="a rendered manifest whose router ConfigMap names the proxies")
args = ap.parse_args()

dash = json.load(open(args.dashboard))
exprs = []


def walk(panels):
    for p in panels:
        exprs.extend(t["expr"] for t in p.get("targets", []))
        walk(p.get("panels", []))


walk(dash["panels"])
exprs += [v["query"]["query"] for v in dash["templating"]["list"] if isinstance(v.get("query"), dict)]
failed = False

# 1. Ours: literal names in the sources.
names = set()
for e in exprs:
    for m in re.findall(r"\b((?:supervisor|lockd|dynamo_component)_[a-z_]+)\b", e):
        names.add(re.sub(r"_(bucket|sum|count)$", "", m))
sources = ""
for crate in ("lockd", "probes", "supervisor"):
    for f in (ROOT / crate).rglob("*.rs"):
        sources += f.read_text(errors="replace")
missing = sorted(n for n in names if n not in sources)
for n in sorted(names):
    print(("MISSING " if n in missing else "ok ") + n)
if missing:
    print(f"FAIL: the dashboard queries metrics no crate exports: {missing}")
    failed = True

# 2. The router's: HAProxy's exporter, scraped live.
SELECTOR = re.compile(r"\b(haproxy_[a-z_]+)\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
# Labels that come from the scrape (Kubernetes relabelling), not from HAProxy.
SCRAPE_LABELS = {"namespace", "pod", "instance", "job"}
wanted = {}  # name -> [ {label: value} exact matchers of one selector ]
for e in exprs:
    for name, sel in SELECTOR.findall(e):
        exact = {}
        for k, op, v in MATCHER.findall(sel or ""):
            if op == "=" and k not in SCRAPE_LABELS and "$" not in v:
                exact[k] = v
        wanted.setdefault(name, []).append(exact)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_samples(text):
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
        if m:
            labels = dict((k, v) for k, _, v in MATCHER.findall(m.group(3) or ""))
            out.append((m.group(1), labels))
    return out


def scrape_haproxy(binary, proxies):
    """Run `binary` with the exporter and the dashboard's proxies; return its samples."""
    metrics_port = free_port()
    lines = [
        "global", "  log stderr format raw local0 emerg",
        "defaults", "  mode http", "  timeout connect 1s", "  timeout client 5s", "  timeout server 5s",
        "frontend metrics", f"  bind 127.0.0.1:{metrics_port}",
        "  http-request use-service prometheus-exporter if { path /metrics }",
    ]
    # The frontends/backends the dashboard queries, shaped like the chart's (a frontend with a
    # default backend of two engine servers); both kinds for a name the dashboard does not
    # pin down costs nothing.
    backends = sorted(proxies["backend"])
    for fe in sorted(proxies["frontend"]):
        lines += [f"frontend {fe}", f"  bind 127.0.0.1:{free_port()}"]
        if backends:
            lines.append(f"  default_backend {backends[0]}")
    for be in backends:
        lines += [f"backend {be}", "  option redispatch", "  retries 1",
                  f"  server engine-0 127.0.0.1:{free_port()}", f"  server engine-1 127.0.0.1:{free_port()}"]
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "haproxy.cfg")
        with open(cfg, "w") as f:
            f.write("\n".join(lines) + "\n")
        p = subprocess.Popen([binary, "-db", "-f", cfg], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            text, deadline = None, time.monotonic() + 10
            while time.monotonic() < deadline:
                if p.poll() is not None:
                    raise RuntimeError(f"haproxy exited {p.returncode}: {p.stdout.read().decode(errors='replace')}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as r:
                        text = r.read().decode()
                    break
                except OSError:
                    time.sleep(0.05)
            if text is None:
                raise RuntimeError("haproxy's exporter did not answer within 10 s")
            return parse_samples(text)
        finally:
            p.kill()
            p.wait(timeout=5)


def router_proxies(path):
    """frontend/backend names declared in the router config of a rendered manifest."""
    text = pathlib.Path(path).read_text()
    return set(re.findall(r"^\s*(?:frontend|backend|listen)\s+(\S+)", text, re.M))


if wanted:
    # Which proxies are frontends and which backends: by the series they are queried with.
    proxies = {"frontend": set(), "backend": set()}
    for name, sels in wanted.items():
        kind = "frontend" if name.startswith("haproxy_frontend_") else "backend"
        for s in sels:
            if "proxy" in s:
                proxies[kind].add(s["proxy"])
    if os.path.exists(args.router_config):
        declared = router_proxies(args.router_config)
        for kind in proxies:
            for px in sorted(proxies[kind]):
                if px in declared:
                    print(f"ok proxy {px} ({kind}) is in {os.path.relpath(args.router_config, ROOT)}")
                else:
                    print(f"FAIL: the dashboard queries proxy=\"{px}\" but the router config declares {sorted(declared)}")
                    failed = True
    else:
        print(f"SKIP: proxy names not checked against the router config: {args.router_config} not found")
    binary = args.haproxy or shutil.which("haproxy")
    if binary is None:
        print(f"SKIP: {len(wanted)} haproxy_* names not checked against a live scrape: no haproxy on PATH (apt-get install haproxy)")
    elif not os.access(binary, os.X_OK):
        print(f"FAIL: --haproxy {binary} is not an executable")
        failed = True
    else:
        first = subprocess.run([binary, "-v"], capture_output=True, text=True).stdout.splitlines()[0]
        version = " ".join(first.split()[:3:2])  # "HAProxy 2.6.12-1+deb12u3"
        try:
            samples = scrape_haproxy(binary, proxies)
        except RuntimeError as e:
            print(f"FAIL: {binary}: {e}")
            sys.exit(1)
        router_missing = False
        have = {}
        for n, labels in samples:
            have.setdefault(n, []).append(labels)
        for name in sorted(wanted):
            if name not in have:
                print(f"MISSING {name} (not in a live scrape of {version})")
                router_missing = True
                continue
            for sel in wanted[name]:
                if not any(all(l.get(k) == v for k, v in sel.items()) for l in have[name]):
                    print(f"MISSING {name}{sel}: no sample with these labels in a live scrape of {version}")
                    router_missing = True
                    break
            else:
                print(f"ok {name} (live scrape of {version})")
        if router_missing:
            print("FAIL: the dashboard queries router metrics HAProxy does not export")
            failed = True

sys.exit(1 if failed else 0)
