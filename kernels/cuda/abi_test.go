package cuda

import (
	"os"
	"regexp"
	"strconv"
	"testing"
)

// TestHeaderMatchesGo checks every numeric #define of the C header against
// the Go mirror, in both directions: a define with no Go twin fails too.
func TestHeaderMatchesGo(t *testing.T) {
	// go test runs in the package directory; the device check runs the test
	// binary from the repository root.
	src, err := os.ReadFile("csrc/expertd_cuda.h")
	if err != nil {
		src, err = os.ReadFile("kernels/cuda/csrc/expertd_cuda.h")
	}
	if err != nil {
		t.Fatal(err)
	}
	goVals := map[string]int{
		"EXPERTD_ABI_VERSION": abiVersion,

		"EXPERTD_OK":              codeOK,
		"EXPERTD_ERR_INVALID":     codeInvalid,
		"EXPERTD_ERR_UNSUPPORTED": codeUnsupported,
		"EXPERTD_ERR_OOM":         codeOOM,
		"EXPERTD_ERR_CUDA":        codeCUDA,
		"EXPERTD_ERR_NO_DEVICE":   codeNoDevice,
		"EXPERTD_ERR_NOT_FOUND":   codeNotFound,

		"EXPERTD_DTYPE_FLOAT32":       dtypeFloat32,
		"EXPERTD_DTYPE_BFLOAT16":      dtypeBFloat16,
		"EXPERTD_DTYPE_FLOAT8_E4M3FN": dtypeFloat8,

		"EXPERTD_ACT_SILU_GATED":  actSiluGated,
		"EXPERTD_ACT_RELU2":       actRelu2,
		"EXPERTD_SCORING_SOFTMAX": scoringSoftmax,
		"EXPERTD_SCORING_SIGMOID": scoringSigmoid,

		"EXPERTD_GEMM_AUTO":         gemmAuto,
		"EXPERTD_GEMM_PORTABLE":     gemmPortable,
		"EXPERTD_GEMM_PORTABLE_F16": gemmPortableF16,
		"EXPERTD_GEMM_SM90":         gemmSM90,

		"EXPERTD_P_M":              pM,
		"EXPERTD_P_HIDDEN_DTYPE":   pHiddenDType,
		"EXPERTD_P_N_HIDDEN_SCALE": pNHiddenScale,
		"EXPERTD_P_LOGITS_DTYPE":   pLogitsDType,
		"EXPERTD_P_OUT_DTYPE":      pOutDType,
		"EXPERTD_P_TOP_K":          pTopK,
		"EXPERTD_P_RENORMALIZE":    pRenormalize,
		"EXPERTD_P_SCORING":        pScoring,
		"EXPERTD_P_NUM_GROUPS":     pNumGroups,
		"EXPERTD_P_TOPK_GROUPS":    pTopKGroups,
		"EXPERTD_P_GEMM":           pGEMM,
		"EXPERTD_P_USE_GRAPH":      pUseGraph,
		"EXPERTD_NUM_IPARAMS":      numIParams,

		"EXPERTD_F_SCALING_FACTOR": fScalingFactor,
		"EXPERTD_NUM_FPARAMS":      numFParams,

		"EXPERTD_MAX_EXPERTS":      maxExperts,
		"EXPERTD_MAX_TOP_K":        maxTopK,
		"EXPERTD_MAX_STREAMS":      maxStreams,
		"EXPERTD_IPC_HANDLE_BYTES": ipcHandleBytes,
	}
	re := regexp.MustCompile(`(?m)^#define\s+(EXPERTD_\w+)\s+(-?\d+)\b`)
	seen := map[string]bool{}
	for _, m := range re.FindAllStringSubmatch(string(src), -1) {
		name := m[1]
		got, _ := strconv.Atoi(m[2])
		seen[name] = true
		want, ok := goVals[name]
		if !ok {
			t.Errorf("header defines %s = %d; the Go mirror has no constant for it", name, got)
			continue
		}
		if got != want {
			t.Errorf("%s: header %d, Go %d", name, got, want)
		}
	}
	for name := range goVals {
		if !seen[name] {
			t.Errorf("Go mirrors %s, which the header no longer defines", name)
		}
	}
	if len(seen) < 30 {
		t.Errorf("parsed only %d defines from the header; is the regexp stale?", len(seen))
	}
}

// TestCodeNames keeps the error-name table in step with the codes.
func TestCodeNames(t *testing.T) {
	for _, tc := range []struct {
		rc   int32
		want string
	}{
		{codeOK, "OK"}, {codeInvalid, "ERR_INVALID"}, {codeUnsupported, "ERR_UNSUPPORTED"},
		{codeOOM, "ERR_OOM"}, {codeCUDA, "ERR_CUDA"}, {codeNoDevice, "ERR_NO_DEVICE"},
		{codeNotFound, "ERR_NOT_FOUND"}, {99, "ERR_UNKNOWN"},
	} {
		if got := codeName(tc.rc); got != tc.want {
			t.Errorf("codeName(%d) = %q, want %q", tc.rc, got, tc.want)
		}
	}
}
