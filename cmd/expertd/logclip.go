package main

import (
	"context"
	"fmt"
	"log/slog"

	"github.com/expertd/expertd/internal/clip"
)

// clipHandler cuts every string attribute (and error and Stringer) of a
// record to clip.Line bytes before the real handler writes it, except a
// panic's stack, which is the daemon's own and wanted whole. The
// service bounds what it echoes, but the middleware logs things a caller
// chose too (an unknown method's name, a status message from elsewhere):
// this is the one place every log line passes, so none can grow with a
// request.
type clipHandler struct{ slog.Handler }

func (h clipHandler) Handle(ctx context.Context, r slog.Record) error {
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		out.AddAttrs(clipAttr(a))
		return true
	})
	return h.Handler.Handle(ctx, out)
}

func (h clipHandler) WithAttrs(as []slog.Attr) slog.Handler {
	cs := make([]slog.Attr, len(as))
	for i, a := range as {
		cs[i] = clipAttr(a)
	}
	return clipHandler{h.Handler.WithAttrs(cs)}
}

func (h clipHandler) WithGroup(name string) slog.Handler {
	return clipHandler{h.Handler.WithGroup(name)}
}

func clipAttr(a slog.Attr) slog.Attr {
	v := a.Value.Resolve()
	if a.Key == "stack" {
		return slog.Attr{Key: a.Key, Value: v}
	}
	switch v.Kind() {
	case slog.KindString:
		return slog.String(a.Key, clip.To(v.String(), clip.Line))
	case slog.KindGroup:
		g := v.Group()
		cs := make([]any, len(g))
		for i, x := range g {
			cs[i] = clipAttr(x)
		}
		return slog.Group(a.Key, cs...)
	case slog.KindAny:
		switch x := v.Any().(type) {
		case error:
			return slog.String(a.Key, clip.To(x.Error(), clip.Line))
		case fmt.Stringer:
			return slog.String(a.Key, clip.To(x.String(), clip.Line))
		case []string:
			cs := make([]string, len(x))
			for i, s := range x {
				cs[i] = clip.To(s, clip.Line)
			}
			return slog.Any(a.Key, cs)
		}
	}
	return slog.Attr{Key: a.Key, Value: v}
}
