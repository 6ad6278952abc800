#!/usr/bin/env python3
"""Pod-level failover drill: failover as the pod's users see it.

Runs the rendered pod on this machine exactly as deploy/pod_e2e.py does (the chart's commands,
flags and HAProxy router config; fake engines; Debian's HAProxy), drives a steady completion
load through the router from N concurrent clients, and kills the Active side round after round.
Reports what a user of the pod sees:

  * kill -> first completion served by the new engine through the router (median, p99, max);
  * failed requests (count and kinds: HTTP status or connection error);
  * client latency: p99 of requests in flight during a failover vs steady state;
  * the time the router's /healthz (the pod's readiness) answered 503 after it was first
    ready, and the time a killed engine CONTAINER was down (kill -> its restarted supervisor
    answers /startup), which kubelet counts as the pod NotReady (see deploy/README.md).

Kinds (the drill's kinds that exist at pod level):
  engine-kill      SIGKILL of the Active engine's main process (its worker is detached and
                   outlives it: every engine here runs --workers 1 --detach-workers, so this is
                   also the drill's detached-worker kind); the supervisor fences and re-arms.
  supervisor-kill  the Active engine's whole container dies (supervisor, engine, workers:
                   SIGKILL of every process, as a cgroup kill); "kubelet" restarts it at once.
  double-kill      the Active engine's main process, then 0-5 ms later its whole container.
  revoke           `lockd revoke` of the Active side's lease: it fences itself and re-arms.
  lockd-crash      the lockd sidecar is SIGKILLed and restarted on its state file: the Active
                   side reclaims its lease; no failover may happen and no request may fail.
  stop             SIGTERM of the Active supervisor (a rollout, kubelet stopping the container):
                   it stops its engine and exits 0; "kubelet" starts the container again.
  engine-child-kill, worker-kill  (--engine vllm only) SIGKILL of the Active vLLM's
                   EngineCore / of its Worker: vLLM reports itself dead on /health and the
                   supervisor fences it (--unhealthy-after).
Not covered: hung-wake (the chart's waking timeout is minutes) and the drill's compound lockd
kinds; `supervisor drill` covers those below the router.

`--engine vllm` runs a real vLLM (its CPU build and tiny model, prepared by
tests/real-vllm/setup) in each engine container instead of fake-engine; the clients then ask
for `--model` at temperature 0. Which engine served a request is read from a header the
drill's copy of the router config adds (x-served-by: the HAProxy server name).

  deploy/pod_drill.py --bin-dir target/release --rounds 200 --clients 8 --report r.json

Exit status: 0 when no request failed and every round recovered; 1 otherwise; 2 on bad usage.
`--plant no-retry|no-push` runs with a deliberately broken router setup (no L7 retries / no
supervisor push) to show that the drill catches it (expect exit 1).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pod_e2e as pe  # noqa: E402

KINDS = ["engine-kill", "supervisor-kill", "double-kill", "revoke", "lockd-crash", "stop",
         "engine-child-kill", "worker-kill"]
DEFAULT_KINDS = ["engine-kill", "supervisor-kill", "double-kill", "revoke", "lockd-crash"]
VLLM_ONLY = {"engine-child-kill", "worker-kill"}
FAILOVER = {"engine-kill", "supervisor-kill", "double-kill", "revoke", "stop", "engine-child-kill",
            "worker-kill"}
# How tests/real-vllm starts vLLM's CPU build (harness/src/vllm.rs, RealVllm::argv / env).
VLLM_ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_argv(real_dir: str, model: str):
    def argv(port: int) -> list[str]:
        return [os.path.join(real_dir, "venv/bin/python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", os.path.join(real_dir, "model"), "--served-model-name", model,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                "--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes", "67108864",
                "--disable-uvicorn-access-log"]
    return argv


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def vllm_victim(sup_pid: int, kind: str) -> int | None:
    """The Active vLLM's process for `kind`: its API server (the supervisor's child), its
    EngineCore, or a Worker."""
    want = {"engine-kill": "vllm.entrypoints.openai.api_server", "engine-child-kill": "VLLM::EngineCore",
            "worker-kill": "VLLM::Worker"}[kind]
    return next((p for p in proc_tree(sup_pid)[1:] if want in cmdline(p)), None)


def pct(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile (the project's definition, harness::stats::percentile)."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(1, -(-len(s) * p // 100))
    return s[int(k) - 1]


def admin(sock: str, cmd: str) -> str:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    try:
        s.connect(sock)
        s.sendall((cmd + "\n").encode())
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out.decode(errors="replace")
    finally:
        s.close()


def router_view(sock: str) -> dict[str, tuple[int, int]]:
    """server name -> (operational state: 2 = up, admin state: 0 = ready) from the runtime API."""
    view = {}
    try:
        text = admin(sock, "show servers state engines")
    except OSError:
        return view
    for line in text.splitlines():
        f = line.split()
        if len(f) > 6 and f[0].isdigit() and f[1] == "engines":
            view[f[3]] = (int(f[5]), int(f[6]))
    return view


# HAProxy server admin-state bits (include/haproxy/server-t.h): 0x01 forced maintenance (CLI),
# 0x04 configured maintenance (`disabled`; kept as a record once the CLI set the server ready),
# 0x02/0x20/0x40 maintenance inherited/resolver/health-based, 0x08/0x10 drain.
def in_rotation(view, name: str) -> bool:
    op, adm = view.get(name, (0, 1))
    return op == 2 and adm & ~0x04 == 0


def forced_out(view, name: str) -> bool:
    return bool(view.get(name, (0, 0))[1] & 0x01)


def proc_tree(root: int) -> list[int]:
    """root and every descendant (from /proc), for a container-style kill of everything."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                parent[int(d)] = int(stat[stat.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(c for c, pp in parent.items() if pp == p)
    return out


def sigkill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class Load:
    """N clients posting completions through the router, each recording every request."""

    def __init__(self, port: int, clients: int, model: str | None = None):
        self.port, self.stop, self.lock = port, False, threading.Lock()
        self.body = json.dumps({"prompt": "hi", "max_tokens": 1} if model is None else
                               {"model": model, "prompt": "hi", "max_tokens": 1, "temperature": 0}).encode()
        self.records: list[tuple[float, float, str, int | None]] = []  # start, end, outcome, engine
        self.threads = [threading.Thread(target=self.client, daemon=True) for _ in range(clients)]

    def client(self) -> None:
        body = self.body
        while not self.stop:
            t0 = time.monotonic()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                         method="POST", headers={"content-type": "application/json"})
            eid = None
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    doc = json.loads(r.read())
                    eid = doc.get("engine_id")
                    m = re.match(r"engine-(\d+)", r.headers.get("x-served-by") or "")
                    if eid is None and m:
                        eid = int(m.group(1))
                    outcome = "ok" if not doc.get("garbage") else "garbage"
            except urllib.error.HTTPError as e:
                outcome = f"http-{e.code}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = getattr(e, "reason", e)
                outcome = f"error-{type(reason).__name__}"
            with self.lock:
                self.records.append((t0, time.monotonic(), outcome, eid))

    def snapshot(self):
        with self.lock:
            return list(self.records)


class HealthWatch:
    """Polls the router's /healthz every 10 ms; keeps the 503 intervals after the first 200."""

    def __init__(self, port: int, path: str):
        self.port, self.path, self.stop = port, path, False
        self.first_ready: float | None = None
        self.down: list[tuple[float, float]] = []
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        since = None
        while not self.stop:
            code, _ = pe.http("GET", self.port, self.path, timeout=1)
            now = time.monotonic()
            if code == 200:
                self.first_ready = self.first_ready or now
                if since is not None:
                    self.down.append((since, now))
                    since = None
            elif self.first_ready is not None and since is None:
                since = now
            time.sleep(0.01)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--manifest", default="deploy/rendered/vllm.yaml")
    ap.add_argument("--haproxy", default=shutil.which("haproxy") or "haproxy")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help="comma-separated, from: " + ", ".join(KINDS))
    ap.add_argument("--engine", choices=["fake", "vllm"], default="fake",
                    help="fake-engine, or a real vLLM prepared by tests/real-vllm/setup")
    ap.add_argument("--real-vllm", default=os.environ.get("REAL_VLLM_DIR", "target/real-vllm"),
                    help="tests/real-vllm/setup's directory (venv/, model/)")
    ap.add_argument("--model", default="tiny", help="--served-model-name of the real vLLM")
    ap.add_argument("--completion-time", default="20ms", help="fake-engine time per completion")
    ap.add_argument("--wake", default="0s", help="fake-engine wake time")
    ap.add_argument("--order", choices=["round-robin", "random"], default="round-robin")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--report", help="write the JSON report here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs) on failure")
    ap.add_argument("--plant", choices=["no-retry", "no-push"], help="break the router setup on purpose")
    a = ap.parse_args()
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not kinds or any(k not in KINDS for k in kinds) or a.rounds < 1 or a.clients < 1:
        ap.error(f"--kinds from {KINDS}, --rounds >= 1, --clients >= 1")
    if a.engine == "fake" and VLLM_ONLY & set(kinds):
        ap.error(f"{sorted(VLLM_ONLY & set(kinds))} need --engine vllm")
    real = None
    if a.engine == "vllm":
        if not os.path.exists(os.path.join(a.real_vllm, "model", ".made-by")):
            print(f"FAIL: no real vLLM in {a.real_vllm!r} (run tests/real-vllm/setup)")
            return 1
        real = (vllm_argv(os.path.abspath(a.real_vllm), a.model), VLLM_ENV)
    # A cold vLLM start takes about a minute on 2 cores (two engines: more); fake-engine 300 ms.
    up_limit = 600 if real else 90
    if not shutil.which(a.haproxy) and not os.path.exists(a.haproxy):
        print(f"FAIL: no haproxy at {a.haproxy!r} (apt-get install haproxy)")
        return 1
    seed = a.seed if a.seed is not None else int(time.time() * 1000)
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="pod-drill-")
    load = health = None
    try:
        pod = pe.Pod(a.manifest, tmp, a.bin_dir)
        router = pod.container("router")
        def edit(c: str) -> str:
            # Which engine served each request (the drill's own measurement, not the chart's).
            c = c.replace("backend engines\n", "backend engines\n  http-response set-header x-served-by %[srv_name]\n", 1)
            if a.plant == "no-retry":
                c = c.replace("retry-on conn-failure empty-response junk-response 502 503", "retry-on none")
            return c
        path, _, version = pod.router_config(a.haproxy, edit)
        sock = os.path.join(pod.run_dir, "router.sock")
        front = pod.port(router["ports"][0]["containerPort"])
        hport = pod.port(router["readinessProbe"]["httpGet"]["port"])
        hpath = router["readinessProbe"]["httpGet"]["path"]
        rprobe = (router["readinessProbe"].get("periodSeconds", 10), router["readinessProbe"].get("failureThreshold", 3))
        lockd = pod.start_sidecar("lockd")
        pod.start_sidecar("gms")
        extra = ["--completion-time", a.completion_time, "--wake", a.wake, "--workers", "1", "--detach-workers"]
        engines = {n: list(pod.start_engine(n, extra, real)) for n in ("engine-0", "engine-1")}
        if a.plant == "no-push":
            for n, e in engines.items():
                pe.kill_tree(e[0], e[2])
                argv, env = pod.engine_argv[n]
                i = argv.index("--router-socket")
                argv = argv[:i] + argv[i + 4:]
                pod.engine_argv[n] = (argv, env)
                e[0] = pod.spawn(n, argv, env)
        pod.spawn("router", [a.haproxy, "-db", "-f", path])
        lock_ep = next(x for x in engines["engine-0"][3] if x.startswith("unix:"))

        def steady(limit: float):
            """Both engines up (one Active, one Standby) and the router in line with them."""
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline:
                for n, e in engines.items():
                    if e[0].poll() is not None:
                        # kubelet would restart it (and the pod would be NotReady meanwhile):
                        # a supervisor only exits on a crash loop or a bug, never in a drill.
                        raise AssertionError(f"{n}: supervisor exited with {e[0].returncode}")
                st = {n: pe.state(e[1]) for n, e in engines.items()}
                if sorted(v or "" for v in st.values()) == ["active", "standby"]:
                    act = next(n for n, v in st.items() if v == "active")
                    sby = next(n for n in engines if n != act)
                    v = router_view(sock)
                    if in_rotation(v, act) and in_rotation(v, f"{sby}-standby") and \
                            forced_out(v, sby) and forced_out(v, f"{act}-standby"):
                        return act, sby
                    if a.plant == "no-push" and pe.http("GET", hport, hpath)[0] == 200:
                        return act, sby
                time.sleep(0.02)
            raise AssertionError(f"no steady state within {limit}s: {st} router {router_view(sock)}")

        def restart_container(name: str) -> float:
            """kubelet: the container's processes all die; it is started again at once."""
            e = engines[name]
            sigkill(proc_tree(e[0].pid) + pe.pids(e[2]))
            e[0].wait(timeout=10)
            t = time.monotonic()
            argv, env = pod.engine_argv[name]
            e[0] = pod.spawn(name, argv, env)
            return t

        def stop_container(name: str) -> float:
            """kubelet stops the container (SIGTERM to its main process, the supervisor), waits
            for it to exit and, the pod's restartPolicy being Always, starts it again."""
            e = engines[name]
            e[0].send_signal(signal.SIGTERM)
            code = e[0].wait(timeout=60)
            if code != 0:
                raise AssertionError(f"{name}: a stopped supervisor exited {code}")
            t = time.monotonic()
            argv, env = pod.engine_argv[name]
            e[0] = pod.spawn(name, argv, env)
            return t

        def engine_main(name: str) -> int:
            e = engines[name]
            if real:
                p = vllm_victim(e[0].pid, "engine-kill")
                if p is None:
                    raise AssertionError(f"{name}: no vLLM API server under its supervisor")
                return p
            return pe.pids(e[2])[0]

        act, sby = steady(up_limit)
        pe.wait("router /healthz ready", 10, lambda: pe.http("GET", hport, hpath)[0] == 200)
        print(f"pod up: {act} active, {sby} standby; router {version}; {a.clients} clients, "
              f"completion {a.completion_time}, wake {a.wake}, seed {seed}"
              + (f"; PLANTED: {a.plant}" if a.plant else ""))
        load = Load(front, a.clients, a.model if real else None)
        health = HealthWatch(hport, hpath)
        for t in load.threads:
            t.start()
        health.thread.start()
        time.sleep(0.5)
        rounds = []
        for i in range(a.rounds):
            kind = rng.choice(kinds) if a.order == "random" else kinds[i % len(kinds)]
            act, sby = steady(up_limit)
            time.sleep(rng.uniform(0.05, 0.25))
            victim = engine_main(act) if kind in ("engine-kill", "double-kill") else \
                vllm_victim(engines[act][0].pid, kind) if kind in VLLM_ONLY else None
            if kind in VLLM_ONLY and victim is None:
                raise AssertionError(f"{act}: no process for {kind}")
            t0 = time.monotonic()
            restarted_at = None
            if kind in ("engine-kill", "engine-child-kill", "worker-kill"):
                sigkill([victim])
            elif kind == "supervisor-kill":
                restarted_at = restart_container(act)
            elif kind == "stop":
                restarted_at = stop_container(act)
            elif kind == "double-kill":
                sigkill([victim])
                time.sleep(rng.uniform(0, 0.005))
                restarted_at = restart_container(act)
            elif kind == "revoke":
                subprocess.run(["lockd", "revoke", "--connect", lock_ep, "--resource", "engine",
                                "--reason", "pod drill"], env=pod.env, check=True, capture_output=True, timeout=10)
            elif kind == "lockd-crash":
                sigkill([lockd.pid])
                lockd.wait(timeout=10)
                lockd = pod.start_sidecar("lockd")
            down_for = None
            if kind in FAILOVER:
                # Its /state may still say active for a moment (a killed engine is noticed
                # within milliseconds, a revoke when lockd's message arrives).
                pe.wait(f"{act} to leave active after {kind}", 30, lambda: pe.state(engines[act][1]) != "active")
            if restarted_at is not None:
                pe.wait(f"{act} restarted supervisor /startup", 30,
                        lambda: pe.http("GET", engines[act][1], "/startup", timeout=0.5)[0] == 200)
                down_for = time.monotonic() - t0
            new_act, _ = steady(up_limit)
            t_end = time.monotonic()
            recs = [r for r in load.snapshot() if r[1] >= t0]
            new_id = int(new_act.split("-")[1])
            served = [r[1] for r in recs if r[2] == "ok" and r[3] == new_id]
            rounds.append({
                "round": i, "kind": kind, "killed": act, "new_active": new_act,
                "failover": new_act != act,
                "served_ms": (min(served) - t0) * 1000 if served and new_act != act else None,
                "recovered_ms": (t_end - t0) * 1000,
                "container_down_ms": down_for * 1000 if down_for else None,
                "t0": t0,
            })
            if kind in FAILOVER and new_act == act:
                rounds[-1]["error"] = "no failover"
            if kind == "lockd-crash" and new_act != act:
                rounds[-1]["error"] = "lockd crash moved the lease"
            if (i + 1) % 10 == 0 or i + 1 == a.rounds:
                print(f"  round {i + 1}/{a.rounds}")
        time.sleep(0.3)
    except (AssertionError, subprocess.CalledProcessError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
        print(f"FAIL: pod drill: {e!r}")
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".log") and f != "router.log":
                lines = [x for x in open(os.path.join(tmp, f), errors="replace").readlines() if x.strip()]
                print(f"--- {f}\n" + "".join(lines[-25:]))
        if a.keep:
            keep = tmp + ".kept"
            shutil.copytree(tmp, keep, dirs_exist_ok=True,
                            ignore=lambda d, names: [n for n in names if n.endswith(".sock")])
            print(f"logs kept in {keep}")
        return 1
    finally:
        if load:
            load.stop = True
            for t in load.threads:
                t.join(timeout=35)
        if health:
            health.stop = True
            health.thread.join(timeout=5)
        for p in pe.PROCS:
            sigkill(proc_tree(p.pid))
            pe.kill_tree(p, None)
        for pf in pe.PIDFILES:
            sigkill(pe.pids(pf))
        shutil.rmtree(tmp, ignore_errors=True)

    # ---- report
    recs = load.snapshot()
    failed = [r for r in recs if r[2] != "ok"]
    kinds_failed: dict[str, int] = {}
    for r in failed:
        kinds_failed[r[2]] = kinds_failed.get(r[2], 0) + 1
    served = [r["served_ms"] for r in rounds if r["served_ms"] is not None]
    windows = [(r["t0"], r["t0"] + (r["served_ms"] or 0) / 1000) for r in rounds if r["failover"]]
    during = [x[1] - x[0] for x in recs if x[2] == "ok" and any(x[0] <= w1 and x[1] >= w0 for w0, w1 in windows)]
    busy = [(r["t0"] - 0.05, r["t0"] + r["recovered_ms"] / 1000) for r in rounds]
    steady_lat = [x[1] - x[0] for x in recs if x[2] == "ok" and not any(x[0] <= b1 and x[1] >= b0 for b0, b1 in busy)]
    down = [b - s for s, b in health.down]
    cdown = [r["container_down_ms"] for r in rounds if r["container_down_ms"] is not None]
    errors = [r for r in rounds if "error" in r]
    by_kind = {}
    for k in kinds:
        rs = [r for r in rounds if r["kind"] == k]
        sv = [r["served_ms"] for r in rs if r["served_ms"] is not None]
        by_kind[k] = {"rounds": len(rs), "served_ms_median": pct(sv, 50), "served_ms_p99": pct(sv, 99),
                      "served_ms_max": max(sv) if sv else None}
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"\npod drill: {len(rounds)} rounds, {len(recs)} requests, {len(failed)} failed {kinds_failed or ''}")
    print(f"{'kind':<16} {'rounds':>6} {'served median':>14} {'p99':>8} {'max':>8}  (ms, kill -> first completion by the new engine)")
    for k, v in by_kind.items():
        print(f"{k:<16} {v['rounds']:>6} {fmt(v['served_ms_median']):>14} {fmt(v['served_ms_p99']):>8} {fmt(v['served_ms_max']):>8}")
    print(f"{'all failovers':<16} {len(served):>6} {fmt(pct(served, 50)):>14} {fmt(pct(served, 99)):>8} "
          f"{fmt(max(served) if served else None):>8}")
    print(f"client latency p99: steady {fmt((pct(steady_lat, 99) or 0) * 1000)} ms ({len(steady_lat)} requests), "
          f"during failovers {fmt((pct(during, 99) or 0) * 1000)} ms ({len(during)} requests)")
    print(f"router /healthz 503 after first ready: {len(down)} times, total {sum(down) * 1000:.1f} ms, "
          f"max {max(down, default=0) * 1000:.1f} ms")
    # kubelet marks the pod NotReady after F consecutive failed probes P apart: a 503 window
    # can only do that if it is at least (F-1)*P long (and any window can if F is 1).
    need = (rprobe[1] - 1) * rprobe[0]
    not_ready = [d for d in down if d >= need]
    print(f"kubelet (readiness every {rprobe[0]}s, failureThreshold {rprobe[1]}) would mark the pod NotReady "
          f"for router /healthz: {len(not_ready)} times")
    print(f"engine container down (kill -> restarted supervisor's /startup 200; kubelet: pod NotReady): "
          f"{len(cdown)} times, median {fmt(pct(cdown, 50))} ms, max {fmt(max(cdown) if cdown else None)} ms")
    for r in errors:
        print(f"ROUND ERROR: round {r['round']} {r['kind']}: {r['error']}")
    report = {"seed": seed, "rounds": rounds, "requests": len(recs), "failed": len(failed),
              "failed_kinds": kinds_failed, "by_kind": by_kind, "plant": a.plant,
              "served_ms": {"median": pct(served, 50), "p99": pct(served, 99), "max": max(served) if served else None},
              "latency_p99_ms": {"steady": (pct(steady_lat, 99) or 0) * 1000, "failover": (pct(during, 99) or 0) * 1000},
              "healthz_503_ms": {"count": len(down), "total": sum(down) * 1000, "max": max(down, default=0) * 1000},
              "pod_not_ready_by_router": len(not_ready),
              "container_down_ms": cdown, "completion_time": a.completion_time, "clients": a.clients,
              "engine": a.engine,
              "haproxy": version}
    if a.report:
        with open(a.report, "w") as f:
            json.dump(report, f, indent=1)
    if not recs or not rounds:
        print("FAIL: no requests or no rounds recorded")
        return 1
    if failed or errors:
        print(f"FAIL: {len(failed)} failed requests, {len(errors)} round errors")
        return 1
    print("ok: no request failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
