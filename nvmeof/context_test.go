package nvmeof

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func TestParseVolumeContext(t *testing.T) {
	for _, tc := range []struct {
		name string
		vc   map[string]string
		want Volume
		key  string
	}{
		{
			name: "single path",
			vc:   map[string]string{"transport": "nvmeof", "nqn": subA, "nsid": "1", "traddr": "127.0.0.1", "fsType": "xfs"},
			want: Volume{NQN: subA, NSID: 1, Paths: []Path{{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4420"}}},
			key:  "nvmeof:" + subA + "/nsid=1",
		},
		{
			name: "csi-driver-nvmf names",
			vc: map[string]string{"targetTrAddr": "10.0.0.5", "targetTrPort": "4430", "targetTrType": "tcp", "nqn": subA,
				"deviceUUID": "6E4F2A2D-0C1B-4B8E-9C55-7E4D3F1A2B3C"},
			want: Volume{NQN: subA, UUID: "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c", Paths: []Path{{TrType: "tcp", TrAddr: "10.0.0.5", TrSvcID: "4430"}}},
			key:  "nvmeof:" + subA + "/uuid=6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c",
		},
		{
			name: "multipath lists merged",
			vc: map[string]string{"nqn": subA, "nguid": "00112233445566778899AABBCCDDEEFF", "traddr": "127.0.0.1, 0::1", "trsvcid": "4420",
				"targets": "127.0.0.1:4421,[::1]:4422,127.0.0.1:4420,array.example.com,fd00::7"},
			want: Volume{NQN: subA, NGUID: nguid1, Paths: []Path{
				{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4420"},
				{TrType: "tcp", TrAddr: "::1", TrSvcID: "4420"},
				{TrType: "tcp", TrAddr: "127.0.0.1", TrSvcID: "4421"},
				{TrType: "tcp", TrAddr: "::1", TrSvcID: "4422"},
				{TrType: "tcp", TrAddr: "array.example.com", TrSvcID: "4420"},
				{TrType: "tcp", TrAddr: "fd00::7", TrSvcID: "4420"},
			}},
			key: "nvmeof:" + subA + "/nguid=" + nguid1,
		},
		{
			name: "tunables and host",
			vc: map[string]string{"nqn": subA, "nsid": "7", "trtype": "RDMA", "traddr": "192.168.1.2", "hostTrAddr": "192.168.1.9",
				"ctrlLossTmo": "-1", "ctrlLossForever": "true", "reconnectDelay": "2", "keepAliveTmo": "5", "fastIOFailTmo": "0", "nrIOQueues": "2"},
			want: Volume{NQN: subA, NSID: 7, Paths: []Path{{TrType: "rdma", TrAddr: "192.168.1.2", TrSvcID: "4420", HostTrAddr: "192.168.1.9"}},
				Tunables: Tunables{CtrlLossTmo: intp(-1), ReconnectDelay: intp(2), KeepAliveTmo: intp(5), FastIOFailTmo: intp(0), NrIOQueues: intp(2)}},
			key: "nvmeof:" + subA + "/nsid=7",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v, err := ParseVolumeContext(tc.vc)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(*v, tc.want) {
				t.Errorf("got  %+v\nwant %+v", *v, tc.want)
			}
			if v.Key() != tc.key {
				t.Errorf("key %q, want %q", v.Key(), tc.key)
			}
		})
	}
}

// The key of a namespace does not depend on the addresses it is reached
// through or their spelling, nor on the case of its UUID or NGUID.
func TestVolumeKeyIgnoresAddresses(t *testing.T) {
	for _, group := range [][]map[string]string{
		{
			{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"},
			{"nqn": subA, "nsid": "1", "traddr": "10.0.0.7", "trsvcid": "4421"},
			{"nqn": subA, "nsid": "1", "targets": "array.example.com:4420,[fd00::7]:4420"},
			{"nqn": subA, "nsid": "1", "targetTrAddr": "ARRAY.example.com", "targetTrType": "rdma"},
		},
		{
			{"nqn": subA, "uuid": "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c", "traddr": "127.0.0.1"},
			{"nqn": subA, "deviceUUID": "6E4F2A2D-0C1B-4B8E-9C55-7E4D3F1A2B3C", "traddr": "::1"},
			{"nqn": subA, "uuid": "6e4f2a2d-0c1b-4b8e-9c55-7e4d3f1a2b3c", "nsid": "9", "traddr": "san.example.com"},
		},
		{
			{"nqn": subA, "nguid": "00112233445566778899AABBCCDDEEFF", "traddr": "127.0.0.1"},
			{"nqn": subA, "nguid": "00112233-4455-6677-8899-aabbccddeeff", "traddr": "10.0.0.8"},
		},
	} {
		var first string
		for i, vc := range group {
			v, err := ParseVolumeContext(vc)
			if err != nil {
				t.Fatal(err)
			}
			if i == 0 {
				first = v.Key()
			} else if v.Key() != first {
				t.Errorf("%v: key %q, want %q", vc, v.Key(), first)
			}
		}
	}
	a, _ := ParseVolumeContext(map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"})
	b, _ := ParseVolumeContext(map[string]string{"nqn": subA, "nsid": "2", "traddr": "127.0.0.1"})
	if a.Key() == b.Key() {
		t.Error("two namespaces, one key")
	}
}

func TestParseVolumeContextRejects(t *testing.T) {
	base := map[string]string{"nqn": subA, "nsid": "1", "traddr": "127.0.0.1"}
	for _, tc := range []struct {
		name, key, value string
		mention          string
	}{
		{"no nqn", "nqn", "", "nqn"},
		{"nqn comma", "nqn", subA + ",traddr=1.2.3.4", "nqn"},
		{"nqn newline", "nqn", subA + "\n", "nqn"},
		{"nsid zero", "nsid", "0", "nsid"},
		{"nsid broadcast", "nsid", "4294967295", "nsid"},
		{"nsid word", "nsid", "one", "nsid"},
		{"uuid bad", "uuid", "xyz", "uuid"},
		{"deviceUUID bad", "deviceUUID", "xyz", "deviceUUID"},
		{"nguid short", "nguid", "0011", "nguid"},
		{"trtype fc", "trtype", "fc", "trtype"},
		{"targetTrType loop", "targetTrType", "loop", "targetTrType"},
		{"traddr equals", "traddr", "127.0.0.1=x", "traddr"},
		{"traddr empty entry", "traddr", "127.0.0.1,", "traddr"},
		{"traddr NUL", "traddr", "127.0.0.1\x00", "traddr"},
		{"traddr bad host", "traddr", "bad_host!", "traddr"},
		{"trsvcid bad", "trsvcid", "70000", "trsvcid"},
		{"targetTrPort bad", "targetTrPort", "x", "targetTrPort"},
		{"targets bad port", "targets", "127.0.0.1:0", "targets"},
		{"targets bad form", "targets", "[::1", "targets"},
		{"targets newline", "targets", "127.0.0.1:4420\n", "targets"},
		{"hostTrAddr name", "hostTrAddr", "eth0", "hostTrAddr"},
		{"hostIface comma", "hostIface", "eth0,x", "hostIface"},
		{"ctrlLossTmo word", "ctrlLossTmo", "forever", "ctrlLossTmo"},
		// Reconnecting forever keeps a cut-off node's writes queued for
		// the target: only with the explicit opt-in.
		{"ctrlLossTmo forever without opt-in", "ctrlLossTmo", "-1", "ctrlLossForever"},
		{"ctrlLossForever without -1", "ctrlLossForever", "true", "ctrlLossTmo"},
		{"ctrlLossForever word", "ctrlLossForever", "yes", "ctrlLossForever"},
		{"keepAliveTmo zero", "keepAliveTmo", "0", "keep_alive_tmo"},
		{"nrIOQueues big", "nrIOQueues", "5000", "nr_io_queues"},
		{"aliases disagree", "targetTrAddr", "127.0.0.2", "targetTrAddr"},
		// Each path is a controller connected in parallel.
		{"33 paths", "traddr", manyAddrs(33), "at most 32"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			vc := map[string]string{}
			for k, v := range base {
				vc[k] = v
			}
			if tc.value == "" {
				delete(vc, tc.key)
			} else {
				vc[tc.key] = tc.value
			}
			v, err := ParseVolumeContext(vc)
			if err == nil {
				t.Fatalf("accepted: %+v", v)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("%v does not wrap ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("%q does not mention %s", err, tc.mention)
			}
		})
	}
	if _, err := ParseVolumeContext(map[string]string{"nqn": subA, "traddr": "127.0.0.1"}); err == nil || !strings.Contains(err.Error(), "nsid") {
		t.Errorf("no namespace: %v", err)
	}
	if _, err := ParseVolumeContext(map[string]string{"nqn": subA, "nsid": "1"}); err == nil || !strings.Contains(err.Error(), "traddr") {
		t.Errorf("no address: %v", err)
	}
}

func TestSplitTarget(t *testing.T) {
	for _, tc := range []struct{ in, host, port string }{
		{"10.0.0.1:4421", "10.0.0.1", "4421"},
		{"10.0.0.1", "10.0.0.1", "4420"},
		{"[fd00::1]:4421", "fd00::1", "4421"},
		{"[fd00::1]", "fd00::1", "4420"},
		{"fd00::1", "fd00::1", "4420"},
		{"a.example:99", "a.example", "99"},
	} {
		h, p, err := splitTarget(tc.in, "4420")
		if err != nil || h != tc.host || p != tc.port {
			t.Errorf("splitTarget(%q) = %q %q %v", tc.in, h, p, err)
		}
	}
}

func TestTransportParse(t *testing.T) {
	tr, err := NewTransport(Options{HostDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	if tr.Name() != "nvmeof" {
		t.Errorf("Name %q", tr.Name())
	}
	tg, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "3", "traddr": "127.0.0.1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tg.Key() != "nvmeof:"+subA+"/nsid=3" {
		t.Errorf("Key %q", tg.Key())
	}
	// A misspelt DH-HMAC-CHAP key is refused (it would connect without
	// authentication), naming the key, not the value.
	if _, err := tr.Parse(map[string]string{"nqn": subA, "nsid": "3", "traddr": "127.0.0.1"}, map[string]string{"dhchapKey": "s3cret"}); !errors.Is(err, errdefs.ErrInvalidArgument) ||
		!strings.Contains(err.Error(), "dhchapKey") || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("misspelt dhchap secret: %v", err)
	}
	if _, err := NewTransport(Options{Host: &HostIdentity{NQN: "bad", ID: hidA}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad fixed host: %v", err)
	}
}

// manyAddrs is a traddr list of n distinct addresses.
func manyAddrs(n int) string {
	a := make([]string, n)
	for i := range a {
		a[i] = fmt.Sprintf("10.0.%d.%d", i/250, 1+i%250)
	}
	return strings.Join(a, ",")
}

// 32 paths are accepted; entries repeated beyond that are one path each.
func TestParseVolumeContextManyPaths(t *testing.T) {
	vc := map[string]string{"nqn": subA, "nsid": "1", "traddr": manyAddrs(32) + "," + manyAddrs(32), "targets": "10.0.0.1:4420,10.0.0.2"}
	v, err := ParseVolumeContext(vc)
	if err != nil {
		t.Fatal(err)
	}
	if len(v.Paths) != 32 {
		t.Fatalf("%d paths, want 32", len(v.Paths))
	}
}
