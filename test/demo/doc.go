// Package demo is the QEMU part of `make demo`: berth serves its CSI
// socket inside a test guest (package test/vm), and an NVMe/TCP volume and
// an iSCSI volume with CHAP go through their whole node lifecycle there,
// driven by package test/demo/steps over gRPC, against targets the guest's
// kernel exports itself (nvmet, LIO).
//
// The host entry is TestDemoVM; it runs only with BERTH_DEMO=1, which
// scripts/demo.sh sets. Every step line carries the marker "DEMO| " so that
// the script can pick the table out of `go test -v` output.
package demo
