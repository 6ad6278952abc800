#!/usr/bin/env python3
"""Consistency checks over the rendered manifests (deploy/rendered/*.yaml).

Schema validation (kubernetes-validate) says each object is well formed; this says the
objects agree with each other and with the supervisor's contract:

  * sockets: the lockd and GMS socket paths are spelled identically by the sidecars, their
    probes and both engine containers, and live on the shared emptyDir (medium Memory);
  * ports: no two listeners in the pod share a port; probes hit the supervisor's --probes port;
    --engine-url names the engine's --port; the router forwards to those same ports;
  * GPUs: one DRA claim (resource.k8s.io/v1, gpu.nvidia.com) per pod, referenced by every
    container that touches the GPUs, and no nvidia.com/gpu requests or limits anywhere;
  * probes: arithmetic between kubelet's probe settings and the supervisor's timeouts.

Usage: check_manifests.py [--supervisor-start DURATION] FILE...
                                         exit 1 with one line per problem; with
                                         --supervisor-start, the engines' startup budget must be
                                         derived from that timeouts.supervisorStartTimeout
       check_manifests.py --self-test FILE   mutate FILE in known-bad ways; each must be caught
"""
from __future__ import annotations

import copy
import os
import re
import sys
from typing import Any

import yaml

GPU_COMMANDS = ("supervisor", "gmsd", "vllm", "python3", "python")
# Longest sensible startup-probe budget of an engine container: the supervisor coming up
# (flags, probes bound, lockd reached, engine spawned), never the model load.
MAX_SUPERVISOR_START = 300


def seconds(text: str) -> float:
    """humantime-style duration -> seconds ("250ms", "10s", "5m", "2h", "7200")."""
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", text.strip())
    if not m:
        raise ValueError(f"not a duration: {text!r}")
    n = int(m.group(1))
    return n * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def flag(args: list[str], name: str) -> str | None:
    """Value of `--name VALUE` (or `--name=VALUE`) in args, before any `--`."""
    for i, a in enumerate(args):
        if a == "--":
            break
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def after_dashdash(args: list[str]) -> list[str]:
    return args[args.index("--") + 1:] if "--" in args else []


def engine_flag(cmd: list[str], name: str) -> str | None:
    """A flag of the engine command (after supervisor's `--`)."""
    return flag(after_dashdash(cmd) + ["--"], name)


class Checker:
    def __init__(self, docs: list[dict[str, Any]], label: str, supervisor_start: float | None = None):
        self.docs = [d for d in docs if d]
        # timeouts.supervisorStartTimeout of the values rendered, when known: the startup budget
        # must be derived from it, tightly (not typed).
        self.supervisor_start = supervisor_start
        self.label = label
        self.errors: list[str] = []

    def err(self, msg: str) -> None:
        self.errors.append(f"{self.label}: {msg}")

    def one(self, kind: str) -> dict[str, Any] | None:
        found = [d for d in self.docs if d.get("kind") == kind]
        if len(found) != 1:
            self.err(f"expected exactly one {kind}, found {len(found)}")
            return None
        return found[0]

    def run(self) -> list[str]:
        dep = self.one("Deployment")
        rct = self.one("ResourceClaimTemplate")
        svc = self.one("Service")
        pdb = self.one("PodDisruptionBudget")
        cm = self.one("ConfigMap")
        if not dep:
            return self.errors
        pod = dep["spec"]["template"]["spec"]
        labels = dep["spec"]["template"]["metadata"].get("labels", {})
        inits = {c["name"]: c for c in pod.get("initContainers", [])}
        mains = {c["name"]: c for c in pod.get("containers", [])}
        engines = [mains[n] for n in sorted(mains) if n.startswith("engine-")]
        allc = list(inits.values()) + list(mains.values())

        # ---- selectors
        if dep["spec"]["selector"]["matchLabels"].items() - labels.items():
            self.err("Deployment selector does not match its pod labels")
        if svc and svc["spec"].get("selector", {}).items() - labels.items():
            self.err("Service selector does not match the pod labels")
        if svc and svc["spec"].get("publishNotReadyAddresses"):
            self.err("Service publishes not-ready addresses: a standing-by pod would get traffic")
        if pdb and pdb["spec"]["selector"]["matchLabels"].items() - labels.items():
            self.err("PodDisruptionBudget selector does not match the pod labels")

        # ---- sidecars
        for name in ("lockd", "gms"):
            c = inits.get(name)
            if not c:
                self.err(f"initContainer {name} missing")
                continue
            if c.get("restartPolicy") != "Always":
                self.err(f"{name}: not a native sidecar (initContainer restartPolicy must be Always)")
            if "startupProbe" not in c:
                self.err(f"{name}: no startupProbe gating the engines on its socket")
        if set(inits) - {"lockd", "gms"}:
            self.err(f"unexpected initContainers {sorted(set(inits) - {'lockd', 'gms'})}")
        if len(engines) != 2:
            self.err(f"expected two engine containers, found {len(engines)}")
            return self.errors

        # ---- the shared socket volume
        vols = {v["name"]: v for v in pod.get("volumes", [])}
        sock_vol = vols.get("sockets", {})
        if sock_vol.get("emptyDir", {}).get("medium") != "Memory":
            self.err("volume 'sockets' must be an emptyDir with medium Memory")

        def mount_dir(c: dict[str, Any]) -> str | None:
            for m in c.get("volumeMounts", []):
                if m["name"] == "sockets":
                    return m["mountPath"]
            return None

        def on_volume(c: dict[str, Any], path: str, what: str) -> None:
            d = mount_dir(c)
            if d is None:
                self.err(f"{c['name']}: uses {what} {path} but does not mount the sockets volume")
            elif not path.startswith(d.rstrip("/") + "/"):
                self.err(f"{c['name']}: {what} {path} is not on the sockets volume ({d})")

        # lockd
        lockd = inits.get("lockd", {})
        lcmd = lockd.get("command", []) + lockd.get("args", [])
        listen = flag(lcmd, "--listen")
        state = flag(lcmd, "--state")
        if not listen or not listen.startswith("unix:"):
            self.err("lockd: no --listen unix:PATH")
        else:
            on_volume(lockd, listen[5:], "lockd socket")
        if not state:
            self.err("lockd: no --state FILE")
        else:
            on_volume(lockd, state, "lockd state file")
        for pname in ("startupProbe", "livenessProbe"):
            p = lockd.get(pname)
            if p:
                pc = p.get("exec", {}).get("command", [])
                if flag(pc, "--connect") != listen:
                    self.err(f"lockd {pname} connects to {flag(pc, '--connect')}, lockd listens on {listen}")

        # gms
        gms = inits.get("gms", {})
        gscript = " ".join(gms.get("command", []) + gms.get("args", []))
        gms_socks = re.findall(r"gmsd\s+--socket\s+(\S+)", gscript)
        if not gms_socks:
            self.err("gms: no `gmsd --socket PATH` in its command")
        if "wait -n" not in gscript:
            self.err("gms: command must exit when any gmsd exits (wait -n)")
        gprobe = " ".join(gms.get("startupProbe", {}).get("exec", {}).get("command", []))
        probed = re.findall(r"gmsctl\s+state\s+--socket\s+(\S+)", gprobe)
        if sorted(probed) != sorted(gms_socks):
            self.err(f"gms startupProbe checks {probed}, gmsd serves {gms_socks}")
        for s in gms_socks:
            on_volume(gms, s, "GMS socket")

        # ---- engines
        ports: dict[int, str] = {}

        def claim_port(port: int, owner: str) -> None:
            if port in ports:
                self.err(f"port {port} used twice: {ports[port]} and {owner}")
            ports[port] = owner

        waking = startup_to = None
        roles = []
        ids = []
        for c in engines:
            n = c["name"]
            cmd = c.get("command", []) + c.get("args", [])
            if cmd[:2] != ["supervisor", "run"]:
                self.err(f"{n}: must run `supervisor run ... -- ENGINE`, runs {cmd[:2]}")
                continue
            if flag(cmd, "--lock") != listen:
                self.err(f"{n}: --lock {flag(cmd, '--lock')} but lockd listens on {listen}")
            elif listen:
                on_volume(c, listen[5:], "lockd socket")
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            eng_socks = (env.get("GMS_SOCKETS") or "").split(",")
            if sorted(eng_socks) != sorted(gms_socks):
                self.err(f"{n}: GMS_SOCKETS {eng_socks} but gmsd serves {gms_socks}")
            for s in eng_socks:
                if s:
                    on_volume(c, s, "GMS socket")
            ids.append(flag(cmd, "--engine-id"))
            roles.append(flag(cmd, "--role"))
            adapter = flag(cmd, "--adapter")
            inner = after_dashdash(cmd)
            if adapter == "vllm":
                if inner[:2] != ["vllm", "serve"] or "--enable-sleep-mode" not in inner:
                    self.err(f"{n}: adapter vllm needs `vllm serve ... --enable-sleep-mode`")
                if env.get("VLLM_SERVER_DEV_MODE") != "1":
                    self.err(f"{n}: adapter vllm needs VLLM_SERVER_DEV_MODE=1 (sleep/wake endpoints)")
            elif adapter == "sglang":
                if "sglang.launch_server" not in inner or "--enable-memory-saver" not in inner:
                    self.err(f"{n}: adapter sglang needs `sglang.launch_server ... --enable-memory-saver`")
            else:
                self.err(f"{n}: unknown --adapter {adapter}")
            # ports: engine (--port), engine-url, probes
            eport = engine_flag(cmd, "--port")
            ehost = engine_flag(cmd, "--host")
            if ehost != "127.0.0.1":
                self.err(f"{n}: engine must bind 127.0.0.1 (its sleep/wake endpoints), binds {ehost}")
            url = flag(cmd, "--engine-url") or ""
            m = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", url)
            if not eport or not m or m.group(1) != eport:
                self.err(f"{n}: --engine-url {url} does not name the engine's --port {eport}")
            probes = flag(cmd, "--probes") or ""
            pm = re.fullmatch(r"0\.0\.0\.0:(\d+)", probes)
            if not pm:
                self.err(f"{n}: --probes must listen on 0.0.0.0:PORT (kubelet probes the pod IP), got {probes}")
                continue
            pport = int(pm.group(1))
            if eport:
                claim_port(int(eport), f"{n} engine")
            claim_port(pport, f"{n} probes")
            for pname, path in (("startupProbe", "/startup"), ("livenessProbe", "/live")):
                p = c.get(pname)
                if not p or "httpGet" not in p:
                    self.err(f"{n}: {pname} must be an httpGet on {path}")
                    continue
                if p["httpGet"].get("path") != path:
                    self.err(f"{n}: {pname} path {p['httpGet'].get('path')}, must be {path}")
                if p["httpGet"].get("port") != pport:
                    self.err(f"{n}: {pname} port {p['httpGet'].get('port')} is not its --probes port {pport}")
            if "readinessProbe" in c:
                self.err(f"{n}: engine containers must not have a readinessProbe: pod readiness is the AND "
                         "of all containers and a standing-by shadow is never ready (the router checks /ready)")
            w = flag(cmd, "--waking-timeout")
            s = flag(cmd, "--startup-timeout")
            if not w or not s:
                self.err(f"{n}: --waking-timeout and --startup-timeout must be set from values")
                continue
            if waking is not None and (seconds(w), seconds(s)) != (waking, startup_to):
                self.err(f"{n}: timeouts differ between the engine containers")
            waking, startup_to = seconds(w), seconds(s)
            sg = flag(cmd, "--stop-grace")
            tgp = pod.get("terminationGracePeriodSeconds", 30)
            if not sg or seconds(sg) + 5 > tgp:
                self.err(f"{n}: --stop-grace {sg} must end 5s before terminationGracePeriodSeconds {tgp}")
            rc = flag(cmd, "--restart-counter")
            if rc:
                on_volume(c, rc, "restart counter")
            self.probe_arithmetic(c, waking, startup_to)
        if sorted(roles) != ["primary", "shadow"]:
            self.err(f"roles must be one primary and one shadow, got {roles}")
        if len(set(ids)) != len(ids):
            self.err(f"engine ids must differ, got {ids}")

        # other listeners
        for c in allc:
            if c in engines:
                continue
            for p in c.get("ports", []):
                claim_port(p["containerPort"], f"{c['name']} {p.get('name', '')}")
        # every declared containerPort of an engine is its probe port
        for c in engines:
            for p in c.get("ports", []):
                if ports.get(p["containerPort"]) != f"{c['name']} probes":
                    self.err(f"{c['name']}: containerPort {p['containerPort']} is not its probe port")

        # ---- GPUs
        claims = pod.get("resourceClaims", [])
        if len(claims) != 1:
            self.err(f"pod must claim the GPUs exactly once (spec.resourceClaims), has {len(claims)}")
        elif rct:
            cl = claims[0]
            if cl.get("resourceClaimTemplateName") != rct["metadata"]["name"]:
                self.err("pod resourceClaim does not name the ResourceClaimTemplate")
            if rct.get("apiVersion") != "resource.k8s.io/v1":
                self.err(f"ResourceClaimTemplate apiVersion {rct.get('apiVersion')}, want resource.k8s.io/v1")
            reqs = rct["spec"]["spec"]["devices"]["requests"]
            if [r.get("exactly", {}).get("deviceClassName") for r in reqs] != ["gpu.nvidia.com"]:
                self.err("ResourceClaimTemplate must request one device set of class gpu.nvidia.com")
            for c in allc:
                cmd0 = (c.get("command") or c.get("args") or [""])[0]
                script = " ".join(c.get("command", []) + c.get("args", []))
                uses_gpu = cmd0 in GPU_COMMANDS or "gmsd" in script
                names = [x.get("name") for x in c.get("resources", {}).get("claims", [])]
                if uses_gpu and cl["name"] not in names:
                    self.err(f"{c['name']}: touches the GPUs but does not reference claim {cl['name']}")
                if not uses_gpu and names:
                    self.err(f"{c['name']}: references a GPU claim it does not need")
        for c in allc:
            res = c.get("resources", {})
            for section in ("limits", "requests"):
                if any("gpu" in k for k in res.get(section, {})):
                    self.err(f"{c['name']}: has a GPU {section} entry; GPUs come from the DRA claim only")

        # ---- two engines on one GPU claim: vLLM's start-up check asks for total x utilization
        # FREE, so a shadow re-arming next to the Active engine needs utilization < 0.5.
        for c in engines:
            cmd = c.get("command", []) + c.get("args", [])
            u = engine_flag(cmd, "--gpu-memory-utilization")
            if u is not None and len(engines) > 1 and float(u) >= 0.5:
                self.err(f"{c['name']}: --gpu-memory-utilization {u}: with two engines on the GPUs a "
                         "re-armed shadow can never start next to the Active one (README, Sizing)")
        # ---- router and Service
        self.check_router(mains.get("router"), cm, engines, svc)
        return self.errors

    def probe_arithmetic(self, c: dict[str, Any], waking: float, startup_to: float) -> None:
        n = c["name"]
        for pname in ("startupProbe", "livenessProbe"):
            p = c.get(pname, {})
            if p.get("timeoutSeconds", 1) > p.get("periodSeconds", 10):
                self.err(f"{n}: {pname} timeoutSeconds > periodSeconds stretches the period")
            if p.get("successThreshold", 1) != 1:
                self.err(f"{n}: {pname} successThreshold must be 1")
        sp = c.get("startupProbe", {})
        period, ft = sp.get("periodSeconds", 10), sp.get("failureThreshold", 3)
        delay = sp.get("initialDelaySeconds", 0)
        # kubelet kills at the ft-th consecutive failure: at the earliest (ft-1)*period after
        # the first probe, which is at initialDelay at the earliest. /startup is 200 once the
        # supervisor is up (seconds); the model load is the supervisor's own --startup-timeout,
        # seen by kubelet through /live (200 in Init until it, 503 after).
        budget = delay + (ft - 1) * period
        if budget < 10:
            self.err(f"{n}: startup budget {budget}s: too short for the supervisor to reach lockd and spawn")
        if budget > MAX_SUPERVISOR_START or budget >= startup_to:
            self.err(f"{n}: startup budget {budget}s is a model-load budget (--startup-timeout {startup_to}s): "
                     f"a restarted engine container would hold the pod NotReady; /startup needs seconds")
        ss = self.supervisor_start
        if ss is not None and not ss <= budget < ss + period:
            self.err(f"{n}: startup budget {budget}s is not derived from supervisorStartTimeout {ss}s "
                     f"(want [{ss}, {ss + period}))")
        if period > 2:
            self.err(f"{n}: startup periodSeconds {period}: a restarted engine container stays NotReady "
                     f"up to a period after its supervisor is up")
        lp = c.get("livenessProbe", {})
        lperiod, lft = lp.get("periodSeconds", 10), lp.get("failureThreshold", 3)
        # A hung wake: /live turns 503 at waking; the first failing probe is within one period,
        # the kill lft-1 periods later: worst case waking + lperiod*lft.
        if lperiod * lft > max(30, waking):
            self.err(f"{n}: liveness needs {lperiod * lft}s of failures to kill; a hung wake or a dead "
                     f"Active engine would hold the lock that long past detection")
        if lft < 2:
            self.err(f"{n}: liveness failureThreshold 1 kills an Active engine on one slow health check")
        if lp.get("initialDelaySeconds", 0) != 0:
            self.err(f"{n}: liveness initialDelaySeconds is useless after a startup probe")
        # A load that never ends: /live turns 503 at --startup-timeout (counted from the spawn,
        # before the startup probe passed), the kill lft-1 periods after the first failing probe.
        # Not before --startup-timeout: the liveness probe alone never kills a loading engine.
        if startup_to < 60:
            self.err(f"{n}: --startup-timeout {startup_to}s is no model-load budget")

    def check_router(self, router, cm, engines, svc) -> None:
        if not router:
            self.err("no router container (the Service target)")
            return
        rp = router.get("readinessProbe", {})
        if rp.get("periodSeconds") != 1:
            self.err("router readinessProbe periodSeconds must be 1 (ready within a second of Active)")
        if not 2 <= rp.get("failureThreshold", 3) <= 3:
            self.err("router readinessProbe failureThreshold must be 2..3: 1 lets a probe that lands in a "
                     "failover's few-millisecond /healthz 503 take the pod NotReady; more keeps a pod with "
                     "no engine Ready for too long")
        if not cm:
            return
        cfg = cm["data"]["haproxy.cfg"]
        m = re.search(r"default-server inter (\d+)s fall (\d+) rise (\d+)", cfg)
        if not m or (int(m.group(1)), int(m.group(3))) != (rp.get("periodSeconds"), rp.get("successThreshold")):
            self.err("router health checks (inter/rise) differ from the readiness numbers")
        elif int(m.group(2)) < 2:
            self.err("router check fall 1: one slow /ready check of a healthy Active engine sends traffic "
                     "to the sleeping shadow")
        self.check_router_push(router, cfg, engines)
        m = re.search(r"http-request deny deny_status 403 unless \{ path_beg ([^}]*)\}", cfg)
        if not m:
            self.err("router must forward an allow-list of paths only (deny ... unless { path_beg ... })")
        else:
            control = ("/sleep", "/wake_up", "/is_sleeping", "/collective_rpc", "/release_memory_occupation",
                       "/resume_memory_occupation", "/update_weights", "/flush_cache")
            for prefix in m.group(1).split():
                if any(c.startswith(prefix.rstrip("/")) and prefix not in ("/v1/",) for c in control):
                    self.err(f"router allows {prefix}, which reaches an engine control endpoint")
        if "option httpchk GET /ready" not in cfg:
            self.err("router must health-check the supervisors' /ready")
        servers = re.findall(r"server (\S+) 127\.0\.0\.1:(\d+) check port (\d+) observe layer4 error-limit 1 "
                             r"on-error mark-down init-state down\n", cfg)
        twins = re.findall(r"server (\S+)-standby 127\.0\.0\.1:(\d+) backup disabled\n", cfg)
        want = []
        for c in engines:
            cmd = c.get("command", []) + c.get("args", [])
            want.append((c["name"], engine_flag(cmd, "--port"),
                         (flag(cmd, "--probes") or ":").rsplit(":", 1)[1]))
        if sorted(servers) != sorted(want):
            self.err(f"router servers {servers} do not match the engines {want}")
        if sorted(twins) != sorted((n, p) for n, p, _ in want):
            self.err(f"router standby (backup) servers {twins} do not match the engines {want}")
        hp = rp.get("httpGet", {}).get("port")
        up = " || ".join(f"{{ srv_is_up(engines/{n}) }}" for n, _, _ in sorted(want))
        if not re.search(rf"bind :{hp}\n(.*\n)*?.*if {{ path /healthz }} {re.escape(up)}\s*\n", cfg):
            self.err("router readinessProbe does not hit the 'an engine is Active' endpoint (srv_is_up of "
                     "every engine's serving server, never a backup: a sleeping shadow is not ready)")
        if svc:
            tp = svc["spec"]["ports"][0]["targetPort"]
            names = {p.get("name"): p["containerPort"] for p in router.get("ports", [])}
            port = names.get(tp, tp)
            if not re.search(rf"frontend openai\n\s+bind :{port}\n", cfg):
                self.err(f"Service targetPort {tp} is not the router's traffic frontend")


    def check_router_push(self, router, cfg: str, engines) -> None:
        """The supervisors push their state to the router's runtime API, and the router retries a
        request whose engine died under it (README "Router")."""
        m = re.search(r"stats socket (\S+) .*level admin", cfg)
        sock = m.group(1) if m else None
        if not sock:
            self.err("router has no admin runtime API socket (stats socket ... level admin)")
        mounts = {v["mountPath"] for v in router.get("volumeMounts", [])}
        if sock and os.path.dirname(sock) not in mounts:
            self.err(f"router socket {sock} is not on a volume the router mounts")
        for c in engines:
            cmd = c.get("command", []) + c.get("args", [])
            if flag(cmd, "--router-socket") != sock:
                self.err(f"{c['name']}: --router-socket {flag(cmd, '--router-socket')} is not the router's {sock}")
            if flag(cmd, "--router-server") != f"engines/{c['name']}":
                self.err(f"{c['name']}: --router-server {flag(cmd, '--router-server')} is not engines/{c['name']}")
            emounts = {v["mountPath"] for v in c.get("volumeMounts", [])}
            if sock and os.path.dirname(sock) not in emounts:
                self.err(f"{c['name']}: the router socket's volume is not mounted")
        r = re.search(r"retry-on ([^\n]*)", cfg)
        kinds = set(r.group(1).split()) if r else set()
        if not {"conn-failure", "empty-response"} <= kinds:
            self.err("router does not retry a request whose engine died (retry-on conn-failure empty-response)")
        if "response-timeout" in kinds or "all-retryable-errors" in kinds:
            self.err("router retries timed-out requests (a 10-minute generation run twice)")
        n = re.search(r"\n\s*retries (\d+)", cfg)
        if not n or int(n.group(1)) < 1:
            self.err("router retries 0 times")
        if not re.search(r"option redispatch 1\n", cfg):
            self.err("router retries on the same (dead) server: option redispatch 1 missing")
        if "option http-buffer-request" not in cfg:
            self.err("router does not buffer request bodies: a POST cannot be replayed")
        t = re.search(r"timeout connect (\d+)(ms|s)\n", cfg)
        if not t or int(t.group(1)) * (1 if t.group(2) == "ms" else 1000) > 100:
            self.err("router timeout connect > 100ms: HAProxy pauses min(timeout connect, 1s) before a retry")


def load(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return list(yaml.safe_load_all(f))


def mutations(docs):
    """(description, mutated docs) pairs, each of which the checker must reject."""
    def dep(d):
        return next(x for x in d if x and x["kind"] == "Deployment")["spec"]["template"]["spec"]

    def eng(d, i):
        return next(c for c in dep(d)["containers"] if c["name"] == f"engine-{i}")

    def setflag(cmd, name, value):
        cmd[cmd.index(name) + 1] = value

    out = []
    d = copy.deepcopy(docs)
    setflag(eng(d, 1)["command"], "--lock", "unix:/run/failover/lock.sock")
    out.append(("shadow spells the lockd socket differently", d))
    d = copy.deepcopy(docs)
    eng(d, 1)["livenessProbe"]["httpGet"]["port"] = eng(d, 0)["livenessProbe"]["httpGet"]["port"]
    setflag(eng(d, 1)["command"], "--probes", eng(d, 0)["command"][eng(d, 0)["command"].index("--probes") + 1])
    out.append(("both engines on one probe port", d))
    d = copy.deepcopy(docs)
    eng(d, 1)["resources"].pop("claims")
    out.append(("shadow does not reference the GPU claim", d))
    d = copy.deepcopy(docs)
    eng(d, 0)["resources"].setdefault("limits", {})["nvidia.com/gpu"] = 1
    out.append(("a GPU limit next to the claim", d))
    d = copy.deepcopy(docs)
    eng(d, 0)["startupProbe"]["failureThreshold"] = 721
    eng(d, 0)["startupProbe"]["periodSeconds"] = 10
    out.append(("startup probe sized for the 2h model load (the old design: pod NotReady for a reload)", d))
    d = copy.deepcopy(docs)
    eng(d, 1)["startupProbe"]["periodSeconds"] = 1
    eng(d, 1)["startupProbe"]["failureThreshold"] = 2
    out.append(("startup budget of 1s: the supervisor cannot reach lockd in time", d))
    d = copy.deepcopy(docs)
    eng(d, 1)["readinessProbe"] = {"httpGet": {"path": "/ready", "port": 9001}, "periodSeconds": 1}
    out.append(("readinessProbe on the standing-by shadow", d))
    d = copy.deepcopy(docs)
    eng(d, 0)["livenessProbe"]["httpGet"]["path"] = "/ready"
    out.append(("liveness on /ready kills the healthy Standby", d))
    d = copy.deepcopy(docs)
    next(c for c in dep(d)["initContainers"] if c["name"] == "gms").pop("restartPolicy")
    out.append(("gms as a plain init container", d))
    d = copy.deepcopy(docs)
    e = eng(d, 1)
    e["env"] = [x for x in e["env"] if x["name"] != "GMS_SOCKETS"] + [{"name": "GMS_SOCKETS", "value": "/tmp/gms-0.sock"}]
    out.append(("shadow names a GMS socket off the shared volume", d))
    d = copy.deepcopy(docs)
    cm = next(x for x in d if x and x["kind"] == "ConfigMap")
    cm["data"]["haproxy.cfg"] = cm["data"]["haproxy.cfg"].replace("path_beg /v1/", "path_beg /v1/ /sleep")
    out.append(("router forwards /sleep", d))
    d = copy.deepcopy(docs)
    c = eng(d, 0)["command"]
    if "--gpu-memory-utilization" in c:
        c[c.index("--gpu-memory-utilization") + 1] = "0.85"
        out.append(("vLLM sized for one engine per GPU (0.85): the shadow never re-arms", d))

    def cfg_edit(d, a, b):
        cm = next(x for x in d if x and x["kind"] == "ConfigMap")
        assert a in cm["data"]["haproxy.cfg"], a
        cm["data"]["haproxy.cfg"] = cm["data"]["haproxy.cfg"].replace(a, b)
    for desc, a, b in [
        ("router without L7 retries", "retry-on conn-failure empty-response", "retry-on 503"),
        ("router retries on the same dead server", "option redispatch 1", "option redispatch -1"),
        ("router without a standby (backup) server", "-standby 127.0.0.1:8001 backup disabled", "-standby 127.0.0.1:8001 disabled"),
        ("router /healthz counts backup servers (a sleeping shadow makes the pod Ready)",
         "{ srv_is_up(engines/engine-0) } || { srv_is_up(engines/engine-1) }", "{ nbsrv(engines) ge 1 }"),
        ("router check fall 1", "fall 3", "fall 1"),
        ("router pauses 1s before a retry", "timeout connect 5ms", "timeout connect 2s"),
    ]:
        d = copy.deepcopy(docs)
        cfg_edit(d, a, b)
        out.append((desc, d))
    d = copy.deepcopy(docs)
    c = eng(d, 1)["command"]
    i = c.index("--router-socket")
    del c[i:i + 4]
    out.append(("shadow does not push its state to the router", d))
    d = copy.deepcopy(docs)
    r = next(c for c in dep(d)["containers"] if c["name"] == "router")
    r["volumeMounts"] = [v for v in r["volumeMounts"] if v["name"] != "sockets"]
    out.append(("router socket not on the shared volume", d))
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--self-test"]:
        docs = load(argv[1])
        assert not Checker(docs, argv[1]).run(), "self-test needs a clean manifest"
        bad = 0
        for desc, d in mutations(docs):
            errs = Checker(d, "mutant").run()
            print(f"{'caught' if errs else 'MISSED'}: {desc}" + (f" -> {errs[0]}" if errs else ""))
            bad += not errs
        return 1 if bad else 0
    errors = []
    supervisor_start = None
    if argv[:1] == ["--supervisor-start"]:
        supervisor_start, argv = seconds(argv[1]), argv[2:]
    for path in argv:
        errs = Checker(load(path), path, supervisor_start).run()
        errors += errs
        if not errs:
            print(f"ok: {path}")
    for e in errors:
        print(f"FAIL {e}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
