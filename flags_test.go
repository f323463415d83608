package main

import (
	"slices"
	"testing"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/doctor"
)

// A flag that berth serve and berth doctor both take means the same thing
// in both: the same environment variables and the same default, so that
// doctor, run where berth runs, checks what berth uses.
func TestServeAndDoctorFlagsAgree(t *testing.T) {
	// Deliberate differences.
	defaultDiffers := map[string]string{
		"endpoint":   "doctor's default is the kubelet plugin path the DaemonSet and berth.service use",
		"transports": "doctor also checks file, which serve enables through --file-root",
	}
	envDiffers := map[string]string{
		"transports": "doctor's list includes file, which BERTH_TRANSPORTS must not name",
	}
	serve := map[string]cli.Flag{}
	for _, f := range serveCommand().Flags {
		serve[f.Names()[0]] = f
	}
	shared := 0
	for _, df := range doctor.Command().Flags {
		name := df.Names()[0]
		sf, ok := serve[name]
		if !ok {
			continue
		}
		shared++
		if _, ok := envDiffers[name]; !ok {
			se, de := sf.(cli.DocGenerationFlag).GetEnvVars(), df.(cli.DocGenerationFlag).GetEnvVars()
			if !slices.Equal(se, de) {
				t.Errorf("--%s: serve reads %v, doctor %v", name, se, de)
			}
		}
		if _, ok := defaultDiffers[name]; !ok {
			sv, dv := sf.(cli.DocGenerationFlag).GetValue(), df.(cli.DocGenerationFlag).GetValue()
			if sv != dv {
				t.Errorf("--%s: serve's default %q, doctor's %q", name, sv, dv)
			}
		}
	}
	if shared < 3 {
		t.Fatalf("only %d flags shared by serve and doctor; want at least endpoint, iscsiadm, multipathd", shared)
	}
}

// The Probe's node checks (--probe-checks) look at the programs serve
// runs, not at the defaults.
func TestProbeChecksUseServePrograms(t *testing.T) {
	t.Setenv("BERTH_ISCSIADM", "/usr/local/bin/iscsiadm-host")
	cmd := serveCommand()
	var got doctor.Config
	cmd.Action = func(c *cli.Context) error {
		var err error
		got, err = probeConfig(c)
		return err
	}
	app := &cli.App{Name: "berth", Commands: []*cli.Command{cmd}}
	if err := app.Run([]string{"berth", "serve", "--probe-checks", "iscsi", "--multipathd", "/usr/local/bin/multipathd-host"}); err != nil {
		t.Fatal(err)
	}
	if got.Iscsiadm != "/usr/local/bin/iscsiadm-host" || got.Multipathd != "/usr/local/bin/multipathd-host" || !slices.Equal(got.Transports, []string{"iscsi"}) {
		t.Fatalf("probe checks %+v, want serve's iscsiadm and multipathd", got)
	}
}
