#!/usr/bin/python3
"""Structural checks of deploy/k8s (python3-yaml, no cluster needed).

- detattnd.yaml is what render.sh 2 prints;
- every GPU slot i is a DaemonSet whose pod asks for one GPU, runs on nodes with more than i
  GPUs, mounts its own hostPath /run/detattn/gpu<i> where its daemon listens, serves
  metrics on a named port with Prometheus scrape annotations, and probes /healthz (liveness,
  startup) and /readyz (readiness) on it; a grace period longer than the drain;
- the serving example mounts /run/detattn and names one socket per slot;
- with --detattnd PATH: every flag of the manifests is one detattnd knows, and detattnd
  starts with the ConfigMap's detattnd.conf (CPU backend, small KV cache) and drains on
  SIGTERM.
Exit 0 ok, 1 a check failed, 77 python3-yaml missing.
"""
import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

try:
    import yaml
except ImportError:
    print("skip: python3-yaml is not installed")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
errors = []


def check(cond, what):
    if not cond:
        errors.append(what)
    return cond


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def pod_spec(d):
    return d["spec"]["template"]["spec"]


def flags_of(args):
    return [a.split("=", 1)[0] for a in args if a.startswith("--")]


def check_render():
    out = subprocess.run(["bash", os.path.join(HERE, "render.sh"), "2"], capture_output=True, text=True, check=True)
    with open(os.path.join(HERE, "detattnd.yaml")) as f:
        check(out.stdout == f.read(), "detattnd.yaml is not what render.sh 2 prints (re-render it)")


def check_daemonsets(docs, slots_expected):
    ds = [d for d in docs if d.get("kind") == "DaemonSet"]
    cms = [d for d in docs if d.get("kind") == "ConfigMap"]
    check(len(ds) == slots_expected, f"{len(ds)} DaemonSets, expected {slots_expected}")
    check(len(cms) == 1 and "detattnd.conf" in cms[0]["data"], "one ConfigMap with detattnd.conf")
    paths = set()
    for d in ds:
        name = d["metadata"]["name"]
        m = re.fullmatch(r"detattnd-gpu(\d+)", name)
        if not check(m, f"{name}: not detattnd-gpu<i>"):
            continue
        i = int(m.group(1))
        sel = d["spec"]["selector"]["matchLabels"]
        labels = d["spec"]["template"]["metadata"]["labels"]
        check(all(labels.get(k) == v for k, v in sel.items()), f"{name}: selector does not match the pod labels")
        check(d["spec"]["updateStrategy"]["type"] == "RollingUpdate", f"{name}: RollingUpdate")
        spec = pod_spec(d)
        ann = d["spec"]["template"]["metadata"].get("annotations", {})
        check(ann.get("prometheus.io/scrape") == "true", f"{name}: prometheus.io/scrape")
        terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        exprs = [e for t in terms for e in t["matchExpressions"]]
        check(any(e["key"] == "nvidia.com/gpu.count" and e["operator"] == "Gt" and e["values"] == [str(i)] for e in exprs),
              f"{name}: must run only on nodes with more than {i} GPUs")
        check(spec.get("hostPID") is True, f"{name}: hostPID (peer credentials)")
        vols = {v["name"]: v for v in spec["volumes"]}
        (c,) = spec["containers"]
        lim = c["resources"]["limits"]
        check(str(lim.get("nvidia.com/gpu")) == "1", f"{name}: nvidia.com/gpu limit 1, got {lim.get('nvidia.com/gpu')}")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        args = c["args"]
        http = [a for a in args if a.startswith("--http-listen=")]
        if check(len(http) == 1, f"{name}: one --http-listen"):
            port = int(http[0].rsplit(":", 1)[1])
            check(ports.get("metrics") == port, f"{name}: the metrics port is not --http-listen's {port}")
            check(ann.get("prometheus.io/port") == str(port), f"{name}: prometheus.io/port is not {port}")
        for probe, path in (("livenessProbe", "/healthz"), ("startupProbe", "/healthz"), ("readinessProbe", "/readyz")):
            g = c.get(probe, {}).get("httpGet", {})
            check(g.get("path") == path and g.get("port") == "metrics", f"{name}: {probe} must GET {path} on metrics")
        listen = [a for a in args if a.startswith("--listen=")]
        check(listen == ["--listen=ipc:///run/detattn/detattnd.sock"], f"{name}: --listen {listen}")
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        hp = vols.get(mounts.get("/run/detattn"), {}).get("hostPath", {})
        check(hp.get("path") == f"/run/detattn/gpu{i}", f"{name}: /run/detattn must be the hostPath /run/detattn/gpu{i}")
        paths.add(hp.get("path"))
        grace = spec.get("terminationGracePeriodSeconds", 30)
        check(grace >= 32, f"{name}: terminationGracePeriodSeconds {grace} < drain-timeout 30 s + 2 s")
        sc = c["securityContext"]
        check(sc.get("runAsUser") == 10001 and sc.get("runAsGroup") == 10001, f"{name}: runs as 10001:10001")
    check(len(paths) == len(ds), "every slot needs its own socket directory")
    return ds, cms[0]["data"]["detattnd.conf"] if cms else ""


def check_serving(docs, slots):
    (dep,) = [d for d in docs if d.get("kind") == "Deployment"]
    spec = pod_spec(dep)
    vols = {v["name"]: v for v in spec["volumes"]}
    (c,) = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    check(vols.get(mounts.get("/run/detattn"), {}).get("hostPath", {}).get("path") == "/run/detattn",
          "serving example: mount the hostPath /run/detattn")
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    urls = env.get("DETATTN_URLS", "").split(",")
    check(urls == [f"ipc:///run/detattn/gpu{i}/detattnd.sock" for i in range(slots)],
          f"serving example: DETATTN_URLS {urls}")
    check(spec["securityContext"].get("runAsGroup") == 10001, "serving example: primary group 10001 (the daemons')")


def check_with_daemon(detattnd, ds, conf):
    helptext = subprocess.run([detattnd, "--help"], capture_output=True, text=True).stdout
    known = set(re.findall(r"^  (--[a-z0-9-]+)", helptext, re.M))
    for d in ds:
        for f in flags_of(d["spec"]["template"]["spec"]["containers"][0]["args"]):
            check(f in known, f"{d['metadata']['name']}: detattnd has no flag {f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "detattnd.conf")
        with open(path, "w") as f:
            f.write(conf)
        log = os.path.join(tmp, "log")
        # The CUDA model of the ConfigMap on the CPU backend, with a small KV cache.
        cmd = [detattnd, "--config", path, "--backend", "cpu", "--kv-tokens", "4096", "--threads", "1",
               "--listen", f"ipc://{tmp}/d.sock", "--http-listen", "http://127.0.0.1:0"]
        with open(log, "w") as lf:
            p = subprocess.Popen(cmd, stderr=lf)
        ok = False
        for _ in range(150):
            time.sleep(0.1)
            with open(log) as lf:
                text = lf.read()
            if "listening on" in text:
                ok = True
                break
            if p.poll() is not None:
                break
        check(ok, f"detattnd does not start with the ConfigMap's detattnd.conf: {text.strip()[-400:]}")
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            check(p.wait(timeout=20) == 0, "detattnd did not drain to exit 0")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--detattnd")
    a = ap.parse_args()
    check_render()
    docs = load("detattnd.yaml")
    ds, conf = check_daemonsets(docs, 2)
    check_serving(load("serving-example.yaml"), len(ds))
    check([d["kind"] for d in load("namespace.yaml")] == ["Namespace"], "namespace.yaml: one Namespace")
    if a.detattnd:
        check_with_daemon(a.detattnd, ds, conf)
    for e in errors:
        print("FAIL:", e)
    if not errors:
        print(f"ok: {len(ds)} GPU slots, probes, scrape annotations, sockets, serving example"
              + (", flags and config accepted by detattnd" if a.detattnd else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
