// Package metrics exposes berth's Prometheus metrics: the latency of every
// CSI call, in the same histogram the Kubernetes CSI sidecars use, the
// state of each staged volume and its paths, read when scraped, how
// often berth read the node's mount table, and what the periodic trim
// gave back.
package metrics

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/berth-csi/berth/fs"
)

// OperationBuckets are the csi-lib-utils operation latency buckets, so
// berth's histogram aggregates with the sidecars' csi_sidecar_operations_seconds.
var OperationBuckets = []float64{.1, .25, .5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600}

// Volume is the state of one staged volume at scrape time.
type Volume struct {
	ID        string
	Transport string         // "iscsi", "nvmeof", "file"
	Paths     map[string]int // number of paths per state, e.g. "live": 2, "failed": 1
	Abnormal  bool           // what NodeGetVolumeStats reports as volume condition
	Unfenced  bool           // not fenced though fencing applies (see descUnfenced)
}

// VolumeLister returns the volumes staged on this node. It is called on
// every scrape and should answer from memory and sysfs, not from the target.
type VolumeLister func(ctx context.Context) []Volume

// Metrics holds berth's collectors in a registry of its own, so that no
// library registering on the global default registry adds series to it.
type Metrics struct {
	driver   string
	reg      *prometheus.Registry
	ops      *prometheus.HistogramVec
	inflight *prometheus.GaugeVec
	volumes  *volumeCollector
	trims    *prometheus.CounterVec
	trimmed  prometheus.Counter
}

// New returns the metrics of the CSI driver named driver. volumes may be
// nil when the caller has no volume table (then only call latency is kept).
func New(driver string, volumes VolumeLister) *Metrics {
	m := &Metrics{
		driver: driver,
		reg:    prometheus.NewRegistry(),
		ops: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "csi",
			Subsystem: "plugin",
			Name:      "operations_seconds",
			Help:      "Container Storage Interface operation duration with gRPC error code status total",
			Buckets:   OperationBuckets,
		}, []string{"driver_name", "method_name", "grpc_status_code"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "berth_operations_in_flight",
			Help: "CSI calls being served now, by method; a value that stays up points at a stuck mount, mkfs or login.",
		}, []string{"method_name"}),
		volumes: &volumeCollector{list: volumes},
		// No volume_id label: counters of volumes long unstaged would
		// stay in every scrape, where the volume series (read at scrape
		// time) go with their volume. The logs name each volume's trim.
		trims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "berth_trims_total",
			Help: "Periodic trims (berth serve --trim-interval) of staged mount volumes, by result: trimmed, skipped (a trim or another call on the volume in progress) or failed.",
		}, []string{"result"}),
		trimmed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "berth_trimmed_bytes_total",
			Help: "Bytes the periodic trims reported trimmed (FITRIM), summed over the node's volumes; a filesystem reports its free space trimmed again after a remount.",
		}),
	}
	for _, r := range []string{TrimTrimmed, TrimSkipped, TrimFailed} {
		m.trims.WithLabelValues(r)
	}
	m.reg.MustRegister(m.ops, m.inflight, m.volumes, mountTableReads, m.trims, m.trimmed,
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// UnaryServerInterceptor records each call's duration and gRPC status code.
// Install it with grpc.ChainUnaryInterceptor on the CSI server.
func (m *Metrics) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		g := m.inflight.WithLabelValues(info.FullMethod)
		g.Inc()
		defer g.Dec()
		start := time.Now()
		resp, err := handler(ctx, req)
		m.ops.WithLabelValues(m.driver, info.FullMethod, status.Code(err).String()).Observe(time.Since(start).Seconds())
		return resp, err
	}
}

// Results of a trim, the result label of berth_trims_total.
const (
	TrimTrimmed = "trimmed"
	TrimSkipped = "skipped"
	TrimFailed  = "failed"
)

// ObserveTrim counts one trim with its result (TrimTrimmed, TrimSkipped,
// TrimFailed) and the bytes it trimmed.
func (m *Metrics) ObserveTrim(result string, bytes uint64) {
	m.trims.WithLabelValues(result).Inc()
	m.trimmed.Add(float64(bytes))
}

// Handler serves the registry in the Prometheus exposition formats.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{Registry: m.reg})
}

// CheckAddress checks that address is host:port with a numeric port, the
// form Listen takes. The host may be empty (all addresses) and the port 0
// (a free port).
func CheckAddress(address string) error {
	_, port, err := net.SplitHostPort(address)
	if err == nil {
		_, err = strconv.ParseUint(port, 10, 16)
	}
	if err != nil {
		return fmt.Errorf("want host:port with a numeric port, such as :9810 or 127.0.0.1:9810")
	}
	return nil
}

// Listen binds the TCP address (host:port, see CheckAddress) /metrics is
// to be served on, so that a bad or busy address fails at start, not
// once serving.
func Listen(address string) (net.Listener, error) {
	if err := CheckAddress(address); err != nil {
		return nil, err
	}
	return net.Listen("tcp", address)
}

// Serve serves /metrics on l until ctx ends; it closes l.
func (m *Metrics) Serve(ctx context.Context, l net.Listener) error {
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	err := srv.Serve(l)
	if errors.Is(err, http.ErrServerClosed) {
		<-stopped
		return nil
	}
	return fmt.Errorf("metrics: serve on %s: %w", l.Addr(), err)
}

var (
	descStaged = prometheus.NewDesc("berth_volume_staged",
		"1 for each volume staged on this node.",
		[]string{"volume_id", "transport"}, nil)
	descPaths = prometheus.NewDesc("berth_volume_paths",
		"Paths to a staged volume's target by state; fewer live paths than configured portals means lost redundancy.",
		[]string{"volume_id", "transport", "state"}, nil)
	descAbnormal = prometheus.NewDesc("berth_volume_abnormal",
		"1 when a staged volume is abnormal: the volume condition NodeGetVolumeStats reports (target connection, device identity, staging mount, every publish mount).",
		[]string{"volume_id", "transport"}, nil)
	descUnfenced = prometheus.NewDesc("berth_volume_unfenced",
		"1 when a staged volume that fencing applies to is not fenced: opted out (volume_context fencing: \"none\"), its target has no persistent reservations, or staged by a berth that did not fence. The target does not keep another node from writing it; the volume condition says why.",
		[]string{"volume_id", "transport"}, nil)
)

// mountTableReads counts the process's reads of its mount table, which
// cost tens of milliseconds on a node with ten thousand mounts. berth
// asks the kernel about one path instead (statx, Linux 5.8, or openat2,
// Linux 5.6); a count that climbs with the RPCs means this kernel has
// neither and every mount point check reads the whole table.
var mountTableReads = prometheus.NewCounterFunc(prometheus.CounterOpts{
	Name: "berth_mount_table_reads_total",
	Help: "Reads of /proc/self/mountinfo by berth; rises with the RPCs only on kernels without statx STATX_ATTR_MOUNT_ROOT and openat2, where each mount point check reads the whole table.",
}, func() float64 { return float64(fs.MountTableReads()) })

// volumeCollector reads the volume table at scrape time, so a volume that
// was unstaged disappears from the next scrape without bookkeeping.
type volumeCollector struct{ list VolumeLister }

func (c *volumeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descStaged
	ch <- descPaths
	ch <- descAbnormal
	ch <- descUnfenced
}

func (c *volumeCollector) Collect(ch chan<- prometheus.Metric) {
	if c.list == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, v := range c.list(ctx) {
		ch <- prometheus.MustNewConstMetric(descStaged, prometheus.GaugeValue, 1, v.ID, v.Transport)
		for state, n := range v.Paths {
			ch <- prometheus.MustNewConstMetric(descPaths, prometheus.GaugeValue, float64(n), v.ID, v.Transport, state)
		}
		abnormal := 0.0
		if v.Abnormal {
			abnormal = 1
		}
		ch <- prometheus.MustNewConstMetric(descAbnormal, prometheus.GaugeValue, abnormal, v.ID, v.Transport)
		unfenced := 0.0
		if v.Unfenced {
			unfenced = 1
		}
		ch <- prometheus.MustNewConstMetric(descUnfenced, prometheus.GaugeValue, unfenced, v.ID, v.Transport)
	}
}
