#!/usr/bin/env python3
"""The rendered pod, run on this machine: every container's command line, env and exec probe
exactly as deploy/rendered/vllm.yaml has them, with only these substitutions:

  * the shared volume /run/failover -> a temp dir; every port -> a free loopback port
    (0.0.0.0 -> 127.0.0.1); the gms sidecar's `--backend cuda` -> `--backend host` (no GPU);
  * the engine command after the supervisor's `--` (vllm serve ...) -> `fake-engine`;
  * the binaries are found on PATH (--bin-dir first), as in the image.

Sidecars start in order and each is gated by its own rendered startupProbe command (as kubelet
does for native sidecars); then both engine containers start at once, then the router with the
rendered HAProxy config. Asserts what the pod promises:

  * lockd and gms pass their startup probes (the rendered flags are accepted by the binaries);
  * exactly one engine becomes Active, the other Standby, both pass /startup, /live 200;
  * the router's /healthz (the pod's readiness) is 200 only while an engine is Active, traffic
    reaches only the Active engine, the engines' sleep/wake endpoints are refused (403);
  * when the Active engine's container dies (SIGKILL of its whole tree) the other one takes over
    and serves through the router within a bounded time, never while standing by;
  * the restart counters land on the shared volume;
  * with no engine Active, /healthz answers 503 within one check period (+ slack).

Usage: pod_e2e.py --bin-dir target/debug [--manifest deploy/rendered/vllm.yaml]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import yaml

PROCS: list[subprocess.Popen] = []
PIDFILES: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids(pidfile: str | None) -> list[int]:
    try:
        return [int(x) for x in open(pidfile).read().split()] if pidfile else []
    except (OSError, ValueError):
        return []


def kill_tree(p: subprocess.Popen, pidfile: str | None) -> None:
    for target in [p.pid] + pids(pidfile):
        for f in (os.killpg, os.kill):
            try:
                f(target, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def http(method: str, port: int, path: str, body: bytes | None = None, timeout: float = 2.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method=method,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None, ""


def state(port: int) -> str | None:
    code, body = http("GET", port, "/state", timeout=0.5)
    try:
        return json.loads(body)["state"] if code == 200 else None
    except (ValueError, KeyError):
        return None


def wait(what: str, limit: float, cond) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {limit}s waiting for {what}")


def complete(port: int):
    code, body = http("POST", port, "/v1/completions", b'{"prompt":"hi","max_tokens":1}', timeout=5)
    try:
        return code, (json.loads(body).get("engine_id") if code == 200 else None)
    except ValueError:
        return code, None


class Pod:
    def __init__(self, manifest: str, tmp: str, bin_dir: str):
        docs = [d for d in yaml.safe_load_all(open(manifest)) if d]
        self.cfg = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["haproxy.cfg"]
        self.spec = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
        self.sock_dir = next(m["mountPath"] for c in self.spec["initContainers"]
                             for m in c.get("volumeMounts", []) if m["name"] == "sockets")
        self.tmp = tmp
        self.run_dir = os.path.join(tmp, "run-failover")
        os.makedirs(self.run_dir)
        self.env = dict(os.environ, PATH=f"{os.path.abspath(bin_dir)}:{os.environ['PATH']}")
        self.ports: dict[int, int] = {}
        self.engine_argv: dict[str, tuple[list[str], dict]] = {}

    def port(self, p: int) -> int:
        return self.ports.setdefault(p, free_port())

    def local(self, text: str) -> str:
        """The substitutions of the module doc, on one argument or script."""
        text = text.replace(self.sock_dir, self.run_dir)
        text = re.sub(r"(0\.0\.0\.0|127\.0\.0\.1):(\d+)", lambda m: f"127.0.0.1:{self.port(int(m.group(2)))}", text)
        return text.replace("--backend cuda", "--backend host")

    def container(self, name: str):
        for c in self.spec["initContainers"] + self.spec["containers"]:
            if c["name"] == name:
                return c
        raise KeyError(name)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        p = subprocess.Popen(argv, stdout=open(os.path.join(self.tmp, f"{name}.log"), "a"),
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env or self.env)
        PROCS.append(p)
        return p

    def exec_probe(self, c) -> bool:
        argv = [self.local(a) for a in c["startupProbe"]["exec"]["command"]]
        t = c["startupProbe"].get("timeoutSeconds", 1)
        try:
            return subprocess.run(argv, env=self.env, capture_output=True, timeout=t).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def start_sidecar(self, name: str) -> subprocess.Popen:
        c = self.container(name)
        assert c.get("restartPolicy") == "Always", f"{name} is not a native sidecar"
        p = self.spawn(name, [self.local(a) for a in c["command"]])
        sp = c["startupProbe"]
        limit = sp["periodSeconds"] * sp["failureThreshold"]
        wait(f"{name} startupProbe (rendered command)", min(limit, 30), lambda: self.exec_probe(c))
        print(f"ok: sidecar {name} started with its rendered command and passed its rendered startupProbe")
        return p

    def router_config(self, haproxy: str, edit=None) -> tuple[str, bool, str]:
        """Write the rendered HAProxy config with this pod's ports and paths (`edit`: a function
        applied to the text, for planted misconfigurations); check it with `haproxy -c`.
        Returns (path, whether `init-state down` is supported, version line)."""
        cfg = re.sub(r"(bind :|127\.0\.0\.1:|check port )(\d+)",
                     lambda m: ("bind 127.0.0.1:" if m.group(1) == "bind :" else m.group(1))
                     + str(self.port(int(m.group(2)))), self.cfg).replace(self.sock_dir, self.run_dir)
        if edit:
            cfg = edit(cfg)
        version = subprocess.run([haproxy, "-v"], capture_output=True, text=True).stdout.splitlines()[0]
        m = re.search(r"version (\d+)\.(\d+)", version)
        has_init_state = bool(m) and (int(m.group(1)), int(m.group(2))) >= (3, 1)
        if not has_init_state:
            # `init-state down` needs HAProxy >= 3.1 (the chart's router image is 3.2).
            assert " init-state down" in cfg
            cfg = cfg.replace(" init-state down", "")
        path = os.path.join(self.tmp, "haproxy.cfg")
        open(path, "w").write(cfg)
        subprocess.run([haproxy, "-c", "-q", "-f", path], check=True)
        return path, has_init_state, version.split(" - ")[0]

    def start_engine(self, name: str, extra: list[str] | None = None, real=None):
        """`real`: (argv given the engine port, extra environment) of a real engine to run
        instead of fake-engine (tests/real-vllm); it writes no pid file."""
        c = self.container(name)
        cmd = c["command"]
        sup = [self.local(a) for a in cmd[:cmd.index("--")]]
        eport = int(re.search(r":(\d+)$", sup[sup.index("--engine-url") + 1]).group(1))
        pport = int(sup[sup.index("--probes") + 1].rsplit(":", 1)[1])
        eid = sup[sup.index("--engine-id") + 1]
        pidfile = os.path.join(self.tmp, f"{name}.pids")
        PIDFILES.append(pidfile)
        if real:
            argv = sup + ["--"] + real[0](eport)
        else:
            argv = sup + ["--", "fake-engine", "--port", str(eport), "--engine-id", eid,
                          "--init", "300ms", "--pid-file", pidfile] + (extra or [])
        env = dict(self.env)
        env.update({e["name"]: self.local(e["value"]) for e in c.get("env", []) if "value" in e})
        if real:
            env.update(real[1])
        p = self.spawn(name, argv, env)
        self.engine_argv[name] = (argv, env)
        return p, pport, pidfile, sup


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--manifest", default="deploy/rendered/vllm.yaml")
    ap.add_argument("--haproxy", default=shutil.which("haproxy") or "haproxy")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pod-e2e-")
    try:
        pod = Pod(a.manifest, tmp, a.bin_dir)
        router = pod.container("router")
        health_path = router["readinessProbe"]["httpGet"]["path"]
        period = router["readinessProbe"]["periodSeconds"]

        # Router config with the same port map as everything else.
        path, has_init_state, version = pod.router_config(a.haproxy)
        front = pod.port(router["ports"][0]["containerPort"])
        health = pod.port(router["readinessProbe"]["httpGet"]["port"])
        if not has_init_state:
            print(f"note: {version} < 3.1: `init-state down` stripped for this run and the "
                  "first check round awaited instead (the router start-up behaviour is NOT covered)")
        print(f"ok: rendered HAProxy config is valid for {version}")

        # kubelet: sidecars in order, each gated by its startup probe; then the containers.
        pod.start_sidecar("lockd")
        pod.start_sidecar("gms")
        engines = {n: pod.start_engine(n) for n in ("engine-0", "engine-1")}
        wait("one engine active and one standby", 30,
             lambda: sorted(state(e[1]) or "" for e in engines.values()) == ["active", "standby"])
        active = next(n for n, e in engines.items() if state(e[1]) == "active")
        standby = next(n for n in engines if n != active)
        for n, e in engines.items():
            assert http("GET", e[1], "/startup")[0] == 200, f"{n} /startup"
            assert http("GET", e[1], "/live")[0] == 200, f"{n} /live"
        roles = {n: e[3][e[3].index("--role") + 1] for n, e in engines.items()}
        print(f"ok: engines started with their rendered supervisor flags: {active} ({roles[active]}) "
              f"active, {standby} ({roles[standby]}) standby")
        active_id = int(active.split("-")[1])

        pod.spawn("router", [a.haproxy, "-db", "-f", path])
        if has_init_state:
            code, _ = complete(front)
            assert code in (None, 503), f"router routed ({code}) before any check passed"
        else:
            time.sleep(period * 1.5)
        wait("router ready", 5 + 2 * period, lambda: http("GET", health, health_path)[0] == 200)
        served = [complete(front) for _ in range(5)]
        assert all(s == (200, active_id) for s in served), f"traffic must go to {active} only: {served}"
        print("ok: router ready; traffic served by the Active engine only")
        for method, deny in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                             ("POST", "/%73leep?level=1"), ("POST", "//sleep")):
            code, _ = http(method, front, deny)
            assert code == 403, f"{deny} through the router answered {code}, want 403"
        assert state(engines[standby][1]) == "standby"
        assert state(engines[active][1]) == "active", "the active engine was put to sleep via the router"
        print("ok: sleep/wake endpoints refused through the router (403); the shadow still sleeps")
        counters = sorted(f for f in os.listdir(pod.run_dir) if f.endswith(".restarts"))
        assert counters == ["engine-0.restarts", "engine-1.restarts"], f"restart counters: {counters}"

        # The active engine's container dies: SIGKILL of its whole tree.
        t0 = time.monotonic()
        p, _, pidfile, _ = engines[active]
        kill_tree(p, pidfile)
        seen = []
        took = None
        while time.monotonic() - t0 < 20:
            code, eid = complete(front)
            seen.append((round(time.monotonic() - t0, 2), code, eid))
            if code == 200:
                assert eid == 1 - active_id, f"served by engine {eid} after {active} died: {seen}"
                assert state(engines[standby][1]) in ("active", None), "served while not Active"
                took = time.monotonic() - t0
                break
            time.sleep(0.05)
        assert took is not None, f"{standby} never served: {seen[-5:]}"
        assert took <= 5 + period, f"failover through the router took {took:.2f}s"
        print(f"ok: failover: {standby} served through the router {took:.2f}s after {active} was killed "
              f"({len(seen) - 1} requests failed meanwhile)")

        t1 = time.monotonic()
        kill_tree(engines[standby][0], engines[standby][2])
        wait("router unready", 2 * period + 3, lambda: http("GET", health, health_path)[0] == 503)
        print(f"ok: /healthz 503 {time.monotonic() - t1:.2f}s after the last engine died")
        return 0
    except (AssertionError, subprocess.CalledProcessError, KeyError, ValueError) as e:
        print(f"FAIL: pod e2e: {e!r}")
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".log"):
                print(f"--- {f}\n" + "".join(open(os.path.join(tmp, f), errors="replace").readlines()[-15:]))
        return 1
    finally:
        for p in PROCS:
            kill_tree(p, None)
        for pf in PIDFILES:
            for pid in pids(pf):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
