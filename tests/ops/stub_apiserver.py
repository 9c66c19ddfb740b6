#!/usr/bin/python3
"""A Kubernetes API stub for `kubectl apply --dry-run=client` without a cluster: it answers
API discovery for the kinds deploy/k8s uses (Namespace, ConfigMap, DaemonSet, Deployment)
and 404 for every object, so kubectl maps each document to its resource, finds nothing
live and prints what it would create. Nothing is stored. Loopback only.
Usage: stub_apiserver.py PORT_FILE   (writes the port it listens on, then serves until killed)
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]


def res(name, kind, namespaced):
    return {"name": name, "singularName": kind.lower(), "namespaced": namespaced, "kind": kind, "verbs": VERBS}


DOCS = {
    "/api": {"kind": "APIVersions", "versions": ["v1"],
             "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
        {"name": "apps", "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
         "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"}}]},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        res("namespaces", "Namespace", False), res("configmaps", "ConfigMap", True)]},
    "/apis/apps/v1": {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1", "resources": [
        res("daemonsets", "DaemonSet", True), res("deployments", "Deployment", True)]},
}


class H(BaseHTTPRequestHandler):
    def do_GET(self):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        doc = DOCS.get(path)
        code = 200 if doc else 404
        if doc is None:
            doc = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                   "message": f"{path} not found"}
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
with open(sys.argv[1], "w") as f:
    f.write(str(srv.server_address[1]))
srv.serve_forever()
