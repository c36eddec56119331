package cuda

// The constants of csrc/expertd_cuda.h, the library's C ABI. abi_test.go
// parses the header and checks that every #define there has this value, so
// the two cannot drift apart silently.
const (
	abiVersion = 5

	codeOK          = 0
	codeInvalid     = 1
	codeUnsupported = 2
	codeOOM         = 3
	codeCUDA        = 4
	codeNoDevice    = 5
	codeNotFound    = 6

	dtypeFloat32  = 1
	dtypeBFloat16 = 2
	dtypeFloat8   = 4

	actSiluGated     = 1
	actRelu2         = 2
	actSwigluOAI     = 3
	actGeluTanhGated = 4
	actGeluGated     = 5

	scoringSoftmax = 1
	scoringSigmoid = 2

	gemmAuto        = 0
	gemmPortable    = 1
	gemmPortableF16 = 2
	gemmSM90        = 3

	memUnknown  = 0
	memPageable = 1
	memPinned   = 2
	memDevice   = 3

	callBytes      = 208
	bufBytes       = 16
	optionsBytes   = 44
	setParamsBytes = 104
	maxSpinUS      = 10000

	maxExperts = 1024
	maxTopK    = 32
	maxStreams = 16

	ipcHandleBytes = 64

	maxLaneDepth   = 64
	laneFlagsBytes = 256
	laneDoorbell   = 0
	laneDone       = 128
	laneStop       = 2
	laneMPS        = 1
	laneSkips      = 2
)

// cBuf mirrors struct expertd_buf: one tensor of a call.
type cBuf struct {
	data  uintptr
	dtype int32
	mem   int32
}

// cCall mirrors struct expertd_call (abi_test.go checks the layout).
type cCall struct {
	size                uint32
	version             uint32
	m                   int32
	topK                int32
	renormalize         int32
	scoring             int32
	numGroups           int32
	topKGroups          int32
	gemm                int32
	useGraph            int32
	routedScalingFactor float32
	nHiddenScale        int32
	hidden              cBuf
	hiddenScale         cBuf
	logits              cBuf
	correctionBias      cBuf
	topKIDsIn           cBuf
	topKWeightsIn       cBuf
	out                 cBuf
	topKIDsOut          cBuf
	topKWeightsOut      cBuf
	kernelMS            uintptr
	stream              uint64
}

// cOptions mirrors struct expertd_options (abi_test.go checks the layout).
type cOptions struct {
	size           uint32
	version        uint32
	streams        int32
	pdl            int32
	sm90Block      int32
	sm90Persistent int32
	sm90TokA       int32
	poison         int32
	hostTrace      int32
	syncSpinUS     int32
	sm90Pair       int32
}

// cSetParams mirrors struct expertd_set_params (abi_test.go checks the
// layout). The pointers are addresses of Go memory, which the library
// reads during expertd_set_create only.
type cSetParams struct {
	size        uint32
	version     uint32
	numExperts  int32
	hidden      int32
	inter       int32
	activation  int32
	nW13Scale   int32
	nW2Scale    int32
	blockN      int32
	blockK      int32
	a13Scale    float32
	a2Scale     float32
	swigluLimit float32
	swigluAlpha float32
	w13         uintptr
	w2          uintptr
	w13Scale    uintptr
	w2Scale     uintptr
	w13Bias     uintptr
	w2Bias      uintptr
}

// codeName is the header's name for a return code, for error messages.
func codeName(rc int32) string {
	switch rc {
	case codeOK:
		return "OK"
	case codeInvalid:
		return "ERR_INVALID"
	case codeUnsupported:
		return "ERR_UNSUPPORTED"
	case codeOOM:
		return "ERR_OOM"
	case codeCUDA:
		return "ERR_CUDA"
	case codeNoDevice:
		return "ERR_NO_DEVICE"
	case codeNotFound:
		return "ERR_NOT_FOUND"
	}
	return "ERR_UNKNOWN"
}
