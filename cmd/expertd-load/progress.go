package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/expertd/expertd/internal/clip"
)

// progress draws the run's progress on stderr: a bar redrawn in place on a
// terminal, or one line per layer otherwise.
type progress struct {
	w          io.Writer
	mode       string // "bar", "lines" or "none"
	total      int
	began      time.Time
	layerBegan time.Time
	bytes      int64
}

func newProgress(w io.Writer, mode string, total int) *progress {
	if mode == "auto" {
		mode = "lines"
		if f, ok := w.(*os.File); ok {
			if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
				mode = "bar"
			}
		}
	}
	return &progress{w: w, mode: mode, total: total, began: time.Now()}
}

func (p *progress) start(i, layer int) {
	p.layerBegan = time.Now()
	if p.mode == "bar" {
		p.draw(i, fmt.Sprintf("loading layer %d", layer))
	}
}

func (p *progress) done(i, layer int, n int64, what string) {
	p.bytes += n
	switch p.mode {
	case "bar":
		p.draw(i, fmt.Sprintf("layer %d: %s", layer, what))
	case "lines":
		clip.Fprintf(p.w, "[%d/%d] layer %d: %s (%s in %s)\n", i, p.total, layer, what, humanBytes(n), time.Since(p.layerBegan).Round(time.Millisecond))
	}
}

func (p *progress) draw(i int, what string) {
	const width = 30
	fill := width * i / max(p.total, 1)
	el := time.Since(p.began)
	rate, eta := "", ""
	if s := el.Seconds(); s > 0 && p.bytes > 0 {
		rate = humanBytes(int64(float64(p.bytes)/s)) + "/s"
	}
	if i > 0 && i < p.total {
		eta = "eta " + (el / time.Duration(i) * time.Duration(p.total-i)).Round(time.Second).String()
	}
	clip.Fprintf(p.w, "\r\x1b[K[%s%s] %d/%d layers  %s  %s  %s  %s", strings.Repeat("=", fill), strings.Repeat(" ", width-fill),
		i, p.total, humanBytes(p.bytes), rate, eta, what)
}

func (p *progress) finish() {
	if p.mode == "bar" {
		fmt.Fprintln(p.w)
	}
}

func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}
