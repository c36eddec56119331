package service

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/expertd/expertd/moe"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// LoadExperts receives an expert set (header then chunks, or one
// safetensors source), validates it and makes it resident. Nothing is
// visible until the whole set has arrived and validated.
func (s *Server) LoadExperts(stream grpc.ClientStreamingServer[pb.LoadExpertsRequest, pb.ExpertSetInfo]) error {
	ctx := stream.Context()
	info, err := s.loadExperts(ctx, stream)
	if err != nil {
		return s.toStatus(ctx, "LoadExperts", err)
	}
	return stream.SendAndClose(info)
}

func (s *Server) loadExperts(ctx context.Context, stream grpc.ClientStreamingServer[pb.LoadExpertsRequest, pb.ExpertSetInfo]) (*pb.ExpertSetInfo, error) {
	done, err := s.begin()
	if err != nil {
		return nil, err
	}
	defer done()
	first, err := stream.Recv()
	if errors.Is(err, io.EOF) {
		return nil, invalidf("header", "stream ended before a header or safetensors message")
	}
	if err != nil {
		return nil, err
	}
	switch p := first.GetPayload().(type) {
	case *pb.LoadExpertsRequest_Header_:
		return s.loadChunked(ctx, stream, p.Header)
	case *pb.LoadExpertsRequest_Safetensors:
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			if err != nil {
				return nil, err
			}
			return nil, invalidf("safetensors", "must be the stream's only message")
		}
		return s.loadSafetensors(ctx, p.Safetensors, nil)
	case *pb.LoadExpertsRequest_Chunk_:
		return nil, invalidf("chunk", "arrived before the header")
	}
	return nil, invalidf("payload", "set header, chunk or safetensors")
}

// checkName enforces Header.name's documented alphabet, which keeps names
// safe in logs, metrics labels and file names.
func checkName(field, name string) error {
	if len(name) < 1 || len(name) > 128 {
		return invalidf(field, "%s: want 1-128 characters", Quote(name))
	}
	for _, c := range name {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("._/-", c)) {
			return invalidf(field, "%s: character %q is not in [A-Za-z0-9._/-]", Quote(name), c)
		}
	}
	return nil
}

// loadChunked assembles a chunked upload into preallocated buffers.
func (s *Server) loadChunked(ctx context.Context, stream grpc.ClientStreamingServer[pb.LoadExpertsRequest, pb.ExpertSetInfo], h *pb.LoadExpertsRequest_Header) (*pb.ExpertSetInfo, error) {
	if err := checkName("header.name", h.GetName()); err != nil {
		return nil, err
	}
	if err := s.reg.checkFree("header.name", h.GetName(), h.GetOverwrite()); err != nil {
		return nil, err
	}
	l, err := checkLayout("header.weights", h.GetWeights())
	if err != nil {
		return nil, err
	}
	for i, t := range weightTensors(h.GetWeights()) {
		if t != nil && t.GetSource() != nil {
			return nil, invalidf("header.weights."+moe.SetTensorNames[i], "carries data; the header declares dtype and shape only, chunks carry the bytes")
		}
	}
	total := l.TotalBytes()
	if h.GetTotalBytes() != total {
		return nil, invalidf("header.total_bytes", "%d: the declared tensors hold %d bytes", h.GetTotalBytes(), total)
	}
	want := strings.ToLower(h.GetSha256())
	if want != "" {
		if _, err := hex.DecodeString(want); err != nil || len(want) != 64 {
			return nil, invalidf("header.sha256", "%s: want 64 hex digits", Quote(h.GetSha256()))
		}
	}
	if err := s.reg.reserve("header.total_bytes", total); err != nil {
		return nil, err
	}
	committed := false
	defer func() {
		if !committed {
			s.reg.release(total)
		}
	}()
	if err := l.CheckScaleShapes("header.weights"); err != nil {
		return nil, fromModel(err)
	}

	var bufs [moe.SetTensors][]byte
	var cover [moe.SetTensors]coverage
	for i := range bufs {
		if l.Present[i] {
			bufs[i] = make([]byte, l.Tensors[i].Bytes)
		}
	}
	for n := 0; ; n++ {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, err
		}
		c := msg.GetChunk()
		if c == nil {
			return nil, invalidf("chunk", "message %d after the header is not a chunk", n+1)
		}
		i, ok := moe.SetTensorIndex(c.GetTensor())
		if !ok || !l.Present[i] {
			return nil, invalidf("chunk.tensor", "%s: not a tensor the header declared", Quote(c.GetTensor()))
		}
		field := "chunk[" + c.GetTensor() + "]"
		off, size := c.GetOffset(), int64(len(c.GetData()))
		if size == 0 {
			return nil, invalidf(field+".data", "is empty")
		}
		if off < 0 || off > int64(len(bufs[i]))-size {
			return nil, invalidf(field, "bytes [%d, %d) are outside the tensor's %d bytes", off, off+size, len(bufs[i]))
		}
		if err := cover[i].add(off, off+size); err != nil {
			return nil, invalidf(field, "%v", err)
		}
		copy(bufs[i][off:], c.GetData())
	}
	for i := range bufs {
		if l.Present[i] && !cover[i].complete(int64(len(bufs[i]))) {
			return nil, invalidf("chunk["+moe.SetTensorNames[i]+"]", "incomplete: missing bytes %s of %d", cover[i].gaps(int64(len(bufs[i]))), len(bufs[i]))
		}
	}
	fp := moe.Fingerprint(bufs)
	if want != "" && want != fp {
		return nil, invalidf("header.sha256", "%s does not match the received bytes' %s", Quote(want), fp)
	}
	set, err := l.Build("header.weights", bufs)
	if err != nil {
		return nil, fromModel(err)
	}
	info, err := s.commit(ctx, h.GetName(), set, total, fp, 0, h.GetOverwrite())
	if err != nil {
		return nil, err
	}
	committed = true
	return info, nil
}

// commit loads set into the backend and publishes it. The registry entry
// takes over the caller's reservation of n bytes on success.
func (s *Server) commit(ctx context.Context, name string, set *moe.ExpertSet, n int64, fp string, topKHint int, overwrite bool) (*pb.ExpertSetInfo, error) {
	return s.commitRouted(ctx, name, set, n, fp, topKHint, nil, overwrite)
}

// commitRouted is commit for a set that comes with the routing its
// checkpoint specifies (nil for none), reported in its info.
func (s *Server) commitRouted(ctx context.Context, name string, set *moe.ExpertSet, n int64, fp string, topKHint int, routing *pb.Routing, overwrite bool) (*pb.ExpertSetInfo, error) {
	// A load that outlived Shutdown's deadline must not publish a set that
	// nothing would free.
	if s.Draining() {
		return nil, errDraining
	}
	loaded, err := s.batch.Load(ctx, set)
	if err = s.backendDone(ctx, "load", err); err != nil {
		return nil, err
	}
	info := &pb.ExpertSetInfo{
		Name:                name,
		Activation:          wireActivation(set.Activation),
		NumExperts:          int32(set.E),
		HiddenSize:          int32(set.K),
		IntermediateSize:    int32(set.N),
		TopKHint:            int32(topKHint),
		W13ScaleGranularity: set.W13Scale.Granularity.String(),
		W2ScaleGranularity:  set.W2Scale.Granularity.String(),
		StaticA13Scale:      set.A13Scale != nil,
		StaticA2Scale:       set.A2Scale != nil,
		Bytes:               n,
		Fingerprint:         fp,
		Backend:             s.backend.Name(),
		LoadedAt:            timestamppb.New(time.Now()),
		Routing:             routing,
	}
	if set.Block != [2]int{} {
		info.WeightBlockShape = []int32{int32(set.Block[0]), int32(set.Block[1])}
	}
	if err := s.reg.put(&entry{info: info, loaded: loaded, bytes: n}, overwrite); err != nil {
		if cerr := loaded.Close(); cerr != nil {
			s.log.ErrorContext(ctx, "closing rejected expert set", slog.Any("err", cerr))
		}
		return nil, err
	}
	s.log.InfoContext(ctx, "expert set loaded", slog.String("name", name), slog.String("activation", set.Activation.String()),
		slog.Int("E", set.E), slog.Int("K", set.K), slog.Int("N", set.N), slog.Int64("bytes", n), slog.String("sha256", fp))
	return info, nil
}

// coverage is the set of byte ranges received for one tensor, kept sorted
// and merged, so overlap is caught on arrival and completeness is one
// comparison.
type coverage struct {
	spans [][2]int64
}

// add records [lo, hi) or reports an overlap with bytes already received.
func (c *coverage) add(lo, hi int64) error {
	i := sort.Search(len(c.spans), func(i int) bool { return c.spans[i][0] >= lo })
	if i > 0 && c.spans[i-1][1] > lo {
		return errOverlap(lo, hi, c.spans[i-1])
	}
	if i < len(c.spans) && c.spans[i][0] < hi {
		return errOverlap(lo, hi, c.spans[i])
	}
	switch joinPrev, joinNext := i > 0 && c.spans[i-1][1] == lo, i < len(c.spans) && c.spans[i][0] == hi; {
	case joinPrev && joinNext:
		c.spans[i-1][1] = c.spans[i][1]
		c.spans = append(c.spans[:i], c.spans[i+1:]...)
	case joinPrev:
		c.spans[i-1][1] = hi
	case joinNext:
		c.spans[i][0] = lo
	default:
		c.spans = append(c.spans, [2]int64{})
		copy(c.spans[i+1:], c.spans[i:])
		c.spans[i] = [2]int64{lo, hi}
	}
	return nil
}

func errOverlap(lo, hi int64, s [2]int64) error {
	return fmt.Errorf("bytes [%d, %d) overlap bytes [%d, %d) already received", lo, hi, s[0], s[1])
}

// complete reports whether [0, size) is covered.
func (c *coverage) complete(size int64) bool {
	return size == 0 || len(c.spans) == 1 && c.spans[0] == [2]int64{0, size}
}

// gaps describes the first missing ranges, for the error message.
func (c *coverage) gaps(size int64) string {
	var parts []string
	at := int64(0)
	for _, s := range append(c.spans, [2]int64{size, size}) {
		if s[0] > at {
			parts = append(parts, fmt.Sprintf("[%d, %d)", at, s[0]))
		}
		at = s[1]
	}
	if len(parts) > 3 {
		parts = append(parts[:3], "...")
	}
	return strings.Join(parts, " ")
}
