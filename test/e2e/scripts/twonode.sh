#!/bin/bash
# A ReadWriteOnce volume between two nodes, on the cluster of cluster.sh
# with a second node added on this host (cluster.sh node-b up: a kubelet
# with its own containerd, root directory, cgroup root, address and ports,
# and its own berth; both berths use one file root, which plays the shared
# array). The file transport does not fence: what keeps the volume on one
# node here is the CO's Multi-Attach check (attachRequired: true, berth
# controller and the external-attacher as deploy/kubernetes deploys them)
# and berth's stage, which refuses a publish_context naming another node.
#
#   reproduce   with the CSIDriver of before (attachRequired: false), two
#               pods of one ReadWriteOnce claim, one on each node, both run
#               with the volume mounted on both nodes at once
#               (kubernetes/kubernetes#111799); with the CSIDriver as
#               deployed, the second node's pod gets Multi-Attach and the
#               volume stays on the first node only.
#   rollout     a Deployment of one pod with a ReadWriteOnce claim rolled
#               out to the other node (maxSurge 0: the default maxSurge
#               keeps the old pod until the new one is ready, which a
#               ReadWriteOnce volume on another node never is): the new
#               pod runs there with the data, and the volume is never
#               mounted on both nodes.
#   statefulset a StatefulSet's pod with data written to its volume moved to
#               the other node (its node cordoned, the pod deleted): the
#               data is there.
#   out-of-service  the first node's machine goes away (cluster.sh
#               crash-node says what is emulated) and the node is tainted
#               node.kubernetes.io/out-of-service=nodeshutdown:NoExecute: its
#               StatefulSet pod runs on the other node with its data (the
#               berth-controller pod, which ran on the lost node, moves
#               too). The node then comes back, and what it had of the
#               volume is cleaned up (no mount, no berth record).
# While a volume moves, a sampler reads this host's mountinfo (both
# kubelets and both berths mount in the host's mount namespace) every
# 50 ms and counts the volume's staging and publish mounts below each
# kubelet's directory; a sample with mounts below both fails the case.
# At the end every pod and claim is deleted, the berth-controller pod is
# put back on the first node, node B is removed and nothing of the volumes
# may be left. Prints a table (case, expected, seen, time) and
# "twonode: N passed, N failed".
set -uo pipefail
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
here=$(cd "$(dirname "$0")/.." && pwd)
scripts=$here/scripts
E2E_CACHE=${E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/berth-e2e}
bin=$E2E_CACHE/bin
S=/var/lib/berth-e2e
NSPATH=/run/netns/berth-e2e
A=berth-e2e-node
B=berth-e2e-node-b
KA=/var/lib/kubelet
KB=$S/node-b/kubelet
NS=berth-twonode
SC=berth-twonode
work=$(mktemp -d /tmp/berth-twonode.XXXXXX)
passed=0 failed=0
rows=()
kc() { nsenter --net="$NSPATH" -- "$bin/kubectl" --kubeconfig "$S/admin.kubeconfig" "$@"; }
log() { printf 'twonode: %s\n' "$*" >&2; }

# result CASE EXPECTED SEEN SECONDS OK
result() {
	if [ "$5" = 1 ]; then
		log "ok: $1: $3"
		passed=$((passed + 1))
		rows+=("$1|$2|$3|$4s|ok")
	else
		log "FAILED: $1: expected $2; seen: $3"
		failed=$((failed + 1))
		rows+=("$1|$2|$3|$4s|FAILED")
	fi
}

# until_ok SECONDS CMD...: CMD succeeds within SECONDS.
until_ok() {
	local secs=$1 i
	shift
	for ((i = 0; i < secs * 2; i++)); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.5
	done
	return 1
}

phase() { kc -n $NS get pod "$1" -o jsonpath='{.status.phase}' 2>/dev/null; }
running() { [ "$(phase "$1")" = Running ]; }
node_of() { kc -n $NS get pod "$1" -o jsonpath='{.spec.nodeName}' 2>/dev/null; }
uid_of() { kc -n $NS get pod "$1" -o jsonpath='{.metadata.uid}' 2>/dev/null; }
# running_on POD NODE [NOT-UID]: POD runs on NODE (and is not the pod of
# that uid), read in one answer: the pod of a name may be replaced between
# two.
running_on() {
	local s
	s=$(kc -n $NS get pod "$1" -o jsonpath='{.status.phase} {.spec.nodeName} {.metadata.uid}') || return 1
	set -- "$s" "$2" "${3:-}"
	[ "${1% *}" = "Running $2" ] && [ "${1##* }" != "$3" ]
}
gone() { ! kc -n $NS get pod "$1" >/dev/null 2>&1; }
token() { kc -n $NS exec "$1" -- cat /data/token; }
pv_of() { kc -n $NS get pvc "$1" -o jsonpath='{.spec.volumeName}'; }
handle_of() { kc get pv "$1" -o jsonpath='{.spec.csi.volumeHandle}'; }
# va PV NODE: the name the kubelet and the attach-detach controller give
# PV's VolumeAttachment on NODE.
va() { printf 'csi-%s' "$(printf '%s' "$(handle_of "$1")berth.csi.io$2" | sha256sum | cut -d' ' -f1)"; }
attached_to() { # PV NODE
	[ "$(kc get volumeattachment "$(va "$1" "$2")" -o jsonpath='{.status.attached}/{.status.attachmentMetadata.berth\.csi\.io/node}')" = "true/$2" ]
}
no_va() { ! kc get volumeattachment "$(va "$1" "$2")" >/dev/null 2>&1; } # PV NODE
multi_attach() { # POD
	kc -n $NS get events --field-selector "involvedObject.name=$1,reason=FailedAttachVolume" -o jsonpath='{.items[*].message}' | grep -q 'Multi-Attach error'
}
node_ready_is() { # NODE STATUS
	[ "$(kc get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}')" = "$2" ]
}
controller_on() { # NODE
	[ "$(kc -n kube-system get pods -l app.kubernetes.io/component=controller -o jsonpath='{range .items[?(@.status.phase=="Running")]}{.spec.nodeName}{" "}{end}')" = "$1 " ] &&
		[ "$(kc -n kube-system get deployment berth-controller -o jsonpath='{.status.availableReplicas}')" = 1 ]
}

# sample PV OUT: until killed, appends "TIME MOUNTS-A MOUNTS-B" to OUT about
# every 50 ms: the mounts of PV below each kubelet's directory, its staging
# mount (plugins/kubernetes.io/csi/berth.csi.io/<sha256 of the handle>/
# globalmount) and its pods' publish mounts
# (pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount). No command runs in
# the loop: a sample costs a read of mountinfo.
sample() {
	local pv=$1 out=$2 sha sa sb fd a b lines l f
	sha=$(printf '%s' "$(handle_of "$pv")" | sha256sum | cut -d' ' -f1)
	sa=$KA/plugins/kubernetes.io/csi/berth.csi.io/$sha/globalmount
	sb=$KB/plugins/kubernetes.io/csi/berth.csi.io/$sha/globalmount
	exec {fd}<> <(:)
	set -f # the fields are split, never globbed
	while :; do
		a=0 b=0
		mapfile -t lines </proc/self/mountinfo
		for l in "${lines[@]}"; do
			f=($l) # the 5th field is the mount point
			case ${f[4]} in
			"$sa" | "$KA"/pods/*/volumes/kubernetes.io~csi/"$pv"/mount) a=$((a + 1)) ;;
			"$sb" | "$KB"/pods/*/volumes/kubernetes.io~csi/"$pv"/mount) b=$((b + 1)) ;;
			esac
		done
		echo "$EPOCHREALTIME $a $b"
		read -r -t 0.05 -u "$fd" _ || true
	done >>"$out"
}
sampler_pid=
start_sampler() { # PV OUT
	: >"$2"
	sample "$1" "$2" &
	sampler_pid=$!
	until [ -s "$2" ]; do sleep 0.05; done
}
stop_sampler() {
	[ -n "$sampler_pid" ] && kill "$sampler_pid" 2>/dev/null && wait "$sampler_pid" 2>/dev/null
	sampler_pid=
}
# samples OUT: "N samples (largest gap G ms), on A only X, on B only Y,
# on both Z, on neither W".
samples() {
	awk 'NR > 1 && ($1 - t) * 1000 > gap { gap = ($1 - t) * 1000 } { t = $1 }
		$2 > 0 && $3 > 0 { both++ } $2 > 0 && $3 == 0 { a++ } $2 == 0 && $3 > 0 { b++ } $2 == 0 && $3 == 0 { none++ }
		END { printf "%d samples (largest gap %d ms): on A only %d, on B only %d, on both %d, on neither %d", NR, gap, a, b, both, none }' "$1"
}
on_both() { awk '$2 > 0 && $3 > 0 { n++ } END { print n + 0 }' "$1"; }
# order OUT: the sequence of states, each once per run ("A none B").
order() {
	awk '{ s = ($2 > 0 && $3 > 0) ? "both" : $2 > 0 ? "A" : $3 > 0 ? "B" : "none"; if (s != last) { printf "%s%s", sep, s; sep = " "; last = s } }' "$1"
}

claim() { # NAME
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1, namespace: $NS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: $SC
  resources: {requests: {storage: 512Mi}}
EOF
}

# pod NAME NODE CLAIM: a pod bound to NODE that leaves its name in
# /data/token once, then sleeps.
pod() {
	kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: $1, namespace: $NS}
spec:
  nodeName: $2
  terminationGracePeriodSeconds: 1
  containers:
  - name: c
    image: registry.k8s.io/e2e-test-images/busybox:1.37.0-1
    command: [sh, -c, 'test -f /data/token || { echo $1 > /data/token; sync; }; exec sleep 100000']
    volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: $3}}]
EOF
}

# csidriver ATTACH-REQUIRED: the CSIDriver berth.csi.io made again
# (attachRequired cannot be changed in place) with attachRequired set;
# true is the one test/e2e/deploy deploys.
csidriver() {
	kc delete csidriver berth.csi.io --wait=true >/dev/null
	kc kustomize "$here/deploy" |
		awk '/^---/ { if (d) printf "%s", doc; doc = ""; d = 0; next } { doc = doc $0 "\n" } /^kind: CSIDriver/ { d = 1 } END { if (d) printf "%s", doc }' |
		sed "s/attachRequired: true/attachRequired: $1/" | kc apply -f - >/dev/null
	[ "$(kc get csidriver berth.csi.io -o jsonpath='{.spec.attachRequired}')" = "$1" ]
}

# note PV: PV is one of this test's volumes, which cleanup checks.
note() { grep -qs "^$1 " "$work/volumes" || echo "$1 $(handle_of "$1" | sha256sum | cut -d' ' -f1)" >>"$work/volumes"; }

crashed=0 tainted=0
# cleanup: node A back and schedulable, every pod and claim deleted, the
# berth-controller pod on node A, node B removed; then nothing of the
# volumes may be left.
cleanup() {
	local t0=$SECONDS ok=1 why=() vols=() v pv sha i
	stop_sampler
	if [ $crashed = 1 ]; then
		"$scripts/cluster.sh" boot-node && crashed=0
	fi
	[ $tainted = 0 ] || kc taint node $A node.kubernetes.io/out-of-service- >/dev/null 2>&1
	tainted=0
	kc uncordon $A >/dev/null 2>&1
	kc get csidriver berth.csi.io -o jsonpath='{.spec.attachRequired}' 2>/dev/null | grep -qx true || csidriver true
	for pv in $(kc -n $NS get pvc -o jsonpath='{.items[*].spec.volumeName}' 2>/dev/null); do
		note "$pv"
	done
	kc delete namespace $NS --wait=true --timeout=240s >/dev/null 2>&1 || why+=("namespace $NS not deleted")
	kc delete storageclass $SC --ignore-not-found >/dev/null 2>&1
	# This test's volumes (name, SHA-256 of the handle: the name of berth's
	# record and of the kubelet's staging directory).
	[ -f "$work/volumes" ] && mapfile -t vols <"$work/volumes"
	mine() { # KIND: the objects of KIND that name one of the volumes
		local v
		for v in "${vols[@]}"; do
			kc get "$1" -o jsonpath='{range .items[*]}{.metadata.name}{" "}{.spec.source.persistentVolumeName}{"\n"}{end}' | awk -v pv="${v% *}" '$1 == pv || $2 == pv { print $1 }'
		done
	}
	for ((i = 0; i < 120; i++)); do
		[ -z "$(mine pv)$(mine volumeattachments)" ] && break
		sleep 1
	done
	[ -z "$(mine pv)" ] || why+=("PVs left: $(mine pv)")
	[ -z "$(mine volumeattachments)" ] || why+=("VolumeAttachments left: $(mine volumeattachments)")
	# berth's records of them on node B, while it is there.
	for v in "${vols[@]}"; do
		[ ! -e "$S/node-b/berth/volumes/${v#* }.json" ] || why+=("node B's berth record of ${v% *} left")
	done
	# The berth-controller pod back on node A, before node B goes.
	if ! controller_on $A; then
		kc cordon $B >/dev/null 2>&1
		kc -n kube-system delete pod -l app.kubernetes.io/component=controller --wait=true >/dev/null 2>&1
		until_ok 120 controller_on $A || why+=("berth-controller not back on $A")
	fi
	"$scripts/cluster.sh" node-b down || why+=("node B not removed")
	# Nothing of them left on node A or on the host: mounts, loop devices
	# over their image files, berth records.
	for v in "${vols[@]}"; do
		pv=${v% *} sha=${v#* }
		[ -z "$(awk -v pv="$pv" -v sha="$sha" 'index($5, "/" pv "/") || index($5, "/" sha "/") { print $5 }' /proc/self/mountinfo)" ] || why+=("mounts of $pv left")
		[ -z "$(losetup -ln -O NAME,BACK-FILE | grep -F "/$pv.img")" ] || why+=("loop device over $pv.img left")
		[ ! -e "/var/lib/berth/volumes/$sha.json" ] || why+=("node A's berth record of $pv left")
	done
	[ ${#why[@]} = 0 ] || ok=0
	result cleanup "pods, claims and node B gone, nothing of the volumes left" "${why[*]:-node A schedulable, berth-controller on $A, node B removed; of the ${#vols[@]} volumes no PV, VolumeAttachment, mount, loop device or berth record left}" $((SECONDS - t0)) $ok
}

t_all=$SECONDS
if ! "$scripts/cluster.sh" node-b up; then
	"$scripts/cluster.sh" node-b down
	log "node B did not come up"
	echo "twonode: 0 passed, 1 failed"
	exit 1
fi
result "node B joins" "Ready, berth in its CSINode" "$B Ready, CSINode lists berth.csi.io" $((SECONDS - t_all)) 1
trap 'stop_sampler; exit 1' INT TERM
kc create namespace $NS >/dev/null
kc apply -f - >/dev/null <<EOF
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: $SC}
provisioner: berth.csi.io
parameters: {csi.storage.k8s.io/fstype: xfs}
EOF

# --- reproduce ------------------------------------------------------------
t0=$SECONDS
seen=() ok=0
if csidriver false; then
	claim r
	pod r1 $A r
	if until_ok 180 running r1; then
		pv=$(pv_of r) && note "$pv"
		start_sampler "$pv" "$work/reproduce.samples"
		pod r2 $B r
		until_ok 120 running r2
		sleep 1
		stop_sampler
		if running r1 && running r2 && [ "$(on_both "$work/reproduce.samples")" -gt 0 ]; then
			ok=1
		fi
		seen+=("r1 $(phase r1) on $(node_of r1), r2 $(phase r2) on $(node_of r2); $(samples "$work/reproduce.samples")")
	else
		seen+=("r1 did not start")
	fi
	kc -n $NS delete pod r1 r2 --wait=true --timeout=120s >/dev/null
else
	seen+=("the CSIDriver could not be made with attachRequired: false")
fi
result "reproduce, attachRequired: false" "both pods Running, mounted on both nodes" "${seen[*]}" $((SECONDS - t0)) $ok

t0=$SECONDS
seen=() ok=0
if csidriver true; then
	pod r3 $A r
	if until_ok 180 running r3 && until_ok 60 attached_to "$pv" $A; then
		start_sampler "$pv" "$work/refused.samples"
		pod r4 $B r
		ma=0
		until_ok 60 multi_attach r4 && ma=1
		# The refusal holds: r4 waits, the volume stays on node A.
		sleep 10
		stop_sampler
		if [ $ma = 1 ] && ! running r4 && no_va "$pv" $B && running r3 && [ "$(token r3)" = r1 ] &&
			[ "$(on_both "$work/refused.samples")" = 0 ] && [ "$(awk '$3 > 0' "$work/refused.samples" | wc -l)" = 0 ]; then
			ok=1
		fi
		seen+=("r4 $(phase r4), Multi-Attach event: $([ $ma = 1 ] && echo yes || echo no), VolumeAttachment on $B: $(no_va "$pv" $B && echo none || echo yes); $(samples "$work/refused.samples")")
	else
		seen+=("r3 did not start on $A with its VolumeAttachment attached")
	fi
	kc -n $NS delete pod r4 --grace-period=0 --force >/dev/null 2>&1
	kc -n $NS delete pod r3 --wait=true --timeout=120s >/dev/null
	until_ok 60 no_va "$pv" $A || seen+=("(VolumeAttachment on $A left)")
else
	seen+=("the CSIDriver could not be made again with attachRequired: true")
fi
result "reproduce, attachRequired: true" "second node's pod refused (Multi-Attach), never mounted on both" "${seen[*]}" $((SECONDS - t0)) $ok

# --- the workloads of the other cases, on node A ----------------------------
kc cordon $B >/dev/null
claim roll
kc apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: Deployment
metadata: {name: roll, namespace: $NS}
spec:
  replicas: 1
  strategy: {type: RollingUpdate, rollingUpdate: {maxSurge: 0, maxUnavailable: 1}}
  selector: {matchLabels: {app: roll}}
  template:
    metadata: {labels: {app: roll}}
    spec:
      nodeSelector: {kubernetes.io/hostname: $A}
      # sleep, as PID 1, ignores SIGTERM: the old pod keeps its volume
      # mounted for the whole grace period while the new one is scheduled.
      terminationGracePeriodSeconds: 3
      containers:
      - name: c
        image: registry.k8s.io/e2e-test-images/busybox:1.37.0-1
        command: [sh, -c, 'test -f /data/token || { hostname > /data/token; sync; }; exec sleep 100000']
        volumeMounts: [{name: v, mountPath: /data}]
      volumes: [{name: v, persistentVolumeClaim: {claimName: roll}}]
EOF
for s in sts oos; do
	kc apply -f - >/dev/null <<EOF
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: $s, namespace: $NS}
spec:
  replicas: 1
  serviceName: $s
  selector: {matchLabels: {app: $s}}
  template:
    metadata: {labels: {app: $s}}
    spec:
      terminationGracePeriodSeconds: 1
      containers:
      - name: c
        image: registry.k8s.io/e2e-test-images/busybox:1.37.0-1
        command: [sleep, "100000"]
        volumeMounts: [{name: data, mountPath: /data}]
  volumeClaimTemplates:
  - metadata: {name: data}
    spec:
      accessModes: [ReadWriteOnce]
      storageClassName: $SC
      resources: {requests: {storage: 512Mi}}
EOF
done
# roll_pod: the one pod of roll, none other and not terminating.
roll_pod() {
	local p
	p=$(kc -n $NS get pods -l app=roll -o jsonpath='{range .items[*]}{.metadata.name}{","}{.metadata.deletionTimestamp}{" "}{end}')
	p=${p% }
	case $p in "" | *" "* | *,?*) return 1 ;; esac
	echo "${p%,}"
}
roll_on() { local p; p=$(roll_pod) && running_on "$p" "$1"; } # NODE
# write_blob POD: 8 MiB of random data into /data/blob, synced; prints
# its md5sum.
write_blob() { kc -n $NS exec "$1" -- sh -c 'dd if=/dev/urandom of=/data/blob bs=1M count=8 2>/dev/null && sync && md5sum /data/blob' | cut -d' ' -f1; }
md5_of() { kc -n $NS exec "$1" -- md5sum /data/blob | cut -d' ' -f1; }
until_ok 240 roll_on $A && until_ok 240 running_on sts-0 $A && until_ok 240 running_on oos-0 $A
workloads=$?
kc uncordon $B >/dev/null

# --- rollout ----------------------------------------------------------------
t0=$SECONDS
seen=() ok=0
if [ $workloads = 0 ]; then
	old=$(roll_pod)
	tok=$(token "$old")
	pv=$(pv_of roll) && note "$pv"
	start_sampler "$pv" "$work/rollout.samples"
	kc -n $NS patch deployment roll --type=merge -p "{\"spec\":{\"template\":{\"spec\":{\"nodeSelector\":{\"kubernetes.io/hostname\":\"$B\"}}}}}" >/dev/null
	kc -n $NS rollout status deployment roll --timeout=240s >/dev/null
	until_ok 120 roll_on $B
	sleep 1
	stop_sampler
	new=$(roll_pod)
	newtok=$(token "$new" 2>/dev/null)
	ma=0
	multi_attach "$new" && ma=1
	seq=$(order "$work/rollout.samples")
	if [ "$new" != "$old" ] && running_on "$new" $B && [ -n "$tok" ] && [ "$newtok" = "$tok" ] &&
		[ "$(on_both "$work/rollout.samples")" = 0 ] && [ "${seq%% *}" = A ] && [ "${seq##* }" = B ]; then
		ok=1
	fi
	seen+=("$new $(phase "$new") on $(node_of "$new") with the data of $old ($newtok); Multi-Attach while $old held it: $([ $ma = 1 ] && echo yes || echo no); mounted: $seq; $(samples "$work/rollout.samples")")
else
	seen+=("the workloads did not start on $A")
fi
result rollout "new pod on $B with the data, never mounted on both" "${seen[*]}" $((SECONDS - t0)) $ok

# --- StatefulSet moved --------------------------------------------------------
t0=$SECONDS
seen=() ok=0
if [ $workloads = 0 ] && want=$(write_blob sts-0) && [ -n "$want" ]; then
	uid=$(uid_of sts-0)
	pv=$(pv_of data-sts-0) && note "$pv"
	start_sampler "$pv" "$work/statefulset.samples"
	kc cordon $A >/dev/null
	kc -n $NS delete pod sts-0 --wait=false >/dev/null
	until_ok 240 running_on sts-0 $B "$uid"
	stop_sampler
	kc uncordon $A >/dev/null
	got=$(md5_of sts-0 2>/dev/null)
	if running_on sts-0 $B "$uid" && [ "$got" = "$want" ] && [ "$(on_both "$work/statefulset.samples")" = 0 ]; then
		ok=1
	fi
	seen+=("sts-0 $(phase sts-0) on $(node_of sts-0), md5 written $want, read $got; mounted: $(order "$work/statefulset.samples"); $(samples "$work/statefulset.samples")")
else
	seen+=("sts-0 did not start on $A, or its data could not be written")
fi
result "StatefulSet moved" "sts-0 on $B, same data" "${seen[*]}" $((SECONDS - t0)) $ok

# --- node out of service ------------------------------------------------------
t0=$SECONDS
seen=() ok=0
if [ $workloads = 0 ] && want=$(write_blob oos-0) && [ -n "$want" ]; then
	uid=$(uid_of oos-0)
	pv=$(pv_of data-oos-0) && note "$pv"
	start_sampler "$pv" "$work/out-of-service.samples"
	crashed=1
	"$scripts/cluster.sh" crash-node
	tc=$SECONDS
	# The node lifecycle controller marks it after its grace period (50 s).
	until_ok 180 node_ready_is $A Unknown
	tn=$((SECONDS - tc))
	kc taint node $A node.kubernetes.io/out-of-service=nodeshutdown:NoExecute >/dev/null && tainted=1
	until_ok 300 running_on oos-0 $B "$uid"
	tr=$((SECONDS - tc))
	stop_sampler
	got=$(md5_of oos-0 2>/dev/null)
	if running_on oos-0 $B "$uid" && [ "$got" = "$want" ] && no_va "$pv" $A && attached_to "$pv" $B &&
		[ "$(on_both "$work/out-of-service.samples")" = 0 ]; then
		ok=1
	fi
	seen+=("$A NotReady after ${tn}s, oos-0 $(phase oos-0) on $(node_of oos-0) ${tr}s after the crash, md5 written $want, read $got; VolumeAttachment on $A: $(no_va "$pv" $A && echo gone || echo left), on $B: $(attached_to "$pv" $B && echo attached || echo no); berth-controller on $(kc -n kube-system get pods -l app.kubernetes.io/component=controller -o jsonpath='{.items[*].spec.nodeName}'); mounted: $(order "$work/out-of-service.samples")")
else
	seen+=("oos-0 did not start on $A, or its data could not be written")
fi
result "node out of service" "oos-0 on $B with its data" "${seen[*]}" $((SECONDS - t0)) $ok

# Node A back: its kubelet and berth clean up what the crash left of the
# volume that moved (the staging directory, berth's record).
t0=$SECONDS
seen=() ok=0
if [ $crashed = 1 ] && "$scripts/cluster.sh" boot-node; then
	crashed=0
	kc taint node $A node.kubernetes.io/out-of-service- >/dev/null && tainted=0
	rec=/var/lib/berth/volumes/$(printf '%s' "$(handle_of "$pv")" | sha256sum | cut -d' ' -f1).json
	sha=$(printf '%s' "$(handle_of "$pv")" | sha256sum | cut -d' ' -f1)
	clean() { [ ! -e "$rec" ] && [ ! -e "$KA/plugins/kubernetes.io/csi/berth.csi.io/$sha" ]; }
	if until_ok 180 clean && running_on oos-0 $B "$uid" && [ "$(md5_of oos-0)" = "$want" ]; then
		ok=1
	fi
	seen+=("$A Ready; berth record of the moved volume: $([ -e "$rec" ] && echo left || echo gone), its staging directory on $A: $([ -e "$KA/plugins/kubernetes.io/csi/berth.csi.io/$sha" ] && echo left || echo gone); oos-0 still on $(node_of oos-0)")
else
	seen+=("node A did not boot")
fi
result "node A back" "the moved volume's leftovers on $A cleaned up, oos-0 untouched" "${seen[*]}" $((SECONDS - t0)) $ok

cleanup
rm -rf "$work"

log "$((SECONDS - t_all))s in all"
printf '\n%-34s | %-62s | %s | %s\n' case expected time result
for r in "${rows[@]}"; do
	IFS='|' read -r c e s t st <<<"$r"
	printf '%-34s | %-62s | %5s | %s\n' "$c" "$e" "$t" "$st"
	printf '    seen: %s\n' "$s"
done
echo "twonode: $passed passed, $failed failed"
[ $failed = 0 ]
