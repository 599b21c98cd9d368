"""A tiny image for the real-node tests: one static Go program, ``/server``, that serves HTTP on
:8080 (``/healthz`` says ``ok``, ``/`` the pod's hostname), and as ``/server get URL [TIMEOUT]`` fetches a URL
(a pod calling a Service; an https URL as an in-cluster client, with the service account's CA
and token) and as ``/server echo WORDS`` prints them (exec and exec probes).

Built with the Go the control plane is built with, packed as a one-layer OCI archive, cached by
the hash of its source.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from kuberl.cluster.build import cache_root, find_go
from kuberl.cluster.pause_image import oci_archive

TAG = "kuberl.local/node-test:1"
SOURCE = """package main

import (
\t"crypto/tls"
\t"crypto/x509"
\t"fmt"
\t"io"
\t"net/http"
\t"os"
\t"strings"
\t"time"
)

const sa = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
\tif len(os.Args) > 2 && os.Args[1] == "get" {
\t\ttimeout := 5 * time.Second
\t\tif len(os.Args) > 3 {
\t\t\ttimeout, _ = time.ParseDuration(os.Args[3])
\t\t}
\t\tclient := http.Client{Timeout: timeout}
\t\treq, _ := http.NewRequest("GET", os.Args[2], nil)
\t\tif strings.HasPrefix(os.Args[2], "https://") {
\t\t\t// as an in-cluster client: the service account's CA and token
\t\t\tpool := x509.NewCertPool()
\t\t\tca, _ := os.ReadFile(sa + "/ca.crt")
\t\t\tpool.AppendCertsFromPEM(ca)
\t\t\tclient.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
\t\t\ttoken, _ := os.ReadFile(sa + "/token")
\t\t\treq.Header.Set("Authorization", "Bearer "+string(token))
\t\t}
\t\tresp, err := client.Do(req)
\t\tif err != nil {
\t\t\tfmt.Println(err)
\t\t\tos.Exit(1)
\t\t}
\t\tbody, _ := io.ReadAll(resp.Body)
\t\tfmt.Print(string(body))
\t\treturn
\t}
\tif len(os.Args) > 1 && os.Args[1] == "echo" {
\t\tfmt.Println(strings.Join(os.Args[2:], " "))
\t\treturn
\t}
\thost, _ := os.Hostname()
\thttp.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") })
\thttp.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, host) })
\tfmt.Println("serving on :8080")
\tif err := http.ListenAndServe(":8080", nil); err != nil {
\t\tfmt.Println(err)
\t\tos.Exit(1)
\t}
}
"""


def ensure_archive() -> Path:
    """The image's OCI archive (tag :data:`TAG`), built the first time (seconds)."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    home = cache_root() / f"node-test-image-{digest}"
    archive = home / "image.tar"
    if archive.is_file():
        return archive
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "go.mod").write_text("module kuberl.local/nodetest\n\ngo 1.24\n")
    (src / "main.go").write_text(SOURCE)
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod -buildvcs=false"}
    subprocess.run([find_go(), "build", "-trimpath", "-ldflags", "-s -w", "-o", str(home / "server"), "."],
                   cwd=src, env=env, check=True, capture_output=True, timeout=600)
    oci_archive(home / "server", TAG, archive, name="server", user="65532:65532")
    return archive
