#!/bin/bash
# A Kubernetes on this host for make e2e (one node, and a second one on
# demand: node-b), and its tear-down.
#
#   cluster.sh up     start it and deploy berth (the DaemonSet, and the
#                     berth-controller Deployment with the external-attacher),
#                     the test CSI controller, external-provisioner and
#                     external-resizer
#   cluster.sh restart-kubelet   stop the kubelet and start it again
#   cluster.sh node-b up|down     a second node on this host (twonode.sh):
#                     its own kubelet, containerd, root directory, cgroup
#                     root, address and ports, and its own berth
#   cluster.sh crash-node|boot-node   the first node's machine going away
#                     and coming back (see crash_node)
#   cluster.sh down   stop everything and remove every trace: processes,
#                     mounts, loop devices, cgroups, network namespaces, files
#
# Layout (see test/e2e/README.md):
#   - network namespace berth-e2e: a veth pair whose two ends both stay in it
#     gives the node its address (the kubelet refuses a loopback node IP);
#     etcd, the control plane, the kubelet, the controller and the sidecars
#     run there (nsenter --net only: the mount namespace is the host's, so
#     the kubelet, containerd and berth see the same mounts). Pods get their
#     addresses from a bridge inside it. Nothing leaves it.
#   - containerd runs in the host's network namespace, so that berth's pod
#     (hostNetwork) is there too: the kernel sends block device uevents to
#     the host's namespace only. Its registry traffic goes to a proxy on
#     loopback that does not exist, so a missing image fails instead of
#     being pulled; every image is imported from an archive.
#   - socat carries two loopback ports from berth-e2e's loopback to the
#     host's: containerd's streaming server (exec, attach) and the
#     DaemonSet's liveness port, which the kubelet reaches on 127.0.0.1.
#   - the kubelet's root is /var/lib/kubelet (some storage tests name it),
#     bind-mounted on itself and made shared for berth's Bidirectional
#     mount.
# Environment: E2E_CACHE (build output, see build.sh), BERTH_IMAGE (make
# image's archive), KUBECONFIG is written to $E2E_STATE/admin.kubeconfig.
set -euo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
here=$(cd "$(dirname "$0")/.." && pwd)
repo=$(cd "$here/../.." && pwd)
E2E_CACHE=${E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-e2e}
bin=$E2E_CACHE/bin
S=/var/lib/berth-e2e   # state: certificates, etcd, containerd's root, logs, image files
R=/run/berth-e2e       # runtime: sockets, pids
NS=berth-e2e
NSPATH=/run/netns/$NS
NODE=berth-e2e-node
NODE_IP=10.240.0.2
POD_CIDR=10.241.0.0/24
KDIR=/var/lib/kubelet
STREAM_PORT=10010
PROBE_PORT=9818
# The second node (node-b up): state under $B, runtime under $RB.
NODE_B=berth-e2e-node-b
NODE_B_IP=10.240.0.3
POD_CIDR_B=10.241.1.0/24
B=$S/node-b
RB=$R/node-b
KDIR_B=$B/kubelet
STREAM_PORT_B=10011
HEALTHZ_PORT_B=10258
CGROUP_ROOT_B=berth-e2e-node-b
# hostPath directories the DaemonSet creates when missing: removed by down
# unless they existed before up.
HOSTPATHS=(/var/lib/berth /etc/iscsi /var/lib/iscsi /run/lock/iscsi /etc/nvme /run/udev)
# and the kubelet's pod and container logs, and /lib/modules, a hostPath of
# type Directory, which this host's kernel (no modules) lacks: up makes it.
HOSTPATHS+=(/var/log/pods /var/log/containers /lib/modules)

log() { printf 'cluster: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }
innet() { nsenter --net="$NSPATH" -- "$@"; }
kc() { innet "$bin/kubectl" --kubeconfig "$S/admin.kubeconfig" "$@"; }

# start NAME [innet] CMD...: a daemon in its own session, logged and tracked.
start() {
	local name=$1
	shift
	if [ "$1" = innet ]; then
		shift
		set -- nsenter --net="$NSPATH" -- "$@"
	fi
	setsid "$@" >"$S/logs/$name.log" 2>&1 </dev/null &
	echo $! >"$R/$name.pid"
}

# wait_for WHAT SECONDS CMD...: until CMD succeeds.
wait_for() {
	local what=$1 secs=$2 i
	shift 2
	for ((i = 0; i < secs * 5; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.2
	done
	die "$what: not ready after ${secs}s (logs in $S/logs)"
}

certs() {
	local d=$S/pki
	mkdir -p "$d"
	cd "$d"
	openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=berth-e2e-ca 2>/dev/null
	# cert NAME SUBJECT [SANS]
	cert() {
		openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
		if [ -n "${3:-}" ]; then
			printf 'subjectAltName=%s\n' "$3" >"$1.ext"
			openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
		else
			openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out "$1.crt" 2>/dev/null
		fi
	}
	cert apiserver /CN=kube-apiserver "IP:$NODE_IP,IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc"
	cert admin "/O=system:masters/CN=berth-e2e-admin"
	openssl genrsa -out sa.key 2048 2>/dev/null
	openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
	cd - >/dev/null
	cat >"$S/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster:
    server: https://$NODE_IP:6443
    certificate-authority: $d/ca.crt
users:
- name: admin
  user:
    client-certificate: $d/admin.crt
    client-key: $d/admin.key
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
EOF
}

# cni_config DIR NAME BRIDGE SUBNET IPAM-DIR: a node's pod network, a
# bridge inside berth-e2e.
cni_config() {
	mkdir -p "$1" "$5"
	cat >"$1/10-$2.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "$2",
  "plugins": [
    {"type": "bridge", "bridge": "$3", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$5", "ranges": [[{"subnet": "$4"}]], "routes": [{"dst": "0.0.0.0/0"}]}}
  ]
}
EOF
}

# containerd_config FILE ROOT STATE SOCKET STREAM-PORT CNI-CONF-DIR [RUNC-ROOT]
containerd_config() {
	local runc_root=
	[ -z "${7:-}" ] || runc_root="Root = \"$7\""
	cat >"$1" <<EOF
version = 2
root = "$2"
state = "$3"
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "$4"
[ttrpc]
  address = "$4.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.k8s.io/pause:3.10.1"
  # root here lacks CAP_SYS_RESOURCE: runc cannot set the negative
  # oom_score_adj the kubelet asks for.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "$5"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        $runc_root
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$S/cni/bin"
    conf_dir = "$6"
EOF
}

# kubelet_config FILE CONTAINERD-SOCKET ADDRESS HEALTHZ-PORT [LINES]: LINES
# are added as they are.
kubelet_config() {
	cat >"$1" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
failSwapOn: false
failCgroupV1: false
containerRuntimeEndpoint: unix://$2
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
address: $3
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $4
resolvConf: $S/resolv.conf
clusterDomain: cluster.local
serializeImagePulls: false
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
podPidsLimit: 4096
${5:-}
EOF
}

configs() {
	mkdir -p "$S/cni/bin"
	# The CNI plugins run in berth-e2e, not in containerd's namespace: the
	# bridge and the host end of each pod's veth are made there.
	for p in bridge host-local loopback portmap; do
		printf '#!/bin/sh\nexec nsenter --net=%s -- /usr/lib/cni/%s "$@"\n' "$NSPATH" "$p" >"$S/cni/bin/$p"
		chmod 0755 "$S/cni/bin/$p"
	done
	cni_config "$S/cni/net.d" berth-e2e e2ebr0 "$POD_CIDR" "$S/cni/ipam"
	containerd_config "$S/containerd.toml" "$S/containerd" "$R/containerd" "$R/containerd.sock" "$STREAM_PORT" "$S/cni/net.d"
	: >"$S/resolv.conf"
	kubelet_config "$S/kubelet.yaml" "$R/containerd.sock" "$NODE_IP" 10248
}

# start_containerd NAME CONFIG: no registry is reachable: pulls go to a
# proxy on loopback that refuses.
start_containerd() {
	HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 NO_PROXY= \
		start "$1" containerd --config "$2"
}

start_kubelet() {
	start kubelet innet "$bin/kubelet" --config="$S/kubelet.yaml" --kubeconfig="$S/admin.kubeconfig" \
		--root-dir="$KDIR" --hostname-override=$NODE --node-ip=$NODE_IP --v=2
}

# restart-kubelet: stop the kubelet (pods and mounts stay) and start it again.
restart_kubelet() {
	stop kubelet
	mv "$S/logs/kubelet.log" "$S/logs/kubelet.log.$(date +%s)"
	start_kubelet
	wait_for "kubelet healthz" 60 innet curl -sf http://127.0.0.1:10248/healthz
}

node_ready() { # [NODE]
	[ "$(kc get node "${1:-$NODE}" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = True ]
}

berth_registered() { # [NODE]
	kc get csinode "${1:-$NODE}" -o jsonpath='{.spec.drivers[*].name}' | grep -qw berth.csi.io
}

controller_available() {
	[ "$(kc -n kube-system get deployment berth-controller -o jsonpath='{.status.availableReplicas}')" = 1 ]
}

up() {
	[ "$(id -u)" = 0 ] || die "must run as root"
	[ ! -e "$NSPATH" ] && [ ! -d "$R" ] || die "a cluster is up (or was not torn down): run $0 down"
	for b in kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl csi-provisioner csi-resizer csicontroller; do
		[ -x "$bin/$b" ] || die "$bin/$b missing: run test/e2e/scripts/build.sh"
	done
	local img=${BERTH_IMAGE:-$repo/bin/berth-image.tar}
	[ -f "$img" ] || die "$img missing: run make image"
	local t0=$SECONDS h
	mkdir -p "$S/logs" "$S/files" "$R"
	for h in "${HOSTPATHS[@]}" "$KDIR" /run/netns; do
		if [ -e "$h" ]; then echo "$h"; fi
	done >"$R/existed"
	mkdir -p /lib/modules

	ip netns add "$NS"
	innet ip link set lo up
	innet ip link add e2e0 type veth peer name e2e1
	innet ip addr add "$NODE_IP/24" dev e2e0
	innet ip link set e2e0 up
	innet ip link set e2e1 up
	innet ip route add default dev e2e0

	certs
	configs

	mkdir -p "$KDIR"
	mount --bind "$KDIR" "$KDIR"
	mount --make-shared "$KDIR"

	start etcd innet etcd --name berth-e2e --data-dir "$S/etcd" \
		--listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
		--listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
		--initial-cluster berth-e2e=http://127.0.0.1:2380
	start_containerd containerd "$S/containerd.toml"
	# Each connection to one of these ports on berth-e2e's loopback goes on
	# to the same port on the host's loopback.
	touch "$R/hostnet"
	mount --bind /proc/self/ns/net "$R/hostnet"
	printf '#!/bin/sh\nexec nsenter --net=%s -- socat STDIO TCP4:127.0.0.1:"$1"\n' "$R/hostnet" >"$S/forward"
	chmod 0755 "$S/forward"
	local port
	for port in $STREAM_PORT $PROBE_PORT; do
		start "forward-$port" innet socat TCP4-LISTEN:$port,bind=127.0.0.1,reuseaddr,fork "EXEC:$S/forward $port"
	done
	wait_for containerd 30 ctr --address "$R/containerd.sock" version
	local f
	for f in "$E2E_CACHE"/images/*.tar "$img"; do
		ctr --address "$R/containerd.sock" -n k8s.io images import --no-unpack=false "$f" >/dev/null
	done
	log "images: $(ctr --address "$R/containerd.sock" -n k8s.io images ls -q | grep -vc '^sha256:') imported"

	wait_for etcd 30 innet curl -sf http://127.0.0.1:2379/health
	local pki=$S/pki
	start kube-apiserver innet "$bin/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
		--bind-address=$NODE_IP --advertise-address=$NODE_IP --secure-port=6443 \
		--service-cluster-ip-range=10.96.0.0/24 --allow-privileged=true \
		--client-ca-file="$pki/ca.crt" --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
		--kubelet-client-certificate="$pki/admin.crt" --kubelet-client-key="$pki/admin.key" \
		--service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
		--service-account-issuer=https://kubernetes.default.svc --authorization-mode=Node,RBAC \
		--kubelet-preferred-address-types=InternalIP --profiling=false
	wait_for kube-apiserver 90 kc get --raw /readyz
	start kube-controller-manager innet "$bin/kube-controller-manager" --kubeconfig="$S/admin.kubeconfig" \
		--bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=false \
		--service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" --profiling=false
	start kube-scheduler innet "$bin/kube-scheduler" --kubeconfig="$S/admin.kubeconfig" \
		--bind-address=127.0.0.1 --leader-elect=false --profiling=false
	start_kubelet
	wait_for "node Ready" 120 node_ready
	kc apply -k "$here/deploy" >/dev/null
	wait_for "berth in CSINode" 120 berth_registered
	# attachRequired: no berth volume is staged before the attacher runs.
	wait_for "berth-controller available" 120 controller_available

	start csicontroller innet "$bin/csicontroller" -endpoint "$R/controller.sock" -file-root "$S/files"
	wait_for csicontroller 30 test -S "$R/controller.sock"
	start csi-provisioner innet "$bin/csi-provisioner" --kubeconfig="$S/admin.kubeconfig" \
		--csi-address="$R/controller.sock" --leader-election=false --feature-gates=Topology=false \
		--extra-create-metadata=false --timeout=60s
	start csi-resizer innet "$bin/csi-resizer" --kubeconfig="$S/admin.kubeconfig" \
		--csi-address="$R/controller.sock" --leader-election=false --timeout=60s
	log "up in $((SECONDS - t0))s: KUBECONFIG=$S/admin.kubeconfig (inside: nsenter --net=$NSPATH)"
}

# The second node (twonode.sh): a kubelet of its own (node $NODE_B, address
# $NODE_B_IP beside the first node's on e2e0, root directory $KDIR_B,
# cgroup root /$CGROUP_ROOT_B, healthz port $HEALTHZ_PORT_B, pod logs of
# its own), its own containerd (root, state, socket, runc root, streaming
# port $STREAM_PORT_B, a pod network of its own: bridge e2ebr1 in
# berth-e2e), and its own berth: a host process, as a systemd install
# runs it (node ID $NODE_B, socket and registration under $KDIR_B, state
# directory $B/berth), with the same file root as the first node's: the
# image files play the shared array. berth's DaemonSet does not run there
# (test/e2e/deploy/node-b.yaml): its host paths are the first node's
# kubelet directory and berth state, and a second copy in this host's
# network namespace would take the first one's ports. Nothing of it leaves
# berth-e2e either.
node_b_up() {
	[ -e "$NSPATH" ] || die "no cluster: run $0 up"
	[ ! -d "$RB" ] || die "node B is up (or was not torn down): run $0 node-b down"
	local berth=${BERTH_BIN:-$repo/bin/berth}
	[ -x "$berth" ] || die "$berth missing: run make build"
	local img=${BERTH_IMAGE:-$repo/bin/berth-image.tar}
	[ -f "$img" ] || die "$img missing: run make image"
	local t0=$SECONDS c f
	mkdir -p "$B" "$RB" "$KDIR_B/plugins/berth.csi.io" "$B/berth" "$B/pod-logs"
	innet ip addr add "$NODE_B_IP/24" dev e2e0
	# The kubelet checks that its cgroup root exists in every hierarchy; a
	# new cgroup v1 cpuset starts with no CPU and no memory node.
	for c in $(awk '$3 ~ /^cgroup2?$/ { print $2 }' /proc/self/mounts); do
		mkdir -p "$c/$CGROUP_ROOT_B"
	done
	if [ -f /sys/fs/cgroup/cpuset/cpuset.cpus ]; then
		cat /sys/fs/cgroup/cpuset/cpuset.cpus >"/sys/fs/cgroup/cpuset/$CGROUP_ROOT_B/cpuset.cpus"
		cat /sys/fs/cgroup/cpuset/cpuset.mems >"/sys/fs/cgroup/cpuset/$CGROUP_ROOT_B/cpuset.mems"
	fi
	cni_config "$B/cni" berth-e2e-b e2ebr1 "$POD_CIDR_B" "$B/cni-ipam"
	containerd_config "$B/containerd.toml" "$B/containerd" "$RB/containerd" "$RB/containerd.sock" "$STREAM_PORT_B" "$B/cni" "$RB/runc"
	kubelet_config "$B/kubelet.yaml" "$RB/containerd.sock" "$NODE_B_IP" "$HEALTHZ_PORT_B" "cgroupRoot: /$CGROUP_ROOT_B
podLogsDir: $B/pod-logs"
	start_containerd containerd-b "$B/containerd.toml"
	start "forward-$STREAM_PORT_B" innet socat TCP4-LISTEN:$STREAM_PORT_B,bind=127.0.0.1,reuseaddr,fork "EXEC:$S/forward $STREAM_PORT_B"
	wait_for containerd-b 30 ctr --address "$RB/containerd.sock" version
	# What runs there: test pods, and the berth-controller Deployment's pod
	# when it moves.
	for f in pause busybox csi-attacher; do
		ctr --address "$RB/containerd.sock" -n k8s.io images import --no-unpack=false "$E2E_CACHE/images/$f.tar" >/dev/null
	done
	ctr --address "$RB/containerd.sock" -n k8s.io images import --no-unpack=false "$img" >/dev/null
	start kubelet-b innet "$bin/kubelet" --config="$B/kubelet.yaml" --kubeconfig="$S/admin.kubeconfig" \
		--root-dir="$KDIR_B" --hostname-override=$NODE_B --node-ip=$NODE_B_IP --v=2
	wait_for "node B's kubelet healthz" 60 innet curl -sf http://127.0.0.1:$HEALTHZ_PORT_B/healthz
	start berth-b "$berth" serve --node-id=$NODE_B --endpoint="unix://$KDIR_B/plugins/berth.csi.io/csi.sock" \
		--state-dir="$B/berth" --transports= --file-root="$S/files" --kubelet-registration \
		--kubelet-dir="$KDIR_B" --log-format=text
	wait_for "node B Ready" 120 node_ready $NODE_B
	wait_for "berth in node B's CSINode" 120 berth_registered $NODE_B
	log "node B up in $((SECONDS - t0))s: $NODE_B ($NODE_B_IP), kubelet root $KDIR_B"
}

# kill_node_containers SOCKET: every container task of that containerd,
# killed and deleted, then its shims.
kill_node_containers() {
	local sock=$1 c i
	[ -S "$sock" ] || return 0
	for c in $(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
		ctr --address "$sock" -n k8s.io tasks kill -s KILL "$c" >/dev/null 2>&1 || true
	done
	for ((i = 0; i < 50; i++)); do
		[ -z "$(ctr --address "$sock" -n k8s.io tasks ls 2>/dev/null | awk '$3 == "RUNNING"')" ] && break
		sleep 0.2
	done
	for c in $(ctr --address "$sock" -n k8s.io tasks ls -q 2>/dev/null); do
		ctr --address "$sock" -n k8s.io tasks delete -f "$c" >/dev/null 2>&1 || true
	done
}

kill_shims() { # SOCKET
	local p
	for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $1" || true); do
		kill -KILL "$p" 2>/dev/null || true
	done
}

# unmount_under DIR...: every mount below each DIR, deepest first; prints
# the loop devices they were mounts of.
unmount_under() {
	local d m src
	for d in "$@"; do
		awk -v d="$d/" 'index($5, d) == 1 { for (i = 7; $i != "-"; i++); print $5, $(i + 2) }' /proc/self/mountinfo
	done | sort -r | while read -r m src; do
		umount -l "$m" 2>/dev/null || true
		case $src in /dev/loop*) echo "$src" ;; esac
	done | sort -u
}

node_b_down() {
	local t0=$SECONDS
	if [ -e "$NSPATH" ] && kc get --raw /readyz >/dev/null 2>&1; then
		kc delete node $NODE_B --wait=false >/dev/null 2>&1 || true
	fi
	stop berth-b
	stop kubelet-b
	kill_node_containers "$RB/containerd.sock"
	stop containerd-b
	kill_shims "$RB/containerd.sock"
	stop "forward-$STREAM_PORT_B"
	local l
	for l in $(unmount_under "$KDIR_B" "$B" "$RB"); do
		losetup -d "$l" 2>/dev/null || true
	done
	[ -e "$NSPATH" ] && innet ip addr del "$NODE_B_IP/24" dev e2e0 2>/dev/null || true
	remove_cgroups "/sys/fs/cgroup/*/$CGROUP_ROOT_B"
	rm -rf --one-file-system "$B" "$RB"
	log "node B down in $((SECONDS - t0))s"
}

# remove_cgroups GLOB...: the cgroup directories, deepest first.
remove_cgroups() {
	local cg
	for cg in $*; do
		[ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
	done
}

# crash-node: the first node's machine goes away, as far as one host can
# show it. Its kubelet is killed (SIGKILL), then every container of its
# containerd (berth's pod among them, and the berth-controller pod's
# attacher when it runs there), its containerd and the shims; then what a
# machine that stops loses with it: the mounts below its kubelet's pods/
# and plugins/kubernetes.io/csi/ (the volumes' staging and publish mounts,
# the pods' tokens) and the loop devices under them (its attachments to the
# shared array). Its disk stays: the kubelet's and berth's directories,
# containerd's root. Not emulated: containerd's runtime state (on /run,
# which a real reboot empties) and the pods' network namespaces stay for
# the containerd and kubelet of boot-node to clean up as after a crash of
# containerd alone; the node's address stays up (node B shares its network
# namespace), with nothing of node A answering on it.
crash_node() {
	local pid l
	if [ -f "$R/kubelet.pid" ]; then
		pid=$(cat "$R/kubelet.pid")
		kill -KILL -- "-$pid" 2>/dev/null || true
		rm -f "$R/kubelet.pid"
	fi
	kill_node_containers "$R/containerd.sock"
	if [ -f "$R/containerd.pid" ]; then
		pid=$(cat "$R/containerd.pid")
		kill -KILL -- "-$pid" 2>/dev/null || true
		rm -f "$R/containerd.pid"
	fi
	kill_shims "$R/containerd.sock"
	for l in $(unmount_under "$KDIR/pods" "$KDIR/plugins/kubernetes.io/csi"); do
		losetup -d "$l" 2>/dev/null || true
	done
	log "node $NODE crashed: kubelet, containers and containerd killed, volume mounts and loop devices gone"
}

# boot-node: the first node's containerd and kubelet started again after
# crash-node; the kubelet restarts berth's pod and cleans up the pods the
# API no longer has.
boot_node() {
	local t0=$SECONDS n
	for n in containerd kubelet; do
		[ -f "$S/logs/$n.log" ] && mv "$S/logs/$n.log" "$S/logs/$n.log.$(date +%s)"
	done
	start_containerd containerd "$S/containerd.toml"
	wait_for containerd 30 ctr --address "$R/containerd.sock" version
	start_kubelet
	wait_for "node Ready" 180 node_ready
	log "node $NODE booted in $((SECONDS - t0))s"
}

# stop NAME: TERM, then KILL after 20 s, the daemon and its session.
stop() {
	local f=$R/$1.pid pid i
	[ -f "$f" ] || return 0
	pid=$(cat "$f")
	kill -TERM -- "-$pid" 2>/dev/null || true
	for ((i = 0; i < 100; i++)); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.2
	done
	kill -KILL -- "-$pid" 2>/dev/null || true
	rm -f "$f"
}

down() {
	local t0=$SECONDS
	if [ -e "$NSPATH" ] && [ -f "$R/kube-apiserver.pid" ] && kc get --raw /readyz >/dev/null 2>&1; then
		# Pods first, while the kubelet and berth can still unmount: every
		# namespace but kube-system, then the claims, then berth itself.
		local ns
		for ns in $(kc get ns -o name | sed 's|namespace/||'); do
			case $ns in kube-system | kube-public | kube-node-lease | default) ;; *) kc delete ns "$ns" --wait=false >/dev/null 2>&1 || true ;; esac
		done
		kc delete pods --all -n default --wait=false >/dev/null 2>&1 || true
		kc delete pvc --all -A --wait=false >/dev/null 2>&1 || true
		local i
		for ((i = 0; i < 120; i++)); do
			[ -z "$(kc get pods -A -o name 2>/dev/null | grep -v -e berth-node -e berth-controller)" ] && [ -z "$(kc get pv -o name 2>/dev/null)" ] && break
			sleep 1
		done
		# The attacher detaches (and drops its finalizer) only while it runs.
		for ((i = 0; i < 60; i++)); do
			[ -z "$(kc get volumeattachments -o name 2>/dev/null)" ] && break
			sleep 1
		done
		kc delete -k "$here/deploy" --wait=true --timeout=90s >/dev/null 2>&1 || true
		for ((i = 0; i < 90; i++)); do
			[ -z "$(kc get pods -A -o name 2>/dev/null)" ] && break
			sleep 1
		done
	fi
	local d
	for d in csi-resizer csi-provisioner csicontroller berth-b kubelet-b kubelet kube-scheduler kube-controller-manager kube-apiserver; do
		stop "$d"
	done
	# Containers the kubelets left: their tasks, then the shims.
	kill_node_containers "$RB/containerd.sock"
	kill_node_containers "$R/containerd.sock"
	stop containerd-b
	stop containerd
	kill_shims "$RB/containerd.sock"
	kill_shims "$R/containerd.sock"
	stop forward-$PROBE_PORT
	stop forward-$STREAM_PORT
	stop forward-$STREAM_PORT_B
	stop etcd

	# Mounts: the kubelet's, containerd's, and the pods' network namespaces.
	local m
	for m in $(awk -v k="$KDIR" -v s="$S" -v r="$R" '$2 == k || index($2, k "/") == 1 || index($2, s "/") == 1 || index($2, r "/") == 1 || index($2, "/run/netns/cni-") == 1 { print $2 }' /proc/self/mounts | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	rm -f /run/netns/cni-* 2>/dev/null || true
	# Loop devices over the volumes' image files.
	local l
	for l in $(losetup -ln -O NAME,BACK-FILE 2>/dev/null | awk -v s="$S/files/" 'index($2, s) == 1 { print $1 }'); do
		losetup -d "$l" 2>/dev/null || true
	done
	if [ -e "$NSPATH" ]; then
		ip netns del "$NS"
	fi
	# ip netns made /run/netns a mount point of its own.
	if [ -f "$R/existed" ] && ! grep -qx /run/netns "$R/existed" && [ -d /run/netns ] && [ -z "$(ls -A /run/netns)" ]; then
		umount /run/netns 2>/dev/null || true
		rmdir /run/netns 2>/dev/null || true
	fi
	# cgroups the kubelet and containerd made, deepest first.
	remove_cgroups "/sys/fs/cgroup/*/kubepods*" "/sys/fs/cgroup/*/k8s.io" "/sys/fs/cgroup/*/system.slice/containerd*" "/sys/fs/cgroup/*/$CGROUP_ROOT_B"
	# Directories the DaemonSet's hostPaths and the kubelet created.
	if [ -f "$R/existed" ]; then
		for d in "${HOSTPATHS[@]}" "$KDIR"; do
			grep -qx "$d" "$R/existed" || rm -rf --one-file-system "$d"
		done
	fi
	rm -rf /run/containerd
	rm -rf --one-file-system "$S" "$R"
	log "down in $((SECONDS - t0))s"
}

# check: what down must have removed; prints any leftover and fails.
check() {
	local bad=0 x
	x=$(awk -v k="$KDIR" -v s="$S" '$2 == k || index($2, k "/") == 1 || index($2, s) == 1 || index($2, "/run/netns") == 1 { print $2 }' /proc/self/mounts)
	[ -z "$x" ] || { log "mounts left: $x"; bad=1; }
	x=$(losetup -ln -O NAME,BACK-FILE 2>/dev/null | grep "$S" || true)
	[ -z "$x" ] || { log "loop devices left: $x"; bad=1; }
	x=$(ip netns list 2>/dev/null)
	[ -z "$x" ] || { log "network namespaces left: $x"; bad=1; }
	x=$(ls -d /sys/fs/cgroup/*/kubepods* /sys/fs/cgroup/*/k8s.io /sys/fs/cgroup/*/$CGROUP_ROOT_B 2>/dev/null || true)
	[ -z "$x" ] || { log "cgroups left: $x"; bad=1; }
	x=$(pgrep -a -f "$S|$R|containerd-shim" || true)
	[ -z "$x" ] || { log "processes left: $x"; bad=1; }
	x=$(ls -d "$S" "$R" /run/containerd 2>/dev/null || true)
	[ -z "$x" ] || { log "files left: $x"; bad=1; }
	[ $bad = 0 ] && log "nothing left"
	return $bad
}

case ${1:-} in
up) up ;;
node-b)
	case ${2:-} in
	up) node_b_up ;;
	down) node_b_down ;;
	*) die "usage: $0 node-b up|down" ;;
	esac
	;;
crash-node) crash_node ;;
boot-node) boot_node ;;
down) down ;;
check) check ;;
restart-kubelet) restart_kubelet ;;
*) die "usage: $0 up|down|check|restart-kubelet|node-b up|down|crash-node|boot-node" ;;
esac
