package main

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoTestHelpersLinked: the daemon binary links none of the module's
// test helpers (kerneltest, clienttest, servicetest, ...).
func TestNoTestHelpersLinked(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "github.com/expertd/expertd/") && strings.Contains(p, "test") {
			t.Errorf("expertd links the test helper %s", p)
		}
	}
}
