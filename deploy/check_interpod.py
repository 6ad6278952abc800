#!/usr/bin/env python3
"""Consistency checks of the chart's inter-pod mode render (deploy/rendered/interpod.yaml).

The single-pod checks (deploy/check_manifests.py) assume one Deployment with two engines;
the inter-pod mode renders a primary and a shadow Deployment with one engine each, every pod
with a lockd sidecar on etcd. Checked here, from the rendered manifest only:

* two Deployments, `*-primary` (1 replica, `--role primary`) and `*-shadow` (`--role shadow`),
  each with its own selector (component label) under the Service's selector;
* every lockd: `--backend etcd`, `--etcd-endpoints` set, `--etcd-node $(POD_NAME)` with
  POD_NAME from the downward API, no `--state` (the file backend's);
* every engine container: `--engine-id 0`, `--holder $(POD_NAME)`, the lock on the pod's own
  lockd socket, `--lock-watchdog` at most 2/3 of (TTL - margin) (docs/ETCD.md: margin = TTL x
  1% + lockd's pause 100 ms + `--etcd-kill-time`), `--publish-key` with POD_IP when set;
* the router config has exactly one engine server (and its standby twin).

Usage: check_interpod.py MANIFEST [--self-test]
"""

import re
import sys

import yaml


class Bad(Exception):
    """A manifest that breaks a check."""


def fail(msg):
    raise Bad(msg)


def dur_ms(s):
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", str(s))
    if not m:
        fail(f"not a duration: {s!r}")
    n, unit = int(m.group(1)), m.group(2) or "s"
    return n * {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}[unit]


def flag(cmd, name):
    if name not in cmd:
        return None
    i = cmd.index(name)
    return cmd[i + 1] if i + 1 < len(cmd) else None


def env_names(c):
    return {e["name"]: e for e in c.get("env", [])}


def check(docs):
    deps = [d for d in docs if d.get("kind") == "Deployment"]
    if len(deps) != 2:
        fail(f"expected a primary and a shadow Deployment, found {len(deps)}")
    svc = [d for d in docs if d.get("kind") == "Service"]
    if len(svc) != 1:
        fail("expected one Service")
    sel = svc[0]["spec"]["selector"]
    roles = {}
    for d in deps:
        name = d["metadata"]["name"]
        role = "primary" if name.endswith("-primary") else "shadow" if name.endswith("-shadow") else None
        if role is None:
            fail(f"{name}: neither -primary nor -shadow")
        spec = d["spec"]
        labels = spec["template"]["metadata"]["labels"]
        if spec["selector"]["matchLabels"].get("app.kubernetes.io/component") != role:
            fail(f"{name}: selector without component {role}")
        if any(labels.get(k) != v for k, v in sel.items()):
            fail(f"{name}: pods not selected by the Service ({sel} vs {labels})")
        if role == "primary" and spec["replicas"] != 1:
            fail(f"{name}: the primary must have 1 replica")
        pod = spec["template"]["spec"]
        lockd = [c for c in pod["initContainers"] if c["name"] == "lockd"]
        if len(lockd) != 1:
            fail(f"{name}: one lockd sidecar expected")
        lc = lockd[0]["command"]
        if flag(lc, "--backend") != "etcd":
            fail(f"{name}: lockd not on etcd: {lc}")
        if not flag(lc, "--etcd-endpoints"):
            fail(f"{name}: lockd without --etcd-endpoints")
        if "--state" in lc:
            fail(f"{name}: lockd on etcd with the file backend's --state")
        if flag(lc, "--etcd-node") != "$(POD_NAME)" or "POD_NAME" not in env_names(lockd[0]):
            fail(f"{name}: lockd's --etcd-node is not the pod's name")
        if flag(lc, "--etcd-leader-change") not in ("auto", "trust", "fence"):
            fail(f"{name}: lockd's --etcd-leader-change is {flag(lc, '--etcd-leader-change')!r}")
        # TLS: https:// endpoints exactly when the CA, certificate and key are passed, each a
        # file of a Secret volume mounted read-only into the lockd container.
        eps = (flag(lc, "--etcd-endpoints") or "").split(",")
        tls_flags = [flag(lc, f) for f in ("--etcd-ca", "--etcd-cert", "--etcd-key")]
        if any(e.startswith("https://") for e in eps):
            if not all(e.startswith("https://") for e in eps):
                fail(f"{name}: http:// and https:// endpoints mixed: {eps}")
            if None in tls_flags:
                fail(f"{name}: https:// endpoints without --etcd-ca/--etcd-cert/--etcd-key")
            mounts = {m["mountPath"]: m for m in lockd[0].get("volumeMounts", [])}
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            for path in tls_flags:
                m = mounts.get(path.rsplit("/", 1)[0])
                if m is None or not m.get("readOnly"):
                    fail(f"{name}: {path} not on a read-only mount of the lockd container")
                if "secret" not in vols.get(m["name"], {}):
                    fail(f"{name}: {path} not from a Secret volume")
        elif any(f is not None for f in tls_flags):
            fail(f"{name}: TLS flags with http:// endpoints: {eps}")
        # etcd authentication: the password as a file of a read-only Secret mount, never a
        # flag value; the user from that Secret through LOCKD_ETCD_USER.
        pw = flag(lc, "--etcd-password-file")
        user_env = [v for v in lockd[0].get("env", []) if v["name"] == "LOCKD_ETCD_USER"]
        if "--etcd-password" in lc:
            fail(f"{name}: an etcd password on the command line")
        if pw is not None:
            mounts = {m["mountPath"]: m for m in lockd[0].get("volumeMounts", [])}
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            m = mounts.get(pw.rsplit("/", 1)[0])
            if m is None or not m.get("readOnly"):
                fail(f"{name}: {pw} not on a read-only mount of the lockd container")
            secret = vols.get(m["name"], {}).get("secret")
            if secret is None:
                fail(f"{name}: {pw} not from a Secret volume")
            ref = user_env[0].get("valueFrom", {}).get("secretKeyRef") if user_env else None
            if "--etcd-user" not in lc and (ref is None or ref.get("name") != secret["secretName"]):
                fail(f"{name}: --etcd-password-file without the user from the same Secret")
        elif user_env or "--etcd-user" in lc:
            fail(f"{name}: an etcd user without --etcd-password-file")
        ttl = dur_ms(flag(lc, "--etcd-ttl"))
        kill = dur_ms(flag(lc, "--etcd-kill-time"))
        margin = ttl // 100 + 100 + kill
        sock = flag(lc, "--listen")
        engines = [c for c in pod["containers"] if c["name"].startswith("engine-")]
        if len(engines) != 1:
            fail(f"{name}: one engine per pod expected, found {len(engines)}")
        e = engines[0]
        ec = e["command"]
        if flag(ec, "--role") != role:
            fail(f"{name}: engine role {flag(ec, '--role')} != {role}")
        if flag(ec, "--engine-id") != "0":
            fail(f"{name}: engine id must be 0 (its own GMS's writer)")
        if flag(ec, "--lock") != sock:
            fail(f"{name}: engine's --lock {flag(ec, '--lock')} is not its lockd's {sock}")
        if flag(ec, "--holder") != "$(POD_NAME)" or "POD_NAME" not in env_names(e):
            fail(f"{name}: engine's --holder is not the pod's name")
        wd = flag(ec, "--lock-watchdog")
        if wd is None:
            fail(f"{name}: no --lock-watchdog")
        if dur_ms(wd) * 3 > 2 * (ttl - margin):
            fail(f"{name}: --lock-watchdog {wd} above 2/3 of (ttl {ttl} ms - margin {margin} ms)")
        if "--publish-key" in ec:
            if "POD_IP" not in env_names(e) or "$(POD_IP)" not in (flag(ec, "--publish-value") or ""):
                fail(f"{name}: --publish-key without the pod's IP as the value")
        roles[role] = name
    if set(roles) != {"primary", "shadow"}:
        fail(f"roles: {roles}")
    cms = [d for d in docs if d.get("kind") == "ConfigMap" and "haproxy.cfg" in d.get("data", {})]
    if len(cms) != 1:
        fail("one router ConfigMap expected")
    servers = re.findall(r"^\s*server (\S+) ", cms[0]["data"]["haproxy.cfg"], re.M)
    if servers != ["engine-0", "engine-0-standby"]:
        fail(f"router servers: {servers}")


def init_mutant(path, mutate, what, hint):
    """The manifest at `path` with `mutate` applied to every init container of every
    Deployment must fail the check (`mutate` returns whether it changed anything)."""
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    mutated = False
    for d in docs:
        if d.get("kind") == "Deployment":
            for c in d["spec"]["template"]["spec"]["initContainers"]:
                mutated = mutate(c) or mutated
    if not mutated:
        print(f"FAIL: self-test: nothing to mutate for {what} ({hint})", file=sys.stderr)
        sys.exit(1)
    try:
        check(docs)
    except Bad as e:
        print(f"caught: {what} -> mutant: {e}")
    else:
        print(f"FAIL: self-test: the checker accepted {what}", file=sys.stderr)
        sys.exit(1)


def main():
    args = sys.argv[1:]
    self_test = "--self-test" in args
    paths = [a for a in args if not a.startswith("--")]
    for p in paths:
        with open(p) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        try:
            check(docs)
        except Bad as e:
            print(f"FAIL {p}: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"ok: {p}: primary and shadow pods, each with a lockd on etcd and a watchdog in time")
        if self_test:
            # The checker must catch a watchdog that cannot fence in time.
            for d in docs:
                if d.get("kind") == "Deployment":
                    for c in d["spec"]["template"]["spec"]["containers"]:
                        if "--lock-watchdog" in c.get("command", []):
                            i = c["command"].index("--lock-watchdog")
                            c["command"][i + 1] = "10s"
            try:
                check(docs)
            except Bad as e:
                print(f"caught: a 10s --lock-watchdog -> mutant: {e}")
            else:
                print("FAIL: self-test: the checker accepted --lock-watchdog 10s", file=sys.stderr)
                sys.exit(1)
            # ... and https:// endpoints whose client key is missing.
            def drop_key(c):
                cmd = c.get("command", [])
                if "--etcd-key" not in cmd:
                    return False
                i = cmd.index("--etcd-key")
                del cmd[i : i + 2]
                return True

            init_mutant(p, drop_key, "https:// without --etcd-key", "is TLS rendered?")

            # ... and the etcd password file moved off its Secret (a mount not read-only).
            def writable_password(c):
                hit = False
                for m in c.get("volumeMounts", []):
                    if m.get("name") == "etcd-auth":
                        m["readOnly"] = False
                        hit = True
                return hit

            init_mutant(p, writable_password, "a writable etcd password mount", "is authSecret rendered?")

if __name__ == "__main__":
    main()
