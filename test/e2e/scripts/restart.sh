#!/bin/bash
# Restarts under the real kubelet, on the cluster of cluster.sh (the
# suite's [Disruptive] tests need SSH to the node, which this host has not):
#   1. berth's pod is deleted and the DaemonSet starts a new one: a running
#      pod keeps reading its data; a new pod of the same claim mounts it.
#   2. the kubelet is stopped and started: the pods keep their data, and a
#      pod deleted after it unmounts cleanly.
#   3. berth is killed (SIGKILL) while a pod's volume is being staged: the
#      container restarts and the pod starts with its data volume.
#   4. berth upgraded in place: the DaemonSet rolled out to another image
#      and rolled back while a pod appends to its volume and syncs: the
#      pod runs on, and no write is lost or out of order.
# Along the way, the attach step (attachRequired: true): a running pod's
# volume has its VolumeAttachment, under the name the kubelet computes
# (csi- and the SHA-256 of volume handle, driver and node), attached by
# the berth-controller Deployment's attacher with berth controller's
# publish_context (the node); a pod of the same ReadWriteOnce claim put on
# a second Node (an object without a kubelet, which the attach-detach
# controller manages like any node) gets the CO's Multi-Attach refusal and
# no VolumeAttachment; once no pod on the node uses the volume, the
# VolumeAttachment is deleted.
# At the end, every pod and claim deleted: nothing is left staged,
# published or attached, no loop device remains over the image files,
# berth's state directory holds no volume.
# Prints "restart: N passed, N failed".
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
here=$(cd "$(dirname "$0")/.." && pwd)
E2E_CACHE=${E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-e2e}
bin=$E2E_CACHE/bin
S=/var/lib/berth-e2e
R=/run/berth-e2e
NSPATH=/run/netns/berth-e2e
NS=berth-restart
passed=0 failed=0
kc() { nsenter --net="$NSPATH" -- "$bin/kubectl" --kubeconfig "$S/admin.kubeconfig" "$@"; }
log() { printf 'restart: %s\n' "$*" >&2; }
ok() { log "ok: $*"; passed=$((passed + 1)); }
fail() { log "FAILED: $*"; failed=$((failed + 1)); }

# until SECONDS CMD...: CMD succeeds within SECONDS.
until_ok() {
	local secs=$1 i
	shift
	for ((i = 0; i < secs; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 1
	done
	return 1
}

claim() { # NAME
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1, namespace: $NS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: berth-restart
  resources: {requests: {storage: 1Gi}}
EOF
}

pod() { # NAME CLAIM [SCRIPT]: SCRIPT runs in the pod, by default one
	# that leaves the pod's name in /data/token once and sleeps.
	local script=${3:-}
	[ -n "$script" ] || script="test -f /data/token || { echo $1 > /data/token; sync; }; exec sleep 100000"
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS}
spec:
  nodeName: berth-e2e-node
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: registry.k8s.io/e2e-test-images/busybox:1.37.0-1
    command: [sh, -c, '$script']
    volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: $2}}]
EOF
}

running() { [ "$(kc -n $NS get pod "$1" -o jsonpath='{.status.phase}')" = Running ]; }
token() { kc -n $NS exec "$1" -- cat /data/token; }
has_token() { [ "$(token "$1")" = "$2" ]; }
node_pods=app.kubernetes.io/name=berth,app.kubernetes.io/component=node
berth_ready() {
	[ "$(kc -n kube-system get pods -l $node_pods -o jsonpath='{.items[*].status.containerStatuses[?(@.name=="berth")].ready}')" = true ] &&
		kc get csinode berth-e2e-node -o jsonpath='{.spec.drivers[*].name}' | grep -qw berth.csi.io
}
gone() { ! kc -n $NS get pod "$1" >/dev/null 2>&1; }
# va PV: the name of PV's VolumeAttachment on the node, as the kubelet and
# the attach-detach controller compute it from the volume handle.
va() {
	local handle
	handle=$(kc get pv "$1" -o jsonpath='{.spec.csi.volumeHandle}')
	printf 'csi-%s' "$(printf '%s' "${handle}berth.csi.ioberth-e2e-node" | sha256sum | cut -d' ' -f1)"
}
attached() { # VA
	[ "$(kc get volumeattachment "$1" -o jsonpath='{.status.attached}/{.spec.nodeName}/{.status.attachmentMetadata.berth\.csi\.io/node}')" = true/berth-e2e-node/berth-e2e-node ]
}
detached() { ! kc get volumeattachment "$1" >/dev/null 2>&1; } # VA

# berth_pid: the pid of the node plugin's container process on this host
# (not berth controller's).
berth_pid() {
	local id
	id=$(kc -n kube-system get pods -l $node_pods -o jsonpath='{.items[0].status.containerStatuses[?(@.name=="berth")].containerID}')
	id=${id#containerd://}
	[ -n "$id" ] && ctr --address "$R/containerd.sock" -n k8s.io tasks ls | awk -v id="$id" '$1 == id && $3 == "RUNNING" { print $2 }'
}

t0=$SECONDS
kc create namespace $NS >/dev/null
kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: berth-restart}
provisioner: berth.csi.io
parameters: {csi.storage.k8s.io/fstype: xfs}
EOF

# 1. berth's pod restarted.
claim c1
pod p1 c1
if until_ok 180 running p1 && [ "$(token p1)" = p1 ]; then
	pv1=$(kc -n $NS get pvc c1 -o jsonpath='{.spec.volumeName}')
	va1=$(va "$pv1")
	if attached "$va1"; then
		ok "attach: VolumeAttachment $va1 of $pv1 attached to the node, publish_context berth.csi.io/node=berth-e2e-node"
	else
		fail "attach: no attached VolumeAttachment $va1 for $pv1 with the node in its metadata: $(kc get volumeattachments -o wide 2>&1)"
	fi
	kc -n kube-system delete pod -l $node_pods --wait=true >/dev/null
	if until_ok 120 berth_ready && [ "$(token p1)" = p1 ]; then
		kc -n $NS delete pod p1 --wait=true >/dev/null
		pod p1b c1
		if until_ok 180 running p1b && [ "$(token p1b)" = p1 ]; then
			ok "berth's pod restarted: the running pod kept its data, a new pod of the claim mounted it"
		else
			fail "after berth's pod restarted, a new pod of claim c1 did not start with the data"
		fi
	else
		fail "berth's new pod not ready, or p1 lost its data"
	fi
else
	fail "pod p1 did not start"
fi

# 1b. a second node for the claim p1b uses: a Node object without a
# kubelet, marked for the attach-detach controller as a kubelet marks its
# node. The pod bound to it must get Multi-Attach (the check the CO skips
# for drivers without attach) and no VolumeAttachment there.
ghost=berth-e2e-ghost
multi_attach() {
	kc -n $NS get events --field-selector involvedObject.name=p4,reason=FailedAttachVolume -o jsonpath='{.items[*].message}' | grep -q 'Multi-Attach error'
}
if [ -n "${va1:-}" ] && running p1b; then
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $ghost
  annotations: {volumes.kubernetes.io/controller-managed-attach-detach: "true"}
  labels: {kubernetes.io/hostname: $ghost}
EOF
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: p4, namespace: $NS}
spec:
  nodeName: $ghost
  containers:
  - {name: c, image: registry.k8s.io/e2e-test-images/busybox:1.37.0-1, command: [sleep, "100000"], volumeMounts: [{name: v, mountPath: /data}]}
  volumes: [{name: v, persistentVolumeClaim: {claimName: c1}}]
EOF
	handle=$(kc get pv "$pv1" -o jsonpath='{.spec.csi.volumeHandle}')
	ghost_va=csi-$(printf '%s' "${handle}berth.csi.io$ghost" | sha256sum | cut -d' ' -f1)
	if until_ok 60 multi_attach && detached "$ghost_va" && attached "$va1" && has_token p1b p1; then
		ok "a second node's pod of ReadWriteOnce claim c1: Multi-Attach refused by the CO ($(kc -n $NS get events --field-selector involvedObject.name=p4,reason=FailedAttachVolume -o jsonpath='{.items[0].message}')), no VolumeAttachment on $ghost, p1b untouched"
	else
		fail "a second node's pod of ReadWriteOnce claim c1: no Multi-Attach refusal, or a VolumeAttachment $ghost_va: $(kc get volumeattachments -o wide 2>&1)"
	fi
	# No kubelet there to confirm the pod's end.
	kc -n $NS delete pod p4 --grace-period=0 --force >/dev/null 2>&1
	kc delete node $ghost --wait=true >/dev/null
else
	fail "p1b not running: no second node tried"
fi

# 2. the kubelet restarted.
claim c2
pod p2 c2
if until_ok 180 running p2 && [ "$(token p2)" = p2 ]; then
	"$(dirname "$0")/cluster.sh" restart-kubelet
	# The node's status may still be the old kubelet's: ask the new one,
	# through exec, until it has taken the running pods over.
	if until_ok 120 has_token p2 p2 && has_token p1b p1; then
		pv2=$(kc -n $NS get pvc c2 -o jsonpath='{.spec.volumeName}')
		va2=$(va "$pv2")
		attached "$va2" && was_attached=1 || was_attached=0
		kc -n $NS delete pod p2 --wait=true >/dev/null
		if [ $was_attached = 1 ] && until_ok 60 gone p2 && until_ok 120 detached "$va2"; then
			ok "attach: VolumeAttachment $va2 deleted once no pod used $pv2"
		else
			fail "attach: VolumeAttachment $va2 not attached while p2 ran, or still there after p2 was deleted"
		fi
		if until_ok 60 gone p2 && ! grep -q "/pods/.*/volumes/kubernetes.io~csi/.*" <(awk '{print $2}' /proc/self/mounts | grep "$(kc -n $NS get pvc c2 -o jsonpath='{.spec.volumeName}')"); then
			ok "kubelet restarted: pods kept their data, a pod deleted afterwards was unpublished"
		else
			fail "after the kubelet restarted, deleting p2 left its volume published"
		fi
	else
		fail "after the kubelet restarted: node not Ready or data lost"
	fi
else
	fail "pod p2 did not start"
fi

# 3. berth killed while a pod's volume is being staged.
claim c3
until_ok 120 sh -c "[ \"\$(nsenter --net=$NSPATH -- $bin/kubectl --kubeconfig $S/admin.kubeconfig -n $NS get pvc c3 -o jsonpath='{.status.phase}')\" = Bound ]"
pod p3 c3
pv=$(kc -n $NS get pvc c3 -o jsonpath='{.spec.volumeName}')
killed=0
for ((i = 0; i < 1200; i++)); do
	# Staging has begun when berth attached the image file to a loop device;
	# the filesystem is made and mounted next.
	if [ -n "$(losetup -j "$S/files/$pv.img" 2>/dev/null)" ] && pid=$(berth_pid) && [ -n "$pid" ]; then
		kill -9 "$pid" && killed=1
		break
	fi
	sleep 0.05
done
if [ $killed = 1 ] && until_ok 240 running p3 && [ "$(token p3)" = p3 ] && until_ok 120 berth_ready; then
	ok "berth killed (SIGKILL) during the start of p3: the pod started with its volume"
else
	fail "berth killed during the start of p3 (killed=$killed): the pod did not start with its volume"
fi

# 4. berth upgraded in place: a rolling update of the DaemonSet to another
# image (berth's image under a second tag: the rollout replaces the pod as
# for a new release) and a rollback, under a pod that appends a counter to
# its volume and syncs after each line.
count() { kc -n $NS exec "$1" -- tail -n 1 /data/count; }
# in_order POD: the counter's lines are 1, 2, ... N, none lost or repeated.
in_order() { kc -n $NS exec "$1" -- awk 'NR != $1 { bad = 1 } END { exit bad }' /data/count; }
counting_past() { [ "$(count "$1")" -gt "$2" ]; } # POD N
node_image() { kc -n kube-system get pods -l $node_pods -o jsonpath='{.items[*].spec.containers[?(@.name=="berth")].image}'; }
# roll POD IMAGE WHAT KUBECTL-ARGS...: rolls the DaemonSet out to IMAGE.
roll() {
	local p=$1 img=$2 what=$3 before
	shift 3
	before=$(count "$p")
	if kc -n kube-system "$@" >/dev/null &&
		kc -n kube-system rollout status "ds/$ds" --timeout=180s >/dev/null &&
		until_ok 120 berth_ready && [ "$(node_image)" = "$img" ] &&
		until_ok 30 counting_past "$p" "$before" && running "$p" && in_order "$p"; then
		ok "$what: berth's pod runs $img, and $p went on writing ($before lines before, $(count "$p") after, every line in order)"
	else
		fail "$what to $img: node image [$(node_image)], $p $(kc -n $NS get pod "$p" -o jsonpath='{.status.phase}'), count before $before, now [$(count "$p" 2>&1)]"
	fi
}
claim c5
pod p5 c5 'i=0; while :; do i=$((i+1)); echo $i >> /data/count; sync; sleep 0.2; done'
ds=$(kc -n kube-system get ds -l $node_pods -o jsonpath='{.items[0].metadata.name}')
img=$(kc -n kube-system get ds "$ds" -o jsonpath='{.spec.template.spec.containers[?(@.name=="berth")].image}')
next=$img-next
if until_ok 180 running p5 && until_ok 30 counting_past p5 5 &&
	ctr --address "$R/containerd.sock" -n k8s.io images tag "$img" "$next" >/dev/null; then
	roll p5 "$next" "rolling update of the DaemonSet" set image "ds/$ds" "berth=$next"
	roll p5 "$img" "rollback of the DaemonSet" rollout undo "ds/$ds"
else
	fail "pod p5 did not start writing, or the image $img could not be tagged $next"
fi

# Everything deleted: nothing staged, published, attached or recorded.
kc delete namespace $NS --wait=true --timeout=180s >/dev/null
until_ok 120 sh -c "[ -z \"\$(nsenter --net=$NSPATH -- $bin/kubectl --kubeconfig $S/admin.kubeconfig get pv -o name)\" ]"
kc delete storageclass berth-restart >/dev/null
# berth's own pods (kube-system) keep their volumes: the node's and the
# controller's service-account tokens.
own=$(kc -n kube-system get pods -o jsonpath='{range .items[*]}{.metadata.uid}{"\n"}{end}' | sed 's|^|/var/lib/kubelet/pods/|; s|$|/|')
left=$(awk '{print $2}' /proc/self/mounts | grep -E '^/var/lib/kubelet/(plugins/kubernetes.io/csi|pods)/' | grep -v -F "${own:-/nonexistent/}" || true)
loops=$(losetup -ln -O NAME,BACK-FILE | grep "$S/files" || true)
files=$(ls "$S/files" 2>/dev/null)
# The filesystem marks (<state-dir>/filesystems/) outlive the volumes by
# design: a node cannot tell a deleted volume from one whose storage lost
# its filesystem (docs/guarantees.md). Every other record must be gone.
state=$(find /var/lib/berth -type f -name '*.json' -not -path '/var/lib/berth/filesystems/*' 2>/dev/null)
until_ok 120 sh -c "[ -z \"\$(nsenter --net=$NSPATH -- $bin/kubectl --kubeconfig $S/admin.kubeconfig get volumeattachments -o name)\" ]"
vas=$(kc get volumeattachments -o name 2>/dev/null)
marks=$(find /var/lib/berth/filesystems -type f -name '*.json' 2>/dev/null | wc -l)
if [ -z "$left$loops$files$state$vas" ]; then
	ok "after deleting every pod and claim: no mount, loop device, image file, VolumeAttachment or berth state left ($marks filesystem marks kept, as documented)"
else
	fail "left after deleting every pod and claim: mounts [$left] loops [$loops] files [$files] state [$state] volumeattachments [$vas]"
fi
log "$((SECONDS - t0))s"
echo "restart: $passed passed, $failed failed"
[ $failed = 0 ]
