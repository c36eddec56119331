package cuda

// The constants of csrc/expertd_cuda.h, the library's C ABI. abi_test.go
// parses the header and checks that every #define there has this value, so
// the two cannot drift apart silently.
const (
	abiVersion = 3

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

	actSiluGated = 1
	actRelu2     = 2

	scoringSoftmax = 1
	scoringSigmoid = 2

	gemmAuto        = 0
	gemmPortable    = 1
	gemmPortableF16 = 2
	gemmSM90        = 3

	pM            = 0
	pHiddenDType  = 1
	pNHiddenScale = 2
	pLogitsDType  = 3
	pOutDType     = 4
	pTopK         = 5
	pRenormalize  = 6
	pScoring      = 7
	pNumGroups    = 8
	pTopKGroups   = 9
	pGEMM         = 10
	pUseGraph     = 11
	numIParams    = 12

	fScalingFactor = 0
	numFParams     = 1

	maxExperts = 1024
	maxTopK    = 32
	maxStreams = 16

	ipcHandleBytes = 64
)

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
