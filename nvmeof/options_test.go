package nvmeof

import (
	"errors"
	"strconv"
	"strings"
	"testing"

	"github.com/berth-csi/berth/internal/errdefs"
)

func intp(n int) *int { return &n }

func validOptions() ConnectOptions {
	return ConnectOptions{
		Transport: "tcp",
		TrAddr:    "127.0.0.1",
		TrSvcID:   "4420",
		NQN:       "nqn.2026-01.io.berth:vol1",
		HostNQN:   "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e",
		HostID:    "0f8fad5b-d9cb-469f-a165-70867728950e",
	}
}

func TestEncode(t *testing.T) {
	o := validOptions()
	o.HostIface = "eth0"
	o.HostTrAddr = "127.0.0.2"
	o.CtrlLossTmo = intp(-1)
	o.ReconnectDelay = intp(2)
	o.KeepAliveTmo = intp(5)
	o.FastIOFailTmo = intp(0)
	o.NrIOQueues = intp(4)
	got, err := o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	want := "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn=nqn.2026-01.io.berth:vol1," +
		"hostnqn=nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e," +
		"hostid=0f8fad5b-d9cb-469f-a165-70867728950e,host_traddr=127.0.0.2,host_iface=eth0," +
		"nr_io_queues=4,ctrl_loss_tmo=-1,reconnect_delay=2,keep_alive_tmo=5,fast_io_fail_tmo=0"
	if got != want {
		t.Errorf("Encode:\n got %s\nwant %s", got, want)
	}

	o = validOptions()
	o.TrSvcID = ""
	o.HostNQN, o.HostID = "", ""
	got, err = o.Encode()
	if err != nil {
		t.Fatal(err)
	}
	if want := "transport=tcp,traddr=127.0.0.1,trsvcid=4420,nqn=nqn.2026-01.io.berth:vol1"; got != want {
		t.Errorf("Encode defaults: got %s, want %s", got, want)
	}
}

func TestValidateRejects(t *testing.T) {
	for _, tc := range []struct {
		name  string
		mod   func(*ConnectOptions)
		field string // must be named in the error
	}{
		{"transport missing", func(o *ConnectOptions) { o.Transport = "" }, "transport"},
		{"transport fc", func(o *ConnectOptions) { o.Transport = "fc" }, "transport"},
		{"transport loop", func(o *ConnectOptions) { o.Transport = "loop" }, "transport"},
		{"transport upper", func(o *ConnectOptions) { o.Transport = "TCP" }, "transport"},
		{"transport comma", func(o *ConnectOptions) { o.Transport = "tcp,nqn=x" }, "transport"},
		{"traddr missing", func(o *ConnectOptions) { o.TrAddr = "" }, "traddr"},
		{"traddr comma", func(o *ConnectOptions) { o.TrAddr = "127.0.0.1,nqn=evil" }, "traddr"},
		{"traddr equals", func(o *ConnectOptions) { o.TrAddr = "a=b" }, "traddr"},
		{"traddr newline", func(o *ConnectOptions) { o.TrAddr = "127.0.0.1\n" }, "traddr"},
		{"traddr NUL", func(o *ConnectOptions) { o.TrAddr = "127.0.0.1\x00" }, "traddr"},
		{"traddr hostname", func(o *ConnectOptions) { o.TrAddr = "array.example.com" }, "traddr"},
		{"traddr unspecified", func(o *ConnectOptions) { o.TrAddr = "0.0.0.0" }, "traddr"},
		{"traddr multicast", func(o *ConnectOptions) { o.TrAddr = "ff02::1" }, "traddr"},
		{"traddr bad zone", func(o *ConnectOptions) { o.TrAddr = "fe80::1%a/b" }, "traddr"},
		{"trsvcid zero", func(o *ConnectOptions) { o.TrSvcID = "0" }, "trsvcid"},
		{"trsvcid big", func(o *ConnectOptions) { o.TrSvcID = "65536" }, "trsvcid"},
		{"trsvcid name", func(o *ConnectOptions) { o.TrSvcID = "nvme" }, "trsvcid"},
		{"trsvcid sign", func(o *ConnectOptions) { o.TrSvcID = "+4420" }, "trsvcid"},
		{"trsvcid leading zero", func(o *ConnectOptions) { o.TrSvcID = "04420" }, "trsvcid"},
		{"trsvcid comma", func(o *ConnectOptions) { o.TrSvcID = "4420,ctrl_loss_tmo=1" }, "trsvcid"},
		{"nqn missing", func(o *ConnectOptions) { o.NQN = "" }, "nqn"},
		{"nqn comma", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:a,b" }, "nqn"},
		{"nqn equals", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:a=b" }, "nqn"},
		{"nqn newline", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:a\nb" }, "nqn"},
		{"nqn NUL", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:a\x00" }, "nqn"},
		{"nqn space", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:a b" }, "nqn"},
		{"nqn no prefix", func(o *ConnectOptions) { o.NQN = "iqn.2026-01.io.berth:a" }, "nqn"},
		{"nqn bad month", func(o *ConnectOptions) { o.NQN = "nqn.2026-13.io.berth:a" }, "nqn"},
		{"nqn no name", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth" }, "nqn"},
		{"nqn discovery", func(o *ConnectOptions) { o.NQN = "nqn.2014-08.org.nvmexpress.discovery" }, "nqn"},
		{"nqn bad uuid", func(o *ConnectOptions) { o.NQN = "nqn.2014-08.org.nvmexpress:uuid:1234" }, "nqn"},
		{"nqn too long", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:" + strings.Repeat("a", 203) }, "nqn"},
		{"nqn invalid utf8", func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:\xff" }, "nqn"},
		{"hostnqn comma", func(o *ConnectOptions) { o.HostNQN = "nqn.2026-01.io.berth:h,x" }, "hostnqn"},
		{"hostnqn bad", func(o *ConnectOptions) { o.HostNQN = "host1" }, "hostnqn"},
		{"hostid bad", func(o *ConnectOptions) { o.HostID = "not-a-uuid" }, "hostid"},
		{"hostid comma", func(o *ConnectOptions) { o.HostID = "0f8fad5b-d9cb-469f-a165-70867728950e,x" }, "hostid"},
		{"host_traddr bad", func(o *ConnectOptions) { o.HostTrAddr = "eth0" }, "host_traddr"},
		{"host_traddr newline", func(o *ConnectOptions) { o.HostTrAddr = "10.0.0.1\n" }, "host_traddr"},
		{"host_iface slash", func(o *ConnectOptions) { o.HostIface = "a/b" }, "host_iface"},
		{"host_iface long", func(o *ConnectOptions) { o.HostIface = "abcdefghijklmnop" }, "host_iface"},
		{"host_iface equals", func(o *ConnectOptions) { o.HostIface = "a=b" }, "host_iface"},
		{"host_iface rdma", func(o *ConnectOptions) { o.Transport = "rdma"; o.HostIface = "ib0" }, "host_iface"},
		{"ctrl_loss_tmo low", func(o *ConnectOptions) { o.CtrlLossTmo = intp(-2) }, "ctrl_loss_tmo"},
		{"ctrl_loss_tmo high", func(o *ConnectOptions) { o.CtrlLossTmo = intp(604801) }, "ctrl_loss_tmo"},
		{"reconnect_delay zero", func(o *ConnectOptions) { o.ReconnectDelay = intp(0) }, "reconnect_delay"},
		{"keep_alive_tmo zero", func(o *ConnectOptions) { o.KeepAliveTmo = intp(0) }, "keep_alive_tmo"},
		{"fast_io_fail_tmo low", func(o *ConnectOptions) { o.FastIOFailTmo = intp(-5) }, "fast_io_fail_tmo"},
		{"nr_io_queues zero", func(o *ConnectOptions) { o.NrIOQueues = intp(0) }, "nr_io_queues"},
		{"nr_io_queues big", func(o *ConnectOptions) { o.NrIOQueues = intp(100000) }, "nr_io_queues"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := validOptions()
			tc.mod(&o)
			s, err := o.Encode()
			if err == nil {
				t.Fatalf("Encode succeeded: %q", s)
			}
			if s != "" {
				t.Errorf("Encode returned %q with an error", s)
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("error %v does not wrap ErrInvalidArgument", err)
			}
			if !strings.Contains(err.Error(), "option "+tc.field+" ") && !strings.Contains(err.Error(), "option "+tc.field+":") {
				t.Errorf("error %q does not name field %s", err, tc.field)
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	for _, mod := range []func(*ConnectOptions){
		func(o *ConnectOptions) { o.Transport = "rdma" },
		func(o *ConnectOptions) { o.TrAddr = "::1" },
		func(o *ConnectOptions) { o.TrAddr = "fe80::1%eth0" },
		func(o *ConnectOptions) { o.TrSvcID = "65535" },
		func(o *ConnectOptions) {
			o.NQN = "nqn.2014-08.org.nvmexpress:uuid:0F8FAD5B-D9CB-469F-A165-70867728950E"
		},
		func(o *ConnectOptions) { o.NQN = "nqn.2016-06.io.spdk:cnode1" },
		func(o *ConnectOptions) { o.NQN = "nqn.1992-08.com.netapp:sn.abc:subsystem.x_y" },
		func(o *ConnectOptions) { o.NQN = "nqn.2026-01.io.berth:" + strings.Repeat("a", 202) }, // 223 bytes
		func(o *ConnectOptions) { o.CtrlLossTmo, o.FastIOFailTmo = intp(-1), intp(-1) },
		func(o *ConnectOptions) { o.HostIface = "enp0s3.100" },
	} {
		o := validOptions()
		mod(&o)
		if _, err := o.Encode(); err != nil {
			t.Errorf("%+v: %v", o, err)
		}
	}
}

// FuzzEncode checks that whatever the fields hold, Encode either fails
// or produces a string whose options are exactly the fields given: no
// value can add an option, end the request or hide a NUL.
func FuzzEncode(f *testing.F) {
	f.Add("tcp", "127.0.0.1", "4420", "nqn.2026-01.io.berth:vol1", "nqn.2026-01.io.berth:host", "0f8fad5b-d9cb-469f-a165-70867728950e", "", "eth0", 5)
	f.Add("tcp", "127.0.0.1,nqn=x", "4420", "nqn.2026-01.io.berth:a\nb", "", "", "::1", "", -1)
	f.Add("rdma", "fd00::1", "1", "nqn.2014-08.org.nvmexpress:uuid:0f8fad5b-d9cb-469f-a165-70867728950e", "", "", "", "", 0)
	f.Fuzz(func(t *testing.T, transport, traddr, trsvcid, nqn, hostnqn, hostid, hostTrAddr, hostIface string, tmo int) {
		o := ConnectOptions{Transport: transport, TrAddr: traddr, TrSvcID: trsvcid, NQN: nqn,
			HostNQN: hostnqn, HostID: hostid, HostTrAddr: hostTrAddr, HostIface: hostIface}
		o.CtrlLossTmo = &tmo
		s, err := o.Encode()
		if err != nil {
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("error %v does not wrap ErrInvalidArgument", err)
			}
			if s != "" {
				t.Fatalf("Encode returned %q with an error", s)
			}
			return
		}
		if strings.ContainsAny(s, "\n\r\x00") {
			t.Fatalf("connect string %q holds a line or string terminator", s)
		}
		want := map[string]string{"transport": transport, "traddr": traddr, "nqn": nqn, "ctrl_loss_tmo": itoa(tmo)}
		if trsvcid == "" {
			want["trsvcid"] = DefaultPort
		} else {
			want["trsvcid"] = trsvcid
		}
		for k, v := range map[string]string{"hostnqn": hostnqn, "hostid": hostid, "host_traddr": hostTrAddr, "host_iface": hostIface} {
			if v != "" {
				want[k] = v
			}
		}
		got := make(map[string]string)
		for _, kv := range strings.Split(s, ",") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || strings.Contains(v, "=") {
				t.Fatalf("connect string %q: option %q is not key=value", s, kv)
			}
			if _, dup := got[k]; dup {
				t.Fatalf("connect string %q: option %s twice", s, k)
			}
			got[k] = v
		}
		if len(got) != len(want) {
			t.Fatalf("connect string %q has options %v, want %v", s, got, want)
		}
		for k, v := range want {
			if got[k] != v {
				t.Fatalf("connect string %q: %s=%q, want %q", s, k, got[k], v)
			}
		}
	})
}

func itoa(n int) string { return strconv.Itoa(n) }
