// Package kubeapi asks the Kubernetes API, from inside the cluster, whether
// the CO has moved a volume from one node to another: the evidence a node
// needs before it preempts another node's persistent reservation
// (Takeover). It speaks plain HTTPS and JSON to the API server the pod's
// environment names (KUBERNETES_SERVICE_HOST and _PORT) with the pod's
// service-account token, without client-go: it reads three kinds of
// objects, by name or in a list, and caches nothing a decision uses (the
// Node names it keeps only name reservation keys in messages: NodeOfKey).
package kubeapi

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// The in-cluster paths of a pod's service account (the kubelet projects
// them into every pod that mounts a token).
const (
	DefaultTokenFile = "/var/run/secrets/kubernetes.io/serviceaccount/token"
	DefaultCAFile    = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
)

// maxBody bounds one response read: a page of nodes (see nodePageSize)
// is well below it.
const maxBody = 64 << 20

// client is a minimal Kubernetes API client. The token and the CA are
// read again for every request, so that a rotated token (bound tokens
// expire within the hour) or CA is used at once.
type client struct {
	base      *url.URL
	tokenFile string
	caFile    string
	// transport, if set, replaces the one built from caFile (tests).
	transport http.RoundTripper
}

// errNotFound is the API's 404 for an object read by name.
var errNotFound = errors.New("not found")

// apiError is an answer of the API server other than 200 and 404.
type apiError struct {
	code    int
	message string
}

func (e *apiError) Error() string {
	switch e.code {
	case http.StatusUnauthorized:
		return fmt.Sprintf("the API server refused the service-account token (401 %s: expired or revoked?)", e.message)
	case http.StatusForbidden:
		return fmt.Sprintf("forbidden (403 %s: the node's service account needs get and list on volumeattachments and on nodes)", e.message)
	}
	return fmt.Sprintf("API server answered %d %s", e.code, e.message)
}

// newClient is a client of the API server at host:port.
func newClient(host, port, tokenFile, caFile string) (*client, error) {
	if host == "" || port == "" {
		return nil, fmt.Errorf("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set: not running in a Kubernetes pod")
	}
	return &client{
		base:      &url.URL{Scheme: "https", Host: net.JoinHostPort(host, port)},
		tokenFile: tokenFile,
		caFile:    caFile,
	}, nil
}

func (c *client) roundTripper() (http.RoundTripper, error) {
	if c.transport != nil {
		return c.transport, nil
	}
	pem, err := os.ReadFile(c.caFile)
	if err != nil {
		return nil, fmt.Errorf("read the API server's CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("the API server's CA %s holds no PEM certificate", c.caFile)
	}
	return &http.Transport{
		TLSClientConfig:     &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12},
		TLSHandshakeTimeout: 10 * time.Second,
		DisableKeepAlives:   true, // a takeover is rare: no idle connection kept
	}, nil
}

// get reads path (with query) from the API server into out. A 404 is
// errNotFound; any other answer but 200 an *apiError.
func (c *client) get(ctx context.Context, path string, query url.Values, out any) error {
	tok, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return fmt.Errorf("read the service-account token: %w", err)
	}
	token := strings.TrimSpace(string(tok))
	if token == "" {
		return fmt.Errorf("the service-account token %s is empty", c.tokenFile)
	}
	rt, err := c.roundTripper()
	if err != nil {
		return err
	}
	u := *c.base
	u.Path = path
	u.RawQuery = query.Encode()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "application/json")
	resp, err := (&http.Client{Transport: rt}).Do(req)
	if err != nil {
		// The error names the URL, never the header with the token.
		return fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxBody+1))
	if err != nil {
		return fmt.Errorf("GET %s: read the answer: %w", path, err)
	}
	if len(body) > maxBody {
		return fmt.Errorf("GET %s: answer over %d bytes", path, maxBody)
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusNotFound:
		return errNotFound
	default:
		var st struct {
			Message string `json:"message"`
		}
		_ = json.Unmarshal(body, &st)
		msg := st.Message
		if len(msg) > 200 {
			msg = msg[:200]
		}
		return fmt.Errorf("GET %s: %w", path, &apiError{code: resp.StatusCode, message: msg})
	}
	if err := json.Unmarshal(body, out); err != nil {
		return fmt.Errorf("GET %s: decode the answer: %w", path, err)
	}
	return nil
}

// volumeAttachment is what berth reads of a storage.k8s.io/v1
// VolumeAttachment.
type volumeAttachment struct {
	Metadata struct {
		Name              string  `json:"name"`
		DeletionTimestamp *string `json:"deletionTimestamp"`
	} `json:"metadata"`
	Spec struct {
		Attacher string `json:"attacher"`
		NodeName string `json:"nodeName"`
		Source   struct {
			PersistentVolumeName string `json:"persistentVolumeName"`
		} `json:"source"`
	} `json:"spec"`
	Status struct {
		Attached bool `json:"attached"`
	} `json:"status"`
}

// node is what berth reads of a v1 Node.
type node struct {
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Taints []struct {
			Key    string `json:"key"`
			Effect string `json:"effect"`
		} `json:"taints"`
	} `json:"spec"`
}

// getVolumeAttachment reads one VolumeAttachment by name; errNotFound
// when there is none. The read has no resourceVersion: the API server
// answers from etcd (a quorum read), not from its watch cache.
func (c *client) getVolumeAttachment(ctx context.Context, name string) (*volumeAttachment, error) {
	var va volumeAttachment
	if err := c.get(ctx, "/apis/storage.k8s.io/v1/volumeattachments/"+url.PathEscape(name), nil, &va); err != nil {
		return nil, err
	}
	return &va, nil
}

// pageSize is the page size of a list.
const pageSize = 500

// list reads every object of a collection, page by page, each page a
// quorum read.
func list[T any](ctx context.Context, c *client, path string) ([]T, error) {
	var all []T
	cont := ""
	for {
		q := url.Values{"limit": {fmt.Sprint(pageSize)}}
		if cont != "" {
			q.Set("continue", cont)
		}
		var page struct {
			Metadata struct {
				Continue string `json:"continue"`
			} `json:"metadata"`
			Items []T `json:"items"`
		}
		if err := c.get(ctx, path, q, &page); err != nil {
			return nil, err
		}
		all = append(all, page.Items...)
		if page.Metadata.Continue == "" {
			return all, nil
		}
		cont = page.Metadata.Continue
	}
}

// listNodes reads every Node.
func (c *client) listNodes(ctx context.Context) ([]node, error) {
	return list[node](ctx, c, "/api/v1/nodes")
}

// listVolumeAttachments reads every VolumeAttachment.
func (c *client) listVolumeAttachments(ctx context.Context) ([]volumeAttachment, error) {
	return list[volumeAttachment](ctx, c, "/apis/storage.k8s.io/v1/volumeattachments")
}
