package client

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/moe"
	"github.com/expertd/expertd/shard"
)

// Sharded runs MoE layers whose experts are spread over several expertd
// daemons (expert parallelism across hosts): daemon s holds the experts
// that a shard.Map places on shard s. It routes each call once, here, sends
// every daemon only the (token, expert) pairs of its experts, and sums the
// partial outputs in float32. docs/sharding.md has the design and the
// numerics. It is safe for concurrent use; create it with DialSharded.
type Sharded struct {
	m      *shard.Map
	shards []*shardConn
}

// shardConn is one daemon and its limits.
type shardConn struct {
	addr string
	c    *Client
	// maxTokens and maxMsg are the daemon's bounds on one call (0: none).
	maxTokens int
	maxMsg    int64
}

// ShardError is a failure of one shard's daemon. It wraps the daemon's
// error, so status.Code gives the daemon's code, and its message names the
// shard.
type ShardError struct {
	// Shard is the index in the map, Addr the daemon's address.
	Shard int
	Addr  string
	Err   error
}

func (e *ShardError) Error() string { return fmt.Sprintf("shard %d (%s): %v", e.Shard, e.Addr, e.Err) }

// Unwrap is the daemon's error.
func (e *ShardError) Unwrap() error { return e.Err }

// DialSharded connects to one daemon per shard of m, addrs[s] serving
// shard s, with opts applied to each connection. It asks each daemon for
// its limits, so that calls can be split to fit them.
func DialSharded(ctx context.Context, m *shard.Map, addrs []string, opts ...Option) (*Sharded, error) {
	if m == nil || len(addrs) != m.NumShards() {
		n := 0
		if m != nil {
			n = m.NumShards()
		}
		return nil, fmt.Errorf("expertd sharded client: %d addresses for a map of %d shards", len(addrs), n)
	}
	s := &Sharded{m: m, shards: make([]*shardConn, len(addrs))}
	err := s.each(ctx, allShards(len(addrs)), func(ctx context.Context, i int) error {
		c, err := Dial(ctx, addrs[i], opts...)
		if err != nil {
			return err
		}
		sc := &shardConn{addr: addrs[i], c: c}
		s.shards[i] = sc
		info, err := c.ServerInfo(ctx)
		if err != nil {
			return err
		}
		sc.maxTokens, sc.maxMsg = info.Limits.MaxTokens, info.Limits.MaxMessageBytes
		if len(info.Backends) > 0 {
			if bt := info.Backends[0].MaxTokens; bt > 0 && (sc.maxTokens == 0 || bt < sc.maxTokens) {
				sc.maxTokens = bt
			}
		}
		return nil
	}, addrs)
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("expertd sharded client: %w", err)
	}
	return s, nil
}

// Close closes every connection.
func (s *Sharded) Close() error {
	var errs []error
	for _, sc := range s.shards {
		if sc != nil {
			errs = append(errs, sc.c.Close())
		}
	}
	return errors.Join(errs...)
}

// Map is the placement the client was dialed with.
func (s *Sharded) Map() *shard.Map { return s.m }

// Shard is the client of shard i's daemon, for calls the fan-out does not
// wrap (ListExperts, ServerInfo, Health).
func (s *Sharded) Shard(i int) *Client { return s.shards[i].c }

func allShards(n int) []int {
	ids := make([]int, n)
	for i := range ids {
		ids[i] = i
	}
	return ids
}

// each runs fn for the given shards concurrently. The first failure cancels
// the others and is returned as a *ShardError; later ones (often just the
// cancellation) are dropped.
func (s *Sharded) each(ctx context.Context, ids []int, fn func(ctx context.Context, shard int) error, addrs []string) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	for _, i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(ctx, i); err != nil {
				once.Do(func() {
					first = &ShardError{Shard: i, Addr: addrs[i], Err: err}
					cancel()
				})
			}
		}()
	}
	wg.Wait()
	return first
}

func (s *Sharded) addrs() []string {
	a := make([]string, len(s.shards))
	for i, sc := range s.shards {
		a[i] = sc.addr
	}
	return a
}

// LoadExperts loads w's experts on their daemons under name, all shards
// concurrently: shard s gets the experts the map places on it, in local-id
// order (see shardWeights for how each scale is split). It returns each
// shard's set info. When a shard fails the error names it, and the others
// may hold the new set: load again with Overwrite, or unload.
func (s *Sharded) LoadExperts(ctx context.Context, name string, w *ExpertWeights, opts ...LoadOption) ([]*ExpertSetInfo, error) {
	if w == nil {
		return nil, invalid("LoadExperts", errors.New("weights: required"))
	}
	if err := w.validate("weights"); err != nil {
		return nil, invalid("LoadExperts", err)
	}
	parts := make([]*ExpertWeights, len(s.shards))
	for i := range s.shards {
		p, err := shardWeights(w, s.m, i)
		if err != nil {
			return nil, invalid("LoadExperts", err)
		}
		parts[i] = p
	}
	infos := make([]*ExpertSetInfo, len(s.shards))
	err := s.each(ctx, allShards(len(s.shards)), func(ctx context.Context, i int) error {
		info, err := s.shards[i].c.LoadExperts(ctx, name, parts[i], opts...)
		infos[i] = info
		return err
	}, s.addrs())
	if err != nil {
		return nil, err
	}
	return infos, nil
}

// UnloadExperts unloads name from every shard and returns the bytes freed.
// Every shard is tried; the error names the first that failed.
func (s *Sharded) UnloadExperts(ctx context.Context, name string) (int64, error) {
	var (
		mu    sync.Mutex
		freed int64
		errs  []error
		wg    sync.WaitGroup
	)
	for i, sc := range s.shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, err := sc.c.UnloadExperts(ctx, name)
			mu.Lock()
			defer mu.Unlock()
			freed += n
			if err != nil {
				errs = append(errs, &ShardError{Shard: i, Addr: sc.addr, Err: err})
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		sort.Slice(errs, func(a, b int) bool { return errs[a].(*ShardError).Shard < errs[b].(*ShardError).Shard })
		return freed, errs[0]
	}
	return freed, nil
}

// FusedMoE runs one MoE layer on the set name loaded with LoadExperts.
//
// Routing runs here, once, with the daemon's own code (moe.Route), so it
// is the server's routing bit for bit (the CUDA backend is checked to
// agree with it). Each (token, slot) pair goes to the shard that owns its
// expert, as one row of a top_k = 1 request with its shard-local id and
// routing weight; a shard with no pairs is not called. Shards answer in
// FP32 (each row is w·y, rounded once), and shard's Combine sums the rows
// of each token in slot order in float32, exactly as a single daemon's
// combine does, before one rounding to the requested dtype (BF16 partials
// would round twice). ReturnRouting returns the global routing.
//
// Shards run concurrently, each split into calls of at most the daemon's
// max tokens; the context's deadline bounds them all, and the first failure
// cancels the rest and is returned as a *ShardError (status.Code gives the
// daemon's code).
func (s *Sharded) FusedMoE(ctx context.Context, req *FusedMoERequest) (*FusedMoEResult, error) {
	call, err := s.prepare(req)
	if err != nil {
		return nil, invalid("FusedMoE", err)
	}
	d, err := s.m.Dispatch(call.ids, call.topK)
	if err != nil {
		return nil, invalid("FusedMoE", err)
	}
	var busy []int
	for i := range s.shards {
		if len(d.Pairs[i]) > 0 {
			busy = append(busy, i)
		}
	}
	// rows[s] are shard s's answers, one FP32 row of K per pair, in the
	// order of d.Pairs[s]; timings and backends are per shard.
	rows := make([][]byte, len(s.shards))
	timings := make([]Timings, len(s.shards))
	backends := make([]string, len(s.shards))
	err = s.each(ctx, busy, func(ctx context.Context, i int) error {
		out, t, b, err := s.shards[i].run(ctx, call, req.ExpertSet, d.Pairs[i], d.LocalIDs[i])
		rows[i], timings[i], backends[i] = out, t, b
		return err
	}, s.addrs())
	if err != nil {
		return nil, err
	}

	m, k := call.m, call.k
	out, err := d.Combine(rows, k, call.out)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	res := &FusedMoEResult{Output: Tensor{DType: call.out, Shape: []int{m, k}, Data: out}}
	if req.ReturnRouting {
		res.TopKIDs = FromInt32(call.ids, m, call.topK)
		res.TopKWeights = FromFloat32(call.weights, m, call.topK)
	}
	var names []string
	for _, i := range busy {
		res.Timings = maxTimings(res.Timings, timings[i])
		names = append(names, backends[i])
	}
	res.Backend = strings.Join(dedupe(names), ",")
	return res, nil
}

// fanCall is a validated call, routed.
type fanCall struct {
	m, k, topK int
	out        moe.DType
	hidden     Tensor
	// scale is the FP8 hidden states' scale; perRow its values per token
	// (0 for a per-tensor scale, sent whole to every shard).
	scale  Tensor
	perRow int
	// ids and weights are the global routing, [m, topK].
	ids     []int32
	weights []float32
}

// prepare validates req against the map and routes it. The rules are the
// daemon's own (moe.Validate), checked against a stand-in for the set: the
// map gives E and the hidden states K; the block size the map does not
// know is taken from a per-group scale's group count (the smallest Bk
// giving it, which gives it exactly when any Bk does), so the shards check
// the count against the set itself.
func (s *Sharded) prepare(req *FusedMoERequest) (*fanCall, error) {
	if req.Weights != nil || req.ExpertSet == "" {
		return nil, errors.New("experts: a sharded call needs ExpertSet (a set loaded with Sharded.LoadExperts); inline weights are not sharded")
	}
	h, sc := req.Hidden, req.HiddenScale
	if len(h.Shape) != 2 || h.Shape[0] < 1 || h.Shape[1] < 1 {
		return nil, fmt.Errorf("hidden_states: shape %v: want [M, K] with M, K >= 1", h.Shape)
	}
	set := &moe.ExpertSet{E: s.m.NumExperts(), K: h.Shape[1]}
	if len(sc.Shape) == 2 && sc.Shape[1] >= 1 {
		set.Block[1] = (set.K + sc.Shape[1] - 1) / sc.Shape[1]
	}
	in := &moe.Input{
		Hidden: modelTensor(h), HiddenScale: modelTensor(sc), Logits: modelTensor(req.RouterLogits),
		TopKIDs: modelTensor(req.TopKIDs), TopKWeights: modelTensor(req.TopKWeights),
		Routing:  modelRouting(req.Routing),
		OutDType: req.OutputDType,
	}
	r, err := moe.Validate(in, set, moe.Limits{})
	if err != nil {
		return nil, err
	}
	c := &fanCall{m: r.M(), k: set.K, topK: r.Routing.TopK, hidden: h, out: r.OutDType}
	if h.DType == moe.Float8E4M3FN {
		c.scale = sc
		switch {
		case len(sc.Shape) == 1 && sc.Shape[0] == c.m && c.m > 1:
			c.perRow = 1
		case len(sc.Shape) == 2:
			c.perRow = sc.Shape[1]
		}
	}
	if r.TopKIDs != nil {
		c.ids, c.weights = r.TopKIDs, r.TopKWeights
		return c, nil
	}
	logits := make([]float32, c.m*set.E)
	for i := range logits {
		logits[i] = moe.Element(r.Logits.DType, r.Logits.Data, i)
	}
	c.ids, c.weights = make([]int32, c.m*c.topK), make([]float32, c.m*c.topK)
	moe.Route(c.ids, c.weights, logits, c.m, set.E, r.Routing)
	return c, nil
}

// modelTensor is t in the request model, nil when unset.
func modelTensor(t Tensor) *moe.Tensor {
	if t.IsZero() {
		return nil
	}
	return &moe.Tensor{DType: t.DType, Shape: t.Shape, Data: t.Data}
}

func modelRouting(rt Routing) *moe.RoutingInput {
	return &moe.RoutingInput{
		TopK: rt.TopK, Renormalize: rt.Renormalize, Scoring: rt.Scoring,
		CorrectionBias: modelTensor(rt.CorrectionBias),
		NumGroups:      rt.NumGroups, TopKGroups: rt.TopKGroups, ScalingFactor: rt.ScalingFactor,
	}
}

// chunkHeadroomRows is what a shard call needs beyond its rows: names,
// shapes and protobuf framing, with a wide margin.
const chunkHeadroomRows = 64 << 10

// rowsPerCall is how many pair rows fit one call to this daemon: its max
// tokens, and its message limit both ways (hidden row, scales, id and
// weight in; an FP32 row out).
func (sc *shardConn) rowsPerCall(c *fanCall) int {
	n := math.MaxInt
	if sc.maxTokens > 0 {
		n = sc.maxTokens
	}
	if sc.maxMsg > 2*chunkHeadroomRows {
		in := c.k*c.hidden.DType.Size() + 4*c.perRow + 8
		per := int64(max(in, 4*c.k))
		n = min(n, int(max(1, (sc.maxMsg-chunkHeadroomRows)/per)))
	}
	return n
}

// run computes shard pairs on this daemon, in calls of at most rowsPerCall
// rows one after another (the daemon runs calls in parallel itself, and a
// burst would only fill its queue), and returns the FP32 rows in pair order.
func (sc *shardConn) run(ctx context.Context, c *fanCall, set string, pairs []int, local []int32) ([]byte, Timings, string, error) {
	out := make([]byte, 0, len(pairs)*4*c.k)
	var tm Timings
	var backend string
	step := sc.rowsPerCall(c)
	for lo := 0; lo < len(pairs); lo += step {
		hi := min(lo+step, len(pairs))
		res, err := sc.c.FusedMoE(ctx, shardRequest(c, set, pairs[lo:hi], local[lo:hi]))
		if err != nil {
			return nil, tm, "", err
		}
		o := res.Output
		if o.DType != moe.Float32 || !equalShape(o.Shape, hi-lo, c.k) {
			return nil, tm, "", status.Errorf(codes.Internal, "output %v %v: want FP32 [%d, %d]", o.DType, o.Shape, hi-lo, c.k)
		}
		out = append(out, o.Data...)
		tm = addTimings(tm, res.Timings)
		backend = res.Backend
	}
	return out, tm, backend, nil
}

// shardRequest is the call for some of a shard's pairs: one row per pair,
// the token's hidden row (and its scales), the pair's local expert id and
// routing weight, top_k = 1, FP32 out.
func shardRequest(c *fanCall, set string, pairs []int, local []int32) *FusedMoERequest {
	n := len(pairs)
	rb := c.k * c.hidden.DType.Size()
	hidden := make([]byte, n*rb)
	weights := make([]float32, n)
	var scales []byte
	if c.perRow > 0 {
		scales = make([]byte, n*4*c.perRow)
	}
	for i, p := range pairs {
		t := p / c.topK
		copy(hidden[i*rb:(i+1)*rb], c.hidden.Data[t*rb:])
		if c.perRow > 0 {
			sb := 4 * c.perRow
			copy(scales[i*sb:(i+1)*sb], c.scale.Data[t*sb:])
		}
		weights[i] = c.weights[p]
	}
	r := &FusedMoERequest{
		ExpertSet:   set,
		Hidden:      Tensor{DType: c.hidden.DType, Shape: []int{n, c.k}, Data: hidden},
		TopKIDs:     FromInt32(local, n, 1),
		TopKWeights: FromFloat32(weights, n, 1),
		OutputDType: moe.Float32,
	}
	switch {
	case c.scale.IsZero():
	case c.perRow == 0:
		r.HiddenScale = c.scale
	case len(c.scale.Shape) == 1:
		r.HiddenScale = Tensor{DType: moe.Float32, Shape: []int{n}, Data: scales}
	default:
		r.HiddenScale = Tensor{DType: moe.Float32, Shape: []int{n, c.perRow}, Data: scales}
	}
	return r
}

func equalShape(shape []int, want ...int) bool {
	if len(shape) != len(want) {
		return false
	}
	for i := range shape {
		if shape[i] != want[i] {
			return false
		}
	}
	return true
}

func addTimings(a, b Timings) Timings {
	return Timings{Decode: a.Decode + b.Decode, Queue: a.Queue + b.Queue, H2D: a.H2D + b.H2D,
		Kernel: a.Kernel + b.Kernel, D2H: a.D2H + b.D2H, Total: a.Total + b.Total}
}

// maxTimings is the field-wise max: shards run concurrently, so the
// slowest shard's figure is the call's.
func maxTimings(a, b Timings) Timings {
	m := func(x, y time.Duration) time.Duration { return max(x, y) }
	return Timings{Decode: m(a.Decode, b.Decode), Queue: m(a.Queue, b.Queue), H2D: m(a.H2D, b.H2D),
		Kernel: m(a.Kernel, b.Kernel), D2H: m(a.D2H, b.D2H), Total: m(a.Total, b.Total)}
}

func dedupe(s []string) []string {
	sort.Strings(s)
	out := s[:0]
	for i, x := range s {
		if i == 0 || x != s[i-1] {
			out = append(out, x)
		}
	}
	return out
}
