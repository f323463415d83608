// Package nvmeof attaches NVMe over Fabrics namespaces (NVMe/TCP; RDMA
// passed through) for berth's CSI node service.
//
// Connecting writes a validated option string to /dev/nvme-fabrics and
// reads back "instance=N,cntlid=M" from the same file descriptor: no
// nvme-cli is needed at run time. Every field is checked before anything
// is written: a comma, '=', newline, NUL or a malformed value in any of
// them is an error wrapping errdefs.ErrInvalidArgument that names the
// field.
//
// # volume_context
//
// The keys (berth's, and csi-driver-nvmf's names, accepted too) and their
// ranges are documented once, in docs/volume-context.md; ParseVolumeContext
// implements them.
//
// # Host identity
//
// hostnqn and hostid come from /etc/nvme/hostnqn and /etc/nvme/hostid so
// that berth, nvme-cli and the array's host registration agree; missing
// files are created (see LoadHostIdentity). Before connecting, berth
// refuses an identity that pairs its hostnqn or hostid differently from
// an existing controller, which the kernel would reject with a bare
// EINVAL.
//
// # In-band authentication
//
// DH-HMAC-CHAP keys come from the stage secrets dhchapSecret (host key)
// and dhchapCtrlSecret (controller key, bidirectional), or the kernel's
// names dhchap_secret and dhchap_ctrl_secret, in nvme-cli's
// DHHC-1:<hh>:<base64>: form; ParseAuth validates them (hash id, length,
// CRC-32) and they are written nowhere but the connect string. A kernel
// without in-band authentication (no dhchap_secret attribute on its
// fabrics controllers) connects without authenticating when the target
// asks for none, so Attach deletes such a controller and refuses
// (errdefs.ErrUnsupported). A controller is reused only by a volume that
// names the keys it was connected with, compared in constant time with
// its sysfs dhchap_secret and dhchap_ctrl_secret; berth never changes
// the keys of a connected controller. A rejected key is
// errdefs.ErrPermissionDenied (EKEYREJECTED, measured on 6.12 for a
// wrong host key and for a controller that fails the controller key;
// ENOKEY for a target that requires a key the volume does not give;
// ECONNREFUSED from kernels before 6.7 while the target's port accepts
// TCP connections). Now and then 6.12 stalls for its 60 s admin timeout
// after a failed authentication and answers EIO instead, which is
// errdefs.ErrFailedPrecondition like a host the subsystem does not
// allow. The kernel authenticates only when the target asks for it: a
// target without keys for the host is connected unauthenticated, even
// with a controller key, and sysfs shows no difference.
//
// # TLS
//
// A volume with volume_context tls "true" connects every path with TLS
// 1.3 and a pre-shared key (see tls.go for what the kernel and tlshd do,
// as measured). The PSK comes from the stage secret tlsKey in the
// interchange format (ParseTLSKey validates it), is derived for the
// identity "NVMe0R<hh> <hostnqn> <subnqn>" as nvme-cli derives it
// (TLSKey.Derive) and inserted into a keyring "berth" below the kernel's
// .nvme keyring, whose serial the connect names (tls_key); or the volume
// names an operator's key in .nvme (tlsKeyName), or takes the one the
// kernel would pick there. A controller is reused only when its sysfs
// tls_key is the volume's key. berth's keys go when the subsystem's last
// controller on the node does. With tlsConcat "true" the volume gives no
// PSK: the kernel derives one from each controller's DH-HMAC-CHAP
// exchange (secure channel concatenation, Linux 6.15 and later), and a
// controller is reused only when its tls_key is such a derived key.
//
// # Paths and multipath
//
// Each distinct address is one controller. With native NVMe multipath
// (CONFIG_NVME_MULTIPATH=y, the default of distribution kernels) the
// kernel joins the controllers' paths under one head device, /dev/nvmeXnY,
// which is what Attach returns. Target.Health reports each path's
// controller state (live, connecting, resetting, deleting) and ANA state
// (/sys/block/nvmeXcYnZ/ana_state).
//
// An existing controller to the same subsystem, transport, address,
// port, host address and interface for the same hostnqn is reused, never
// duplicated. Namespaces of one subsystem share its controllers, so
// Detach flushes the namespace and deletes a controller only when no
// other volume needs it: the volumes Options.Staged lists (the agent's
// state, which survives restarts) and, as a second guard, any other
// namespace of the subsystem that is mounted or held open. Detach refuses
// (errdefs.ErrBusy) while its own namespace is still mounted.
//
// # Expand
//
// A target announces a namespace's new size with an asynchronous event;
// the kernel updates the device and sends a "change" uevent. ExpandTo
// waits for the size a caller needs, bounded by its context, and says so
// when the target never announced it. Expand, which knows no size, asks
// a live controller for the namespace's size (Identify Namespace, an
// admin command on the controller's character device): when the kernel
// has that size already Expand returns at once, else it asks for a rescan
// and returns as soon as the kernel shows the new size. Only when no
// controller answers does it wait up to a second for a change.
//
// # RDMA
//
// The rdma transport is validated and passed to the kernel like tcp, but
// berth's test VMs have no RDMA hardware, so it is untested.
package nvmeof
