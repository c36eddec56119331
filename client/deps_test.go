package client_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestSDKDependencies: the SDK and its test helpers (client/clienttest)
// link the wire contract and the request model, never the engine
// (kernels/, whose backends register themselves in the user's process)
// nor the daemon (service/).
func TestSDKDependencies(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "./...").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		rel, ok := strings.CutPrefix(p, "github.com/expertd/expertd/")
		if ok && (strings.HasPrefix(rel, "kernels") || strings.HasPrefix(rel, "service")) {
			t.Errorf("the SDK (client/...) depends on %s", p)
		}
	}
}
