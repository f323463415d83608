package main

import (
	"time"

	"github.com/urfave/cli/v2"

	"github.com/berth-csi/berth/agent"
	"github.com/berth-csi/berth/systemd"
)

// defaultControllerEndpoint is berth controller's socket when no
// --endpoint is given: beside the node plugin's, under another name, so
// that both may run on one host.
const defaultControllerEndpoint = "unix:///run/berth/controller.sock"

func controllerCommand() *cli.Command {
	return &cli.Command{
		Name:  "controller",
		Usage: "serve the CSI Identity and Controller services for the external-attacher (ControllerPublishVolume only; no storage access)",
		Description: "With the CSIDriver's attachRequired: true, Kubernetes makes a VolumeAttachment for every volume a node\n" +
			"is to stage, and refuses to attach a ReadWriteOnce volume to a second node (Multi-Attach error).\n" +
			"The external-attacher sidecar completes those attachments by calling berth controller, which\n" +
			"checks the request and answers with the node it was published to; berth's nodes attach the\n" +
			"storage themselves at stage. It needs neither root nor the storage's credentials.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "endpoint", Value: defaultControllerEndpoint, EnvVars: []string{"BERTH_CONTROLLER_ENDPOINT", "CSI_ENDPOINT"}, Usage: "CSI endpoint (unix socket) the external-attacher dials"},
			&cli.StringFlag{Name: "driver-name", Value: agent.DefaultDriverName, EnvVars: []string{"BERTH_DRIVER_NAME"}, Usage: "CSI driver name: the node plugins' name"},
			&cli.StringFlag{Name: "log-format", Value: "json", EnvVars: []string{"BERTH_LOG_FORMAT"}, Usage: "log format: json or text"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"BERTH_LOG_LEVEL"}, Usage: "log level: debug, info, warn, error"},
			&cli.DurationFlag{Name: "shutdown-timeout", Value: 30 * time.Second, EnvVars: []string{"BERTH_SHUTDOWN_TIMEOUT"}, Usage: "how long calls in flight may take to finish on SIGTERM"},
		},
		Action: runController,
	}
}

func runController(c *cli.Context) error {
	log, err := newLogger(c.String("log-format"), c.String("log-level"))
	if err != nil {
		return err
	}
	ctl, err := agent.NewController(agent.ControllerConfig{
		DriverName:      c.String("driver-name"),
		Version:         version,
		Logger:          log,
		ShutdownTimeout: c.Duration("shutdown-timeout"),
	})
	if err != nil {
		return err
	}
	ctx, stop := systemd.StopOnSignal(c.Context)
	defer stop()
	lis, err := agent.Listen(c.String("endpoint"))
	if err != nil {
		return err
	}
	return ctl.Serve(ctx, lis)
}
