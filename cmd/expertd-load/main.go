// Command expertd-load loads MoE layers of a Hugging Face checkpoint into a
// running expertd. The daemon reads the weights itself, from a checkpoint
// directory under its -weights-dir (model.safetensors.index.json, shards,
// config.json); this command names the directory and the layers and shows
// a progress bar.
//
//	expertd-load -addr localhost:50051 -path Qwen3-30B-A3B-FP8 -layers all
//	expertd-load -path DeepSeek-V3 -layers 3-60 -name 'dsv3/layer{L}'
//
// -layers all needs the layer count: -num-layers, or -config naming a copy
// of the checkpoint's config.json (num_hidden_layers) that this process can
// read. Layers without routed experts (DeepSeek-V3's first dense layers,
// Nemotron-H's Mamba and attention layers) are skipped.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/expertd/expertd/internal/capfile"
	"github.com/expertd/expertd/internal/cliflags"
	"github.com/expertd/expertd/internal/clip"
	pb "github.com/expertd/expertd/proto/expertd/v1"
)

// config is the command line.
type config struct {
	dial                                      cliflags.Dial
	path, layers, name, preset, prefix, quant string
	numLayers                                 int
	configPath                                string
	overwrite                                 bool
	progress                                  string
}

// maxLayers bounds -num-layers and every layer index: the deepest MoE
// checkpoints have about a hundred layers, so a larger count is a typo
// that would otherwise issue a load call per number.
const maxLayers = 1024

// maxConfigBytes bounds -config: a config.json is a few kilobytes.
const maxConfigBytes = 4 << 20

func parseFlags(args []string, stderr io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("expertd-load", flag.ContinueOnError)
	fs.SetOutput(clip.LineWriter(stderr))
	c.dial.Register(fs, "localhost:50051", "file holding an admin bearer token (LoadExperts needs the admin role)",
		10*time.Minute, "each layer's load")
	fs.StringVar(&c.path, "path", "", "checkpoint directory (or .safetensors file), relative to the daemon's -weights-dir")
	fs.StringVar(&c.layers, "layers", "", `layers to load: "all", or a list of indices and ranges ("0", "3-60", "0,2,4-7")`)
	fs.IntVar(&c.numLayers, "num-layers", 0, fmt.Sprintf("layer count for -layers all, at most %d (default: num_hidden_layers of -config)", maxLayers))
	fs.StringVar(&c.configPath, "config", "", "a local copy of the checkpoint's config.json, for -layers all")
	fs.StringVar(&c.name, "name", "", `expert set name, {L} replaced by the layer (default "<path>/layer{L}")`)
	fs.StringVar(&c.preset, "preset", "auto", "naming preset: auto, nemotron_h, qwen3_moe, deepseek_v3, mixtral, gpt_oss")
	fs.StringVar(&c.quant, "weight-quantization", "", "how a BF16/FP16 checkpoint is quantized to FP8: per_channel (the daemon's default), per_tensor or block")
	fs.StringVar(&c.prefix, "tensor-prefix", "", `what precedes "layers.{L}" in tensor names, if not the preset's`)
	fs.BoolVar(&c.overwrite, "overwrite", false, "replace sets of the same names")
	fs.StringVar(&c.progress, "progress", "auto", "progress bar: auto (when stderr is a terminal), bar, lines, none")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if c.numLayers < 0 || c.numLayers > maxLayers {
		return c, fmt.Errorf("-num-layers %d: want 1 to %d (0: num_hidden_layers of -config)", c.numLayers, maxLayers)
	}
	if c.path == "" || c.layers == "" {
		return c, errors.New("-path and -layers are required")
	}
	if c.name == "" {
		c.name = strings.TrimSuffix(c.path, "/") + "/layer{L}"
	}
	if !strings.Contains(c.name, "{L}") && c.layers != "" && !isSingle(c.layers) {
		return c, errors.New("-name must contain {L} when loading several layers")
	}
	return c, c.dial.Check()
}

func isSingle(spec string) bool {
	_, err := strconv.Atoi(spec)
	return err == nil
}

// parseLayers expands "all" (with n layers) or a list of indices and
// ranges, in order, without repeats; every index is below maxLayers, so
// there are at most maxLayers.
func parseLayers(spec string, n int) ([]int, error) {
	if spec == "all" {
		if n < 1 {
			return nil, errors.New("-layers all needs -num-layers or -config")
		}
		if n > maxLayers {
			return nil, fmt.Errorf("-layers all: %d layers, more than %d", n, maxLayers)
		}
		out := make([]int, n)
		for i := range out {
			out[i] = i
		}
		return out, nil
	}
	var out []int
	seen := map[int]bool{}
	for _, part := range strings.Split(spec, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		a, err := strconv.Atoi(lo)
		b := a
		if err == nil && isRange {
			b, err = strconv.Atoi(hi)
		}
		if err != nil || a < 0 || b < a {
			return nil, fmt.Errorf("-layers: %s is not an index or a range a-b", clip.Quote(part))
		}
		if b >= maxLayers {
			return nil, fmt.Errorf("-layers: %s: layer indices go up to %d", clip.Quote(part), maxLayers-1)
		}
		for l := a; l <= b; l++ {
			if !seen[l] {
				seen[l] = true
				out = append(out, l)
			}
		}
	}
	return out, nil
}

func numHiddenLayers(path string) (int, error) {
	b, err := capfile.ReadAll(path, maxConfigBytes)
	if err != nil {
		return 0, fmt.Errorf("-config: %w", err)
	}
	var cfg struct {
		N    int `json:"num_hidden_layers"`
		Text *struct {
			N int `json:"num_hidden_layers"`
		} `json:"text_config"`
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return 0, fmt.Errorf("-config %s: %w", path, err)
	}
	if cfg.N == 0 && cfg.Text != nil {
		cfg.N = cfg.Text.N
	}
	if cfg.N < 1 || cfg.N > maxLayers {
		return 0, fmt.Errorf("-config %s: num_hidden_layers %d: want 1 to %d", path, cfg.N, maxLayers)
	}
	return cfg.N, nil
}

func presetOf(name string) (pb.NamingPreset, error) {
	v, ok := pb.NamingPreset_value["NAMING_PRESET_"+strings.ToUpper(name)]
	if !ok || v == int32(pb.NamingPreset_NAMING_PRESET_CUSTOM) || v == 0 {
		return 0, fmt.Errorf("-preset %q: want auto, nemotron_h, qwen3_moe, deepseek_v3, mixtral or gpt_oss", name)
	}
	return pb.NamingPreset(v), nil
}

func quantizationOf(name string) (pb.WeightQuantization, error) {
	if name == "" {
		return pb.WeightQuantization_WEIGHT_QUANTIZATION_UNSPECIFIED, nil
	}
	v, ok := pb.WeightQuantization_value["WEIGHT_QUANTIZATION_"+strings.ToUpper(name)]
	if !ok || v == 0 {
		return 0, fmt.Errorf("-weight-quantization %s: want per_channel, per_tensor or block", clip.Quote(name))
	}
	return pb.WeightQuantization(v), nil
}

// loaded is the outcome of one layer.
type loaded struct {
	layer   int
	info    *pb.ExpertSetInfo
	skipped bool
}

// loadLayers loads each layer in turn, reporting to prog; a layer the
// daemon finds no experts in (NotFound) is skipped, any other failure
// stops the run.
func loadLayers(ctx context.Context, rpc pb.ExpertServiceClient, c config, layers []int, prog *progress) ([]loaded, error) {
	preset, err := presetOf(c.preset)
	if err != nil {
		return nil, err
	}
	quant, err := quantizationOf(c.quant)
	if err != nil {
		return nil, err
	}
	var out []loaded
	for i, l := range layers {
		name := strings.ReplaceAll(c.name, "{L}", strconv.Itoa(l))
		prog.start(i, l)
		info, err := loadOne(ctx, rpc, c, &pb.LoadExpertsRequest_SafetensorsSource{
			Name: name, Path: c.path, Layer: int32(l), Preset: preset, TensorPrefix: c.prefix, Overwrite: c.overwrite,
			WeightQuantization: quant,
		})
		if status.Code(err) == codes.NotFound && len(layers) > 1 && strings.Contains(status.Convert(err).Message(), "no tensor of layer") {
			out = append(out, loaded{layer: l, skipped: true})
			prog.done(i+1, l, 0, "no experts, skipped")
			continue
		}
		if err != nil {
			prog.finish()
			return out, fmt.Errorf("layer %d (%s): %w", l, clip.Quote(name), err)
		}
		out = append(out, loaded{layer: l, info: info})
		prog.done(i+1, l, info.GetBytes(), name)
	}
	prog.finish()
	return out, nil
}

func loadOne(ctx context.Context, rpc pb.ExpertServiceClient, c config, src *pb.LoadExpertsRequest_SafetensorsSource) (*pb.ExpertSetInfo, error) {
	ctx, cancel := c.dial.Call(ctx)
	defer cancel()
	stream, err := rpc.LoadExperts(ctx)
	if err != nil {
		return nil, err
	}
	// A Send error means the server answered already; CloseAndRecv has it.
	_ = stream.Send(&pb.LoadExpertsRequest{Payload: &pb.LoadExpertsRequest_Safetensors{Safetensors: src}})
	return stream.CloseAndRecv()
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	n := c.numLayers
	if c.layers == "all" && n == 0 && c.configPath != "" {
		if n, err = numHiddenLayers(c.configPath); err != nil {
			return err
		}
	}
	layers, err := parseLayers(c.layers, n)
	if err != nil {
		return err
	}
	cl, err := c.dial.Connect(ctx)
	if err != nil {
		return err
	}
	defer cl.Close()
	prog := newProgress(stderr, c.progress, len(layers))
	res, err := loadLayers(ctx, cl.RPC(), c, layers, prog)
	var sets, skipped int
	var bytes int64
	for _, r := range res {
		if r.skipped {
			skipped++
			continue
		}
		sets++
		bytes += r.info.GetBytes()
		clip.Fprintf(stdout, "%s\tlayer %d\tE=%d K=%d N=%d\t%d bytes\t%s\n", r.info.GetName(), r.layer,
			r.info.GetNumExperts(), r.info.GetHiddenSize(), r.info.GetIntermediateSize(), r.info.GetBytes(), r.info.GetFingerprint())
	}
	fmt.Fprintf(stderr, "expertd-load: %d sets loaded (%s), %d layers without experts skipped\n", sets, humanBytes(bytes), skipped)
	return err
}

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
		if !errors.Is(err, flag.ErrHelp) {
			clip.Fprintf(os.Stderr, "expertd-load: %v\n", err)
		}
		os.Exit(1)
	}
}
