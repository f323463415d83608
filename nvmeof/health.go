package nvmeof

import (
	"context"
	"fmt"
	"strings"
)

// Health reports the volume abnormal when its namespace is gone or any
// path it asked for is not live or not ANA-accessible; the message
// lists every path.
func (tg *Target) Health(ctx context.Context) (abnormal bool, message string) {
	head, paths, err := tg.Status(ctx)
	if err != nil {
		return true, err.Error()
	}
	if head == "" {
		return true, fmt.Sprintf("namespace of %s not attached: no controller of the subsystem is connected; %s", tg.Key(), goneControllerHint)
	}
	var parts []string
	up, want := 0, 0
	for _, p := range paths {
		parts = append(parts, p.String())
		if p.Path == "" {
			continue
		}
		want++
		if p.Healthy() {
			up++
		}
	}
	msg := fmt.Sprintf("%s: %d of %d paths up: %s", head, up, want, strings.Join(parts, "; "))
	for _, p := range paths {
		if p.Path != "" && p.Controller == "" {
			msg += " (" + goneControllerHint + ")"
			break
		}
	}
	return up < want, msg
}

// goneControllerHint explains a path without a controller. The kernel
// deletes a controller whose reconnects gave up; 6.12 (measured) also
// deletes one whose reconnect failed DH-HMAC-CHAP authentication (a
// status with Do Not Retry), at the first such attempt.
const goneControllerHint = "the kernel removes a controller whose reconnects gave up (ctrl_loss_tmo) or, for a volume staged with DH-HMAC-CHAP keys, whose reconnect failed authentication (the target's key for this host changed or was removed): check the target, then unstage and stage the volume again"
