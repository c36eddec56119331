package expertdv1

import (
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/testing/protocmp"
)

// TestDocumentedFiles checks the documented descriptor is the generated one
// plus comments: a stale expert.binpb would advertise a different API.
func TestDocumentedFiles(t *testing.T) {
	r, err := DocumentedFiles()
	if err != nil {
		t.Fatal(err)
	}
	fd, err := r.FindFileByPath("expertd/v1/expert.proto")
	if err != nil {
		t.Fatal(err)
	}
	got := protodesc.ToFileDescriptorProto(fd)
	want := protodesc.ToFileDescriptorProto(File_expertd_v1_expert_proto)
	if got.GetSourceCodeInfo() == nil {
		t.Fatal("documented descriptor has no source info")
	}
	var comments strings.Builder
	for _, loc := range got.GetSourceCodeInfo().GetLocation() {
		comments.WriteString(loc.GetLeadingComments())
	}
	for _, c := range []string{"LoadExperts uploads one MoE layer", "Experts per token, in [1, E]"} {
		if !strings.Contains(comments.String(), c) {
			t.Errorf("comments lack %q", c)
		}
	}
	got.SourceCodeInfo = nil
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("documented descriptor differs from the generated one (run scripts/gen-proto.sh) (-generated +documented):\n%s", diff)
	}
	// Imports resolve through the global registry.
	if _, err := r.FindFileByPath("google/protobuf/timestamp.proto"); err != nil {
		t.Errorf("timestamp.proto: %v", err)
	}
	if _, err := r.FindDescriptorByName("expertd.v1.ExpertService"); err != nil {
		t.Errorf("expertd.v1.ExpertService: %v", err)
	}
}
