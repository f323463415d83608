package agent

import (
	"testing"

	"github.com/berth-csi/berth/devices"
	"github.com/berth-csi/berth/file"
)

// fileKind is the file transport's kind, as berth serve registers it.
var fileKind = TransportKind{Name: file.Name, Keys: file.TransportKeys()}

// fileTransport is the file transport rooted at root, as berth serve
// --file-root builds it.
func fileTransport(t testing.TB, root string, l *devices.Listener) Transport {
	t.Helper()
	ft, err := file.New(root, l)
	if err != nil {
		t.Fatal(err)
	}
	return TransportFunc(fileKind, ft.Parse)
}
