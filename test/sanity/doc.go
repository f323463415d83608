// Package sanity runs csi-sanity (kubernetes-csi/csi-test) against the
// real berth binary.
//
// It is a module of its own: csi-test v5.6.0 is built on CSI spec
// v1.13.0, while berth stays on v1.12.0 (v1.13.0 dropped VolumeCondition,
// which kubelet still reads). The two specs never meet in one build: this
// module talks to berth over its socket only and does not import it.
package sanity
