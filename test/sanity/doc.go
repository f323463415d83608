// Package sanity runs csi-sanity (kubernetes-csi/csi-test) against the
// real berth binary.
//
// TestSanity runs on the host with berth's file transport: the volumes are
// image files. TestVMSanityNVMe and TestVMSanityISCSI run csi-sanity inside
// QEMU guests (package test/vm) with a controller that makes a new NVMe/TCP
// subsystem (nvmet) or a new LIO iSCSI target for every volume, so berth's
// network transports go through the whole node lifecycle, mount and block.
//
// It is a module of its own: csi-test v5.6.0 is built on CSI spec
// v1.13.0, while berth stays on v1.12.0 (v1.13.0 dropped VolumeCondition,
// which kubelet still reads). The two specs never meet in one build: this
// module talks to berth over its socket only. It imports berth's test/vm
// and test/vm/target packages, which do not use the CSI spec.
package sanity
