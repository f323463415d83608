# berth — build, test and run targets. Everything a fresh Debian 12 machine
# needs is installed by `make deps` (called by the targets that need it).

GO        ?= go
GOFLAGS   ?=
BIN       ?= bin/berth
# The release this tree is (the file VERSION): berth version's version and the
# image tag; the commit it was built from is reported beside it.
VERSION   ?= $(shell cat VERSION)
COMMIT    ?= $(shell git describe --always --dirty --abbrev=40 --exclude='*' 2>/dev/null)
LDFLAGS   := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
PREFIX    ?= /usr/local

.PHONY: all build deps lint check test unit-test sanity-test manifest-test vm-test cover reliability vm-image image image-check e2e-deps e2e-build e2e e2e-prebuild e2e-ci bench demo install uninstall clean fuzz fuzz-list

all: build

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o $(BIN) .

# Host packages the tests use (mkfs, blkid, systemd tools, QEMU for the VM suite).
deps:
	./scripts/install-deps.sh

# go vet, staticcheck and deadcode (pinned, installed once into a cache
# outside the repository). deadcode lists the functions the berth binary
# never reaches; code only tests use lives in the tests (export_test.go),
# so any line it prints fails the target.
STATICCHECK_VERSION ?= v0.8.2
DEADCODE_VERSION ?= v0.41.0
TOOLS ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/berth-tools
# $(call install-tool,NAME,PACKAGE,VERSION): go install PACKAGE@VERSION, once,
# as $(TOOLS)/NAME-VERSION.
install-tool = test -x $(TOOLS)/$(1)-$(3) || { \
	GOBIN=$(TOOLS)/tmp-$(1) $(GO) install $(2)@$(3) && mv $(TOOLS)/tmp-$(1)/$(1) $(TOOLS)/$(1)-$(3); }
lint:
	@$(call install-tool,staticcheck,honnef.co/go/tools/cmd/staticcheck,$(STATICCHECK_VERSION))
	@$(call install-tool,deadcode,golang.org/x/tools/cmd/deadcode,$(DEADCODE_VERSION))
	$(GO) vet ./...
	$(TOOLS)/staticcheck-$(STATICCHECK_VERSION) ./...
	@echo "$(TOOLS)/deadcode-$(DEADCODE_VERSION) ."; \
	out=$$($(TOOLS)/deadcode-$(DEADCODE_VERSION) . 2>&1) || { echo "$$out"; exit 1; }; \
	if [ -n "$$out" ]; then \
		echo "$$out"; echo "deadcode: the binary never reaches the functions above: remove them, use them, or move what only tests need into the tests"; exit 1; \
	fi

# The fast loop, before every commit: make lint, then the tests that need
# neither root nor a VM. As root they run as nobody (CHECK_USER, see
# scripts/as-nobody.sh), so that each test that needs root skips, by the
# suite's own euid checks, as it does for a contributor without root;
# BERTH_CI is cleared, or those skips would fail. The host tests on loop
# devices are make unit-test's. About 30 s of CPU: 2-3 minutes on a
# loaded two-core host.
CHECK_USER ?= 65534
check: lint build
	BERTH_CI= BERTH_BIN=$(CURDIR)/$(BIN) CHECK_USER=$(CHECK_USER) $(GO) test -timeout 5m -skip '^TestVM|^TestCrashAtEveryStep$$' \
		$(if $(filter 0,$(shell id -u)),-exec $(CURDIR)/scripts/as-nobody.sh) ./...

# The whole suite: lint, unit and host tests (root, loop devices),
# csi-sanity, VMs, crash at every step, and a subset of the Kubernetes
# e2e on a single-node cluster.
test: deps e2e-prebuild lint unit-test sanity-test manifest-test vm-test reliability e2e-ci

# make test (CI) crashes the encrypted volumes' ext4 lifecycle at every
# step; make reliability run by itself adds the raw block one (13 minutes
# for both on an idle two-core host without KVM).
test: export BERTH_ENCRYPTED_CRASH_LIFECYCLES ?= ext4-luks

# Unit tests and host tests on loop devices, with internal/archtest's
# import rule, and test/upgrade, which builds v0.1.0 from this clone's
# history (a shallow clone fails it) and runs it and this berth on the
# same state (about 30 s). VM entry tests are named TestVM*; the host crash
# suite and the fault tests (FAULT_TESTS) run in reliability.
unit-test: build
	BERTH_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 15m -skip '^TestVM|^TestCrashAtEveryStep$$|^($(FAULT_TESTS))$$' ./...

# The Kubernetes manifests as helm and kustomize render them (helm lint,
# helm template, kustomize build: pinned, installed once beside staticcheck),
# decoded strictly into the API types, compared between the chart and the
# kustomize base, and checked against berth serve's flags (nested module).
HELM_VERSION ?= v4.3.2
KUSTOMIZE_VERSION ?= v5.8.2
manifest-test: build
	@$(call install-tool,helm,helm.sh/helm/v4/cmd/helm,$(HELM_VERSION))
	@$(call install-tool,kustomize,sigs.k8s.io/kustomize/kustomize/v5,$(KUSTOMIZE_VERSION))
	cd deploy/kubernetes/validate && BERTH_BIN=$(CURDIR)/$(BIN) \
		BERTH_HELM=$(TOOLS)/helm-$(HELM_VERSION) BERTH_KUSTOMIZE=$(TOOLS)/kustomize-$(KUSTOMIZE_VERSION) \
		$(GO) test -mod=mod -count=1 ./...

sanity-test: build
	cd test/sanity && BERTH_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 15m -skip '^TestVM' ./...

# The default guest image (Debian 12's 6.1 kernel), the one with Debian
# 13's 6.12 kernel, which has NVMe in-band authentication (TestVMNVMeoFAuth),
# and the one with the 7.3 kernel of Debian 13's backports, whose nvmet has
# NVMe reservations (TestVMNVMeReservations; a 37 MB download, ~10 s to
# build).
vm-image:
	./test/vm/image/build.sh
	./test/vm/image/build.sh trixie
	./test/vm/image/build.sh trixie-backports

# berth's container image, built without a container daemon: a Debian root
# with only the programs berth runs (cached in ~/.cache/berth-image), the
# static berth and the deploy/kubernetes wrappers, written as one archive
# that docker load, podman load and ctr images import read. Named
# IMAGE_NAME:VERSION, the image the manifests deploy; reproducible
# (SOURCE_DATE_EPOCH: HEAD's commit time).
IMAGE_NAME ?= ghcr.io/berth-csi/berth
IMAGE_TAG  ?= $(VERSION)
IMAGE      ?= bin/berth-image.tar
image: build
	GO=$(GO) ./scripts/image.sh $(BIN) $(IMAGE_TAG) $(IMAGE) $(IMAGE_NAME)

# Builds the image a second time, from berth built again elsewhere, and
# fails unless both archives are byte for byte the same; then crane (pinned,
# installed once beside staticcheck) loads the archive as docker load would
# and checks every layer against its digest and diff_id.
CRANE_VERSION ?= v0.22.1
image-check: image
	@$(call install-tool,crane,github.com/google/go-containerregistry/cmd/crane,$(CRANE_VERSION))
	$(TOOLS)/crane-$(CRANE_VERSION) validate --tarball $(IMAGE)
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/image-check/berth .
	GO=$(GO) ./scripts/image.sh bin/image-check/berth $(IMAGE_TAG) bin/image-check/berth-image.tar $(IMAGE_NAME)
	cmp $(IMAGE) bin/image-check/berth-image.tar
	@echo "image-check: two builds gave the same archive ($$(sha256sum < $(IMAGE) | cut -c1-16))"

# Tests that boot QEMU guests with real NVMe/TCP and iSCSI targets, but
# the crash suites and the fault tests (FAULT_TESTS), which run in
# reliability. One package at a time: every guest has two emulated CPUs,
# and guests of several packages at once on a small host make
# timing-sensitive tests (path failover, event order) flaky.
vm-test: build vm-image
	$(GO) test -p 1 -count=1 -timeout 25m -run '^TestVM' -skip '^TestVMBench|^TestVMCrash|^($(FAULT_TESTS))$$' ./...
	cd test/sanity && $(GO) test -count=1 -timeout 20m -run '^TestVM' ./...

# Coverage of the host tests (as unit-test runs them) and of the in-guest
# tests (as vm-test runs them; the guests send their counters back, see
# test/vm/cover.go), merged: one line per package, host alone and with the
# guests. Raw counters in $(COVER_DIR)/host and $(COVER_DIR)/vm.
COVER_DIR ?= bin/cover
cover: build vm-image
	@rm -rf $(COVER_DIR) && mkdir -p $(COVER_DIR)/host $(COVER_DIR)/vm
	GOCOVERDIR=$(CURDIR)/$(COVER_DIR)/host BERTH_BIN=$(CURDIR)/$(BIN) $(GO) test -count=1 -timeout 20m -cover -coverpkg=./... \
		-skip '^TestVM|^TestCrashAtEveryStep$$' ./... -args -test.gocoverdir=$(CURDIR)/$(COVER_DIR)/host >$(COVER_DIR)/host.log \
		|| { tail -40 $(COVER_DIR)/host.log; exit 1; }
	BERTH_VM_COVERDIR=$(CURDIR)/$(COVER_DIR)/vm $(GO) test -p 1 -count=1 -timeout 40m -run '^TestVM' -skip '^TestVMBench|^TestVMCrash' ./... \
		>$(COVER_DIR)/vm.log || { grep -E '^(---|ok|FAIL)' $(COVER_DIR)/vm.log | tail -40; exit 1; }
	@$(GO) tool covdata percent -i=$(COVER_DIR)/host | $(COVER_LINES) >$(COVER_DIR)/host.txt
	@$(GO) tool covdata percent -i=$(COVER_DIR)/host,$(COVER_DIR)/vm | $(COVER_LINES) >$(COVER_DIR)/all.txt
	@printf '%-28s %8s %12s\n' package host host+guests
	@awk 'NR == FNR { h[$$1] = $$2; next } { printf "%-28s %8s %12s\n", $$1, h[$$1] ? h[$$1] : "-", $$2 }' \
		$(COVER_DIR)/host.txt $(COVER_DIR)/all.txt

# covdata's lines as "package percent"; a package without statements
# (which covdata prints without a newline) is left out.
COVER_LINES = tr '\t' '\n' | awk '/^coverage:/ { print p, $$2; next } NF { p = $$1; sub("^github.com/berth-csi/berth/?", "", p); if (p == "") p = "(main)" }'

# Crash at every step (test/reliability): berth built with failpoints is
# killed at each step boundary of a volume's whole life, restarted, and the
# RPC retried; every run must converge with the data intact and nothing
# left. File volumes on this host; NVMe/TCP and iSCSI volumes in one QEMU
# guest per transport. Then the fault tests (FAULT_TESTS, in FAULT_PKGS):
# each fault scenario (a target outage, a silent path or portal, a dead
# shared subsystem, a shut-down filesystem, ...) counts its volumes, RPCs,
# RPCs past their deadline, bytes lost and leaks (test/reliability's
# Fault). Prints one table of every crash suite and one of the faults;
# unit-test and vm-test skip the fault tests, so make test runs them once.
RELIABILITY_TABLE ?= bin/reliability.md
FAULT_TESTS = TestUnstageShutDownFilesystem|TestVMNVMeoFFaults|TestVMISCSIFaults|TestVMISCSIFaultsMultipath
FAULT_PKGS  = ./agent/ ./nvmeof/ ./iscsi/
reliability: build vm-image
	@mkdir -p $(dir $(RELIABILITY_TABLE)) && rm -f $(RELIABILITY_TABLE) $(RELIABILITY_TABLE).faults $(RELIABILITY_TABLE).failures
	@status=0; start=$$(date +%s); \
	BERTH_RELIABILITY_TABLE=$(CURDIR)/$(RELIABILITY_TABLE) $(GO) test -count=1 -timeout 110m \
		-run '^(TestEveryBoundaryHasASuite|TestCrashAtEveryStep|TestVMCrashNVMeoF|TestVMCrashISCSI|TestVMCrashEncrypted)$$' ./test/reliability/ || status=$$?; \
	BERTH_RELIABILITY_TABLE=$(CURDIR)/$(RELIABILITY_TABLE) $(GO) test -p 1 -count=1 -timeout 30m \
		-run '^($(FAULT_TESTS))$$' $(FAULT_PKGS) || status=$$?; \
	echo; cat $(RELIABILITY_TABLE) 2>/dev/null || echo "no table: the suites did not get to report"; \
	echo; cat $(RELIABILITY_TABLE).faults 2>/dev/null || echo "no fault table: the fault tests did not get to report"; \
	if [ -s $(RELIABILITY_TABLE).failures ]; then echo; cat $(RELIABILITY_TABLE).failures; fi; \
	echo "reliability: $$(( $$(date +%s) - start ))s"; exit $$status

# A single-node Kubernetes v1.34.4 on this host (test/e2e/README.md): the
# control plane, kubelet and e2e.test built from the Go module proxy
# (cached in ~/.cache/berth-e2e and Go's build cache), containerd and etcd
# from Debian (make e2e-deps; not part of make deps), berth deployed as the
# DaemonSet of deploy/kubernetes with make image's image, the Kubernetes
# external storage suite run with test/e2e/testdriver.yaml, then torn down
# and checked that nothing is left. E2E_FOCUS, E2E_SKIP, E2E_PROCS,
# E2E_SERIAL=0 narrow it (test/e2e/scripts/run.sh).
e2e-deps:
	BERTH_E2E_DEPS=1 ./scripts/install-deps.sh

e2e-build: e2e-deps
	GO=$(GO) ./test/e2e/scripts/build.sh

e2e: e2e-build image
	BERTH_IMAGE=$(CURDIR)/$(IMAGE) BERTH_BIN=$(CURDIR)/$(BIN) ./test/e2e/scripts/e2e.sh

# make test's part of it: the E2E_SUBSET=ci specs (test/e2e/README.md),
# the restart tests and the checked tear-down. On a machine that has not
# built them yet, the Kubernetes commands, e2e.test, the sidecars and the
# test images take tens of minutes to build: e2e-prebuild, make test's second
# step, starts that build in the background at the lowest CPU priority
# (the QEMU guests of the VM suites come first), and e2e-ci waits for it
# (its lock), then builds whatever is still missing in the foreground,
# where a failed background build shows its error.
E2E_PREBUILD_LOG ?= bin/e2e-prebuild.log
e2e-prebuild: e2e-deps
	@mkdir -p bin; exec 9>bin/e2e-prebuild.lock; flock 9; \
	echo "e2e-prebuild: building the e2e cluster's commands and images in the background (log $(E2E_PREBUILD_LOG))"; \
	( nice -n 19 $(MAKE) --no-print-directory e2e-build image >$(E2E_PREBUILD_LOG) 2>&1 </dev/null || \
		echo "e2e-prebuild: failed (exit $$?)" >>$(E2E_PREBUILD_LOG) ) &

e2e-ci:
	@mkdir -p bin; t=$$(date +%s); flock bin/e2e-prebuild.lock true; \
	echo "e2e-ci: waited $$(( $$(date +%s) - t ))s for the background build"; \
	tail -n 3 $(E2E_PREBUILD_LOG) 2>/dev/null || true
	E2E_SUBSET=ci $(MAKE) --no-print-directory e2e

bench: build vm-image
	./scripts/bench.sh

demo: deps build
	./scripts/demo.sh

# The unit runs the binary where PREFIX put it. uninstall removes what
# install wrote and nothing else: berth's state directory, the node's
# hostnqn/hostid and iSCSI node records stay (README, "Upgrade, rollback and uninstall").
UNIT_DIR ?= /etc/systemd/system
install: build
	install -D -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/bin/berth
	install -d $(DESTDIR)$(UNIT_DIR)
	sed 's|^ExecStart=/usr/local/bin/berth |ExecStart=$(PREFIX)/bin/berth |' systemd/berth.service >$(DESTDIR)$(UNIT_DIR)/berth.service
	chmod 0644 $(DESTDIR)$(UNIT_DIR)/berth.service
	install -m 0644 systemd/berth.socket $(DESTDIR)$(UNIT_DIR)/berth.socket

uninstall:
	rm -f $(DESTDIR)$(PREFIX)/bin/berth $(DESTDIR)$(UNIT_DIR)/berth.service $(DESTDIR)$(UNIT_DIR)/berth.socket

# Each fuzz target for FUZZTIME (go test -fuzz runs one target at a time):
# every func Fuzz* of the test files go list names for this module's
# packages in this build, so that a new target is fuzzed without a list
# to add it to. make fuzz-list prints them.
FUZZTIME ?= 30s
FUZZ_TARGETS = $(GO) list -f '{{$$p := .ImportPath}}{{range .TestGoFiles}}{{$$p}} {{$$.Dir}}/{{.}}{{"\n"}}{{end}}{{range .XTestGoFiles}}{{$$p}} {{$$.Dir}}/{{.}}{{"\n"}}{{end}}' ./... | \
	while read -r pkg file; do sed -n "s|^func \(Fuzz[A-Za-z0-9_]*\)(.*|$$pkg \1|p" "$$file"; done
fuzz:
	@set -e; targets=$$($(FUZZ_TARGETS)); test -n "$$targets" || { echo "fuzz: no fuzz targets found"; exit 1; }; \
	echo "$$targets" | while read -r pkg fn; do \
		echo "== $$pkg $$fn ($(FUZZTIME))"; \
		$(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg </dev/null; \
	done

fuzz-list:
	@$(FUZZ_TARGETS)

clean:
	rm -rf bin
