// Package weights reads expert sets from safetensors files and Hugging
// Face checkpoint directories inside one weights directory: it finds a
// layer's tensors by a naming preset or templates, checks them against
// the file and config.json, quantizes BF16 and F16 weights to FP8, and
// declares the set to moe's layout rules like any client's. It knows
// nothing of protobuf or gRPC: the service converts a request's source to
// a Source and the errors to statuses.
package weights

import (
	"strconv"

	"github.com/expertd/expertd/moe"
)

// Source is a layer to load and how its tensors are named. Fields mirror
// expertd.v1.LoadExpertsRequest.SafetensorsSource; errors name them as it
// does ("safetensors.path").
type Source struct {
	// Name is the set's name, for logs.
	Name string
	// Path is a .safetensors file or a checkpoint directory, relative to
	// the weights directory.
	Path  string
	Layer int
	// Preset names the tensors; CUSTOM takes the templates below.
	Preset Preset
	// TensorPrefix replaces what precedes "layers.{L}" in a preset's names.
	TensorPrefix string
	// NumExperts loads experts [0, NumExperts); 0 means the whole layer.
	NumExperts int
	// WeightBlockShape is [Bn, Bk] of block scales; empty means the
	// checkpoint's (or [128, 128]).
	WeightBlockShape []int
	// WeightQuantization is the granularity BF16 and F16 weights are
	// quantized at.
	WeightQuantization Quantization
	// Activation is CUSTOM's.
	Activation moe.Activation
	// SwigluLimit and SwigluAlpha are a SwigluOAI layout's parameters; 0
	// takes config.json's (of a checkpoint directory), else moe's defaults.
	SwigluLimit, SwigluAlpha float32

	W13Template, W2Template, W13ScaleTemplate, W2ScaleTemplate   string
	GateTemplate, UpTemplate, GateScaleTemplate, UpScaleTemplate string
	W13InputScaleTemplate, W2InputScaleTemplate                  string
}

// Preset is a checkpoint family's tensor naming. Values mirror
// expertd.v1.NamingPreset.
type Preset int

const (
	PresetUnspecified Preset = iota
	NemotronH
	Qwen3MoE
	Custom
	DeepSeekV3
	Mixtral
	Auto
	GptOss
)

var presetNames = [...]string{"NAMING_PRESET_UNSPECIFIED", "NAMING_PRESET_NEMOTRON_H", "NAMING_PRESET_QWEN3_MOE",
	"NAMING_PRESET_CUSTOM", "NAMING_PRESET_DEEPSEEK_V3", "NAMING_PRESET_MIXTRAL", "NAMING_PRESET_AUTO", "NAMING_PRESET_GPT_OSS"}

// String is p as expertd.v1.NamingPreset spells it, which is how messages
// name a preset.
func (p Preset) String() string {
	if p >= 0 && int(p) < len(presetNames) {
		return presetNames[p]
	}
	return strconv.Itoa(int(p))
}

// Quantization is the scale granularity of weights quantized on load.
// Values mirror expertd.v1.WeightQuantization.
type Quantization int

const (
	QuantizationUnspecified Quantization = iota
	PerTensor
	PerChannel
	Block
)

var quantizationNames = [...]string{"WEIGHT_QUANTIZATION_UNSPECIFIED", "WEIGHT_QUANTIZATION_PER_TENSOR",
	"WEIGHT_QUANTIZATION_PER_CHANNEL", "WEIGHT_QUANTIZATION_BLOCK"}

// String is q as expertd.v1.WeightQuantization spells it.
func (q Quantization) String() string {
	if q >= 0 && int(q) < len(quantizationNames) {
		return quantizationNames[q]
	}
	return strconv.Itoa(int(q))
}
