package shard

import (
	"errors"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestBalanced(t *testing.T) {
	tests := []struct {
		name string
		make func(e, s int) (*Map, error)
		e, s int
		want [][]int
	}{
		{"contiguous/even", Contiguous, 8, 2, [][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}},
		{"contiguous/uneven", Contiguous, 7, 3, [][]int{{0, 1, 2}, {3, 4}, {5, 6}}},
		{"contiguous/one-shard", Contiguous, 3, 1, [][]int{{0, 1, 2}}},
		{"contiguous/one-per-shard", Contiguous, 3, 3, [][]int{{0}, {1}, {2}}},
		{"round-robin/even", RoundRobin, 8, 2, [][]int{{0, 2, 4, 6}, {1, 3, 5, 7}}},
		{"round-robin/uneven", RoundRobin, 7, 3, [][]int{{0, 3, 6}, {1, 4}, {2, 5}}},
		{"round-robin/one-shard", RoundRobin, 2, 1, [][]int{{0, 1}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := tc.make(tc.e, tc.s)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.want, m.Placement()); diff != "" {
				t.Errorf("placement (-want +got):\n%s", diff)
			}
			if got := m.NumExperts(); got != tc.e {
				t.Errorf("NumExperts() = %d, want %d", got, tc.e)
			}
			if got := m.NumShards(); got != tc.s {
				t.Errorf("NumShards() = %d, want %d", got, tc.s)
			}
			for s, ids := range tc.want {
				for local, e := range ids {
					if gs, gl := m.Owner(e); gs != s || gl != local {
						t.Errorf("Owner(%d) = %d, %d; want %d, %d", e, gs, gl, s, local)
					}
				}
			}
		})
	}
}

// TestBalancedSizes checks the balance of both schemes over many sizes:
// shard sizes differ by at most one and add up to E.
func TestBalancedSizes(t *testing.T) {
	for _, mk := range []func(e, s int) (*Map, error){Contiguous, RoundRobin} {
		for e := 1; e <= 40; e++ {
			for s := 1; s <= e; s++ {
				m, err := mk(e, s)
				if err != nil {
					t.Fatalf("(%d, %d): %v", e, s, err)
				}
				lo, hi, sum := e, 0, 0
				for i := range s {
					n := len(m.Experts(i))
					lo, hi, sum = min(lo, n), max(hi, n), sum+n
				}
				if hi-lo > 1 || sum != e {
					t.Errorf("(%d, %d): shard sizes in [%d, %d] adding to %d, want within one of each other adding to %d", e, s, lo, hi, sum, e)
				}
			}
		}
	}
}

func TestNewErrors(t *testing.T) {
	tests := []struct {
		name      string
		e         int
		placement [][]int
		wantErr   string // substring; "" means valid
	}{
		{"valid/permuted", 4, [][]int{{3, 0}, {1, 2}}, ""},
		{"no-experts", 0, [][]int{{}}, "0 experts"},
		{"no-shards", 4, nil, "no shards"},
		{"empty-shard", 2, [][]int{{0, 1}, {}}, "shard 1 owns no expert"},
		{"out-of-range", 2, [][]int{{0}, {2}}, "shard 1 lists expert 2: want ids in [0, 2)"},
		{"negative", 2, [][]int{{-1}, {0, 1}}, "shard 0 lists expert -1"},
		{"twice-across", 3, [][]int{{0, 1}, {1, 2}}, "expert 1 is on shard 0 and again on shard 1"},
		{"twice-within", 3, [][]int{{0, 0}, {1, 2}}, "expert 0 is on shard 0 and again on shard 0"},
		{"missing", 5, [][]int{{0}, {2}}, "experts 1, 3, 4 are on no shard"},
		{"missing-many", 20, [][]int{{0}}, "experts 1, 2, 3, 4, 5, 6, 7, 8, ... (19 in all) are on no shard"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(tc.e, tc.placement)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("New(%d, %v) = %v, want a map", tc.e, tc.placement, err)
				}
				if diff := cmp.Diff(tc.placement, m.Placement()); diff != "" {
					t.Errorf("placement not kept as given (-want +got):\n%s", diff)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, ErrPlacement) {
				t.Errorf("New(%d, %v) = %v, want an ErrPlacement containing %q", tc.e, tc.placement, err, tc.wantErr)
			}
		})
	}
}

func TestBalancedErrors(t *testing.T) {
	for _, tc := range []struct{ e, s int }{{0, 1}, {4, 0}, {4, 5}, {-1, -1}} {
		for name, mk := range map[string]func(e, s int) (*Map, error){"Contiguous": Contiguous, "RoundRobin": RoundRobin} {
			if _, err := mk(tc.e, tc.s); !errors.Is(err, ErrPlacement) {
				t.Errorf("%s(%d, %d) = %v, want ErrPlacement", name, tc.e, tc.s, err)
			}
		}
	}
}

func TestPlacementIsCopied(t *testing.T) {
	p := [][]int{{0, 1}, {2}}
	m, err := New(3, p)
	if err != nil {
		t.Fatal(err)
	}
	p[0][0] = 2
	got := m.Experts(0)
	got[1] = 7
	if diff := cmp.Diff([][]int{{0, 1}, {2}}, m.Placement()); diff != "" {
		t.Errorf("map changed through its input or Experts' result (-want +got):\n%s", diff)
	}
}

func TestString(t *testing.T) {
	tests := []struct {
		placement [][]int
		want      string
	}{
		{[][]int{{0, 1, 2, 3}, {4, 5, 6, 7}}, "8 experts on 2 shards: [0-3] [4-7]"},
		{[][]int{{0, 2, 4}, {1, 3}}, "5 experts on 2 shards: [0 2 4] [1 3]"},
		{[][]int{{5, 0, 1, 2}, {3, 4}}, "6 experts on 2 shards: [5 0-2] [3-4]"},
	}
	for _, tc := range tests {
		e := 0
		for _, ids := range tc.placement {
			e += len(ids)
		}
		m, err := New(e, tc.placement)
		if err != nil {
			t.Fatal(err)
		}
		if got := m.String(); got != tc.want {
			t.Errorf("String() = %q, want %q", got, tc.want)
		}
	}
}

func TestDispatch(t *testing.T) {
	m, err := New(6, [][]int{{4, 0, 1}, {2, 3}, {5}})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name       string
		ids        []int32
		topK       int
		wantPairs  [][]int
		wantLocal  [][]int32
		wantTokens []int
	}{
		{
			name: "spread", topK: 2,
			// token 0: experts 4 (s0 l0), 2 (s1 l0); token 1: 5 (s2), 0 (s0 l1); token 2: 1, 4 (both s0)
			ids:        []int32{4, 2, 5, 0, 1, 4},
			wantPairs:  [][]int{{0, 3, 4, 5}, {1}, {2}},
			wantLocal:  [][]int32{{0, 1, 2, 0}, {0}, {0}},
			wantTokens: []int{3, 1, 1},
		},
		{
			name: "all-on-one-shard", topK: 2,
			ids:        []int32{2, 3, 3, 2},
			wantPairs:  [][]int{nil, {0, 1, 2, 3}, nil},
			wantLocal:  [][]int32{nil, {0, 1, 1, 0}, nil},
			wantTokens: []int{0, 2, 0},
		},
		{
			name: "one-token-top_k=E", topK: 6,
			ids:        []int32{5, 4, 3, 2, 1, 0},
			wantPairs:  [][]int{{1, 4, 5}, {2, 3}, {0}},
			wantLocal:  [][]int32{{0, 2, 1}, {1, 0}, {0}},
			wantTokens: []int{1, 1, 1},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, err := m.Dispatch(tc.ids, tc.topK)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tc.wantPairs, d.Pairs); diff != "" {
				t.Errorf("Pairs (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tc.wantLocal, d.LocalIDs); diff != "" {
				t.Errorf("LocalIDs (-want +got):\n%s", diff)
			}
			for s, want := range tc.wantTokens {
				if got := d.Tokens(s); got != want {
					t.Errorf("Tokens(%d) = %d, want %d", s, got, want)
				}
			}
			// Every pair appears once, and maps back to its global id.
			seen := make([]bool, len(tc.ids))
			for s := range d.Pairs {
				for i, p := range d.Pairs[s] {
					if seen[p] {
						t.Errorf("pair %d dispatched twice", p)
					}
					seen[p] = true
					if g := m.Experts(s)[d.LocalIDs[s][i]]; g != int(tc.ids[p]) {
						t.Errorf("pair %d: shard %d local %d is expert %d, want %d", p, s, d.LocalIDs[s][i], g, tc.ids[p])
					}
				}
			}
		})
	}
}

func TestDispatchErrors(t *testing.T) {
	m, err := Contiguous(4, 2)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		ids     []int32
		topK    int
		wantErr string
	}{
		{"top_k=0", []int32{0}, 0, "top_k 0: want in [1, 4]"},
		{"top_k>E", []int32{0, 1, 2, 3, 0}, 5, "top_k 5: want in [1, 4]"},
		{"ragged", []int32{0, 1, 2}, 2, "3 topk ids do not fill rows of top_k = 2"},
		{"out-of-range", []int32{0, 1, 2, 4}, 2, "topk_ids: element 3 is 4: want an expert id in [0, 4)"},
		{"negative", []int32{-1, 1}, 2, "topk_ids: element 0 is -1"},
		{"repeated", []int32{0, 1, 2, 2}, 2, "topk_ids: element 3 repeats expert 2 of token 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := m.Dispatch(tc.ids, tc.topK); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Dispatch(%v, %d) = %v, want an error containing %q", tc.ids, tc.topK, err, tc.wantErr)
			}
		})
	}
}
