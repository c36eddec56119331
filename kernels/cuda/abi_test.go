package cuda

import (
	"os"
	"reflect"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/expertd/expertd/moe"
)

// TestHeaderMatchesGo checks every numeric #define of the C header against
// the Go mirror, in both directions: a define with no Go twin fails too.
func TestHeaderMatchesGo(t *testing.T) {
	// go test runs in the package directory; the device check runs the test
	// binary from the repository root.
	src := readHeader(t)
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

		"EXPERTD_ACT_SILU_GATED":      actSiluGated,
		"EXPERTD_ACT_RELU2":           actRelu2,
		"EXPERTD_ACT_SWIGLU_OAI":      actSwigluOAI,
		"EXPERTD_ACT_GELU_TANH_GATED": actGeluTanhGated,
		"EXPERTD_ACT_GELU_GATED":      actGeluGated,
		"EXPERTD_SCORING_SOFTMAX":     scoringSoftmax,
		"EXPERTD_SCORING_SIGMOID":     scoringSigmoid,

		"EXPERTD_GEMM_AUTO":         gemmAuto,
		"EXPERTD_GEMM_PORTABLE":     gemmPortable,
		"EXPERTD_GEMM_PORTABLE_F16": gemmPortableF16,
		"EXPERTD_GEMM_SM90":         gemmSM90,

		"EXPERTD_MEM_UNKNOWN":  memUnknown,
		"EXPERTD_MEM_PAGEABLE": memPageable,
		"EXPERTD_MEM_PINNED":   memPinned,
		"EXPERTD_MEM_DEVICE":   memDevice,

		"EXPERTD_CALL_BYTES":       callBytes,
		"EXPERTD_BUF_BYTES":        bufBytes,
		"EXPERTD_OPTIONS_BYTES":    optionsBytes,
		"EXPERTD_SET_PARAMS_BYTES": setParamsBytes,
		"EXPERTD_MAX_SPIN_US":      maxSpinUS,

		"EXPERTD_MAX_EXPERTS":      maxExperts,
		"EXPERTD_MAX_TOP_K":        maxTopK,
		"EXPERTD_MAX_STREAMS":      maxStreams,
		"EXPERTD_IPC_HANDLE_BYTES": ipcHandleBytes,

		"EXPERTD_MAX_LANE_DEPTH":   maxLaneDepth,
		"EXPERTD_LANE_FLAGS_BYTES": laneFlagsBytes,
		"EXPERTD_LANE_DOORBELL":    laneDoorbell,
		"EXPERTD_LANE_DONE":        laneDone,
		"EXPERTD_LANE_STOP":        laneStop,
		"EXPERTD_LANE_MPS":         laneMPS,
		"EXPERTD_LANE_SKIPS":       laneSkips,
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

func readHeader(t *testing.T) []byte {
	t.Helper()
	// go test runs in the package directory; the device check runs the test
	// binary from the repository root.
	src, err := os.ReadFile("csrc/expertd_cuda.h")
	if err != nil {
		src, err = os.ReadFile("kernels/cuda/csrc/expertd_cuda.h")
	}
	if err != nil {
		t.Fatal(err)
	}
	return src
}

// cField is one field of a C struct of the header.
type cField struct {
	name          string
	offset, bytes uintptr
}

// cStructLayout parses `typedef struct name { ... } name;` from the header
// and lays it out as a C compiler does for the header's field types (each
// aligned to its size; the struct to its largest field).
func cStructLayout(t *testing.T, src []byte, name string) ([]cField, uintptr) {
	t.Helper()
	re := regexp.MustCompile(`(?s)typedef struct ` + name + ` \{(.*?)\} ` + name + `;`)
	m := re.FindSubmatch(src)
	if m == nil {
		t.Fatalf("header has no typedef struct %s", name)
	}
	sizes := map[string]uintptr{"uint32_t": 4, "int32_t": 4, "float": 4, "uint64_t": 8, "void*": 8, "float*": 8,
		"uint8_t*": 8, "expertd_buf": bufBytes}
	body := regexp.MustCompile(`(?s)/\*.*?\*/`).ReplaceAllString(string(m[1]), "")
	field := regexp.MustCompile(`^\s*(\w+\s*\*?)\s*(\*?\w+);\s*$`)
	var fields []cField
	var off, align uintptr = 0, 1
	for _, line := range strings.Split(body, "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		// const changes no layout.
		f := field.FindStringSubmatch(strings.Replace(line, "const ", "", 1))
		if f == nil {
			t.Fatalf("struct %s: cannot parse field line %q", name, line)
		}
		typ, fname := strings.ReplaceAll(f[1], " ", ""), f[2]
		if strings.HasPrefix(fname, "*") {
			typ, fname = typ+"*", fname[1:]
		}
		n, ok := sizes[typ]
		if !ok {
			t.Fatalf("struct %s: field %s has type %s, which this test does not size", name, fname, typ)
		}
		a := min(n, 8)
		off = (off + a - 1) / a * a
		fields = append(fields, cField{fname, off, n})
		off += n
		align = max(align, a)
	}
	return fields, (off + align - 1) / align * align
}

// TestStructsMatchGo checks the Go mirrors of the header's structs field by
// field: same names (ignoring case and underscores), offsets and sizes.
func TestStructsMatchGo(t *testing.T) {
	src := readHeader(t)
	norm := func(s string) string { return strings.ToLower(strings.ReplaceAll(s, "_", "")) }
	for _, tc := range []struct {
		c    string
		goT  reflect.Type
		size uintptr
	}{
		{"expertd_buf", reflect.TypeOf(cBuf{}), bufBytes},
		{"expertd_call", reflect.TypeOf(cCall{}), callBytes},
		{"expertd_options", reflect.TypeOf(cOptions{}), optionsBytes},
		{"expertd_set_params", reflect.TypeOf(cSetParams{}), setParamsBytes},
	} {
		fields, size := cStructLayout(t, src, tc.c)
		if size != tc.size || tc.goT.Size() != tc.size {
			t.Errorf("%s: C layout %d bytes, Go %d, header's define %d", tc.c, size, tc.goT.Size(), tc.size)
		}
		if len(fields) != tc.goT.NumField() {
			t.Errorf("%s: %d fields in C, %d in Go", tc.c, len(fields), tc.goT.NumField())
			continue
		}
		for i, f := range fields {
			g := tc.goT.Field(i)
			if norm(g.Name) != norm(f.name) || g.Offset != f.offset || g.Type.Size() != f.bytes {
				t.Errorf("%s field %d: C %s at %d (%d bytes), Go %s at %d (%d bytes)", tc.c, i, f.name, f.offset, f.bytes,
					g.Name, g.Offset, g.Type.Size())
			}
		}
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

// TestLibraryChecksStructs calls the built library (skipped where there is
// none) with malformed structs: each is refused as invalid, naming what is
// wrong, before any device is touched, so it runs without a GPU.
func TestLibraryChecksStructs(t *testing.T) {
	lib, err := openLibrary("")
	if err != nil {
		t.Skipf("no library: %v", err)
	}
	call := func(f func() int32) (int32, string) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		rc := f()
		return rc, lib.lastError()
	}
	good := func() *cCall { return &cCall{size: callBytes, version: abiVersion} }
	short, old, badMem := good(), good(), good()
	short.size = 16
	old.version = abiVersion - 1
	badMem.out.mem = 7
	for _, tc := range []struct {
		name string
		c    *cCall
		want string
	}{
		{"short", short, "call of 16 bytes"},
		{"old version", old, "ABI " + strconv.Itoa(abiVersion-1)},
		{"memory kind", badMem, "memory kind 7"},
	} {
		rc, msg := call(func() int32 { return lib.moe(1, tc.c) })
		if rc != codeInvalid || !strings.Contains(msg, tc.want) {
			t.Errorf("moe with a %s call: rc %s, %q; want ERR_INVALID naming %q", tc.name, codeName(rc), msg, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		o    cOptions
		want string
	}{
		{"short", cOptions{size: 8, version: abiVersion, streams: 1}, "options of 8 bytes"},
		{"no streams", cOptions{size: optionsBytes, version: abiVersion}, "0 streams"},
		{"long spin", cOptions{size: optionsBytes, version: abiVersion, streams: 1, syncSpinUS: maxSpinUS + 1}, "sync_spin_us"},
	} {
		rc, msg := call(func() int32 { return lib.init(0, &tc.o) })
		if rc != codeInvalid || !strings.Contains(msg, tc.want) {
			t.Errorf("init with %s options: rc %s, %q; want ERR_INVALID naming %q", tc.name, codeName(rc), msg, tc.want)
		}
	}
	for _, tc := range []struct {
		name string
		p    *cSetParams
		want string
	}{
		{"nil", nil, "NULL params"},
		{"short", &cSetParams{size: 8, version: abiVersion}, "params of 8 bytes"},
		{"old version", &cSetParams{size: setParamsBytes, version: abiVersion - 1}, "ABI " + strconv.Itoa(abiVersion-1)},
	} {
		var h uint64
		rc, msg := call(func() int32 { return lib.setCreate(0, tc.p, &h) })
		if rc != codeInvalid || !strings.Contains(msg, tc.want) || h != 0 {
			t.Errorf("set_create with %s params: rc %s, %q, handle %d; want ERR_INVALID naming %q", tc.name, codeName(rc), msg, h, tc.want)
		}
	}
}

// TestActivationCodes: the header's activation codes are moe.Activation's
// values, as it says.
func TestActivationCodes(t *testing.T) {
	for _, c := range []struct {
		code int
		act  moe.Activation
	}{{actSiluGated, moe.SiluGated}, {actRelu2, moe.Relu2}, {actSwigluOAI, moe.SwigluOAI},
		{actGeluTanhGated, moe.GeluTanhGated}, {actGeluGated, moe.GeluGated}} {
		if c.code != int(c.act) {
			t.Errorf("%v: code %d, want %d", c.act, c.code, int(c.act))
		}
	}
}
