import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    DATA_TYPE_FLOAT32: _ClassVar[DataType]
    DATA_TYPE_BFLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT16: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E4M3FN: _ClassVar[DataType]
    DATA_TYPE_FLOAT8_E5M2: _ClassVar[DataType]
    DATA_TYPE_INT32: _ClassVar[DataType]

class Activation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVATION_UNSPECIFIED: _ClassVar[Activation]
    ACTIVATION_SILU_GATED: _ClassVar[Activation]
    ACTIVATION_RELU2: _ClassVar[Activation]
    ACTIVATION_SWIGLU_OAI: _ClassVar[Activation]
    ACTIVATION_GELU_TANH_GATED: _ClassVar[Activation]
    ACTIVATION_GELU_GATED: _ClassVar[Activation]

class Scoring(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORING_UNSPECIFIED: _ClassVar[Scoring]
    SCORING_SOFTMAX: _ClassVar[Scoring]
    SCORING_SIGMOID: _ClassVar[Scoring]

class NamingPreset(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NAMING_PRESET_UNSPECIFIED: _ClassVar[NamingPreset]
    NAMING_PRESET_NEMOTRON_H: _ClassVar[NamingPreset]
    NAMING_PRESET_QWEN3_MOE: _ClassVar[NamingPreset]
    NAMING_PRESET_CUSTOM: _ClassVar[NamingPreset]
    NAMING_PRESET_DEEPSEEK_V3: _ClassVar[NamingPreset]
    NAMING_PRESET_MIXTRAL: _ClassVar[NamingPreset]
    NAMING_PRESET_AUTO: _ClassVar[NamingPreset]
    NAMING_PRESET_GPT_OSS: _ClassVar[NamingPreset]

class WeightQuantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_QUANTIZATION_UNSPECIFIED: _ClassVar[WeightQuantization]
    WEIGHT_QUANTIZATION_PER_TENSOR: _ClassVar[WeightQuantization]
    WEIGHT_QUANTIZATION_PER_CHANNEL: _ClassVar[WeightQuantization]
    WEIGHT_QUANTIZATION_BLOCK: _ClassVar[WeightQuantization]

class SharedMemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARED_MEMORY_KIND_UNSPECIFIED: _ClassVar[SharedMemoryKind]
    SHARED_MEMORY_KIND_POSIX: _ClassVar[SharedMemoryKind]
    SHARED_MEMORY_KIND_CUDA_IPC: _ClassVar[SharedMemoryKind]
DATA_TYPE_UNSPECIFIED: DataType
DATA_TYPE_FLOAT32: DataType
DATA_TYPE_BFLOAT16: DataType
DATA_TYPE_FLOAT16: DataType
DATA_TYPE_FLOAT8_E4M3FN: DataType
DATA_TYPE_FLOAT8_E5M2: DataType
DATA_TYPE_INT32: DataType
ACTIVATION_UNSPECIFIED: Activation
ACTIVATION_SILU_GATED: Activation
ACTIVATION_RELU2: Activation
ACTIVATION_SWIGLU_OAI: Activation
ACTIVATION_GELU_TANH_GATED: Activation
ACTIVATION_GELU_GATED: Activation
SCORING_UNSPECIFIED: Scoring
SCORING_SOFTMAX: Scoring
SCORING_SIGMOID: Scoring
NAMING_PRESET_UNSPECIFIED: NamingPreset
NAMING_PRESET_NEMOTRON_H: NamingPreset
NAMING_PRESET_QWEN3_MOE: NamingPreset
NAMING_PRESET_CUSTOM: NamingPreset
NAMING_PRESET_DEEPSEEK_V3: NamingPreset
NAMING_PRESET_MIXTRAL: NamingPreset
NAMING_PRESET_AUTO: NamingPreset
NAMING_PRESET_GPT_OSS: NamingPreset
WEIGHT_QUANTIZATION_UNSPECIFIED: WeightQuantization
WEIGHT_QUANTIZATION_PER_TENSOR: WeightQuantization
WEIGHT_QUANTIZATION_PER_CHANNEL: WeightQuantization
WEIGHT_QUANTIZATION_BLOCK: WeightQuantization
SHARED_MEMORY_KIND_UNSPECIFIED: SharedMemoryKind
SHARED_MEMORY_KIND_POSIX: SharedMemoryKind
SHARED_MEMORY_KIND_CUDA_IPC: SharedMemoryKind

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shm")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shm: SharedMemoryRef
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class SharedMemoryRef(_message.Message):
    __slots__ = ("region_name", "offset", "byte_size")
    REGION_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region_name: str
    offset: int
    byte_size: int
    def __init__(self, region_name: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class ExpertWeights(_message.Message):
    __slots__ = ("activation", "w13", "w2", "w13_scale", "w2_scale", "a13_scale", "a2_scale", "weight_block_shape", "w13_bias", "w2_bias", "swiglu_limit", "swiglu_alpha")
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    W13_FIELD_NUMBER: _ClassVar[int]
    W2_FIELD_NUMBER: _ClassVar[int]
    W13_SCALE_FIELD_NUMBER: _ClassVar[int]
    W2_SCALE_FIELD_NUMBER: _ClassVar[int]
    A13_SCALE_FIELD_NUMBER: _ClassVar[int]
    A2_SCALE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    W13_BIAS_FIELD_NUMBER: _ClassVar[int]
    W2_BIAS_FIELD_NUMBER: _ClassVar[int]
    SWIGLU_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SWIGLU_ALPHA_FIELD_NUMBER: _ClassVar[int]
    activation: Activation
    w13: Tensor
    w2: Tensor
    w13_scale: Tensor
    w2_scale: Tensor
    a13_scale: Tensor
    a2_scale: Tensor
    weight_block_shape: _containers.RepeatedScalarFieldContainer[int]
    w13_bias: Tensor
    w2_bias: Tensor
    swiglu_limit: float
    swiglu_alpha: float
    def __init__(self, activation: _Optional[_Union[Activation, str]] = ..., w13: _Optional[_Union[Tensor, _Mapping]] = ..., w2: _Optional[_Union[Tensor, _Mapping]] = ..., w13_scale: _Optional[_Union[Tensor, _Mapping]] = ..., w2_scale: _Optional[_Union[Tensor, _Mapping]] = ..., a13_scale: _Optional[_Union[Tensor, _Mapping]] = ..., a2_scale: _Optional[_Union[Tensor, _Mapping]] = ..., weight_block_shape: _Optional[_Iterable[int]] = ..., w13_bias: _Optional[_Union[Tensor, _Mapping]] = ..., w2_bias: _Optional[_Union[Tensor, _Mapping]] = ..., swiglu_limit: _Optional[float] = ..., swiglu_alpha: _Optional[float] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("top_k", "renormalize", "scoring", "correction_bias", "num_expert_groups", "topk_groups", "routed_scaling_factor")
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RENORMALIZE_FIELD_NUMBER: _ClassVar[int]
    SCORING_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_BIAS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_GROUPS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_SCALING_FACTOR_FIELD_NUMBER: _ClassVar[int]
    top_k: int
    renormalize: bool
    scoring: Scoring
    correction_bias: Tensor
    num_expert_groups: int
    topk_groups: int
    routed_scaling_factor: float
    def __init__(self, top_k: _Optional[int] = ..., renormalize: _Optional[bool] = ..., scoring: _Optional[_Union[Scoring, str]] = ..., correction_bias: _Optional[_Union[Tensor, _Mapping]] = ..., num_expert_groups: _Optional[int] = ..., topk_groups: _Optional[int] = ..., routed_scaling_factor: _Optional[float] = ...) -> None: ...

class FusedMoERequest(_message.Message):
    __slots__ = ("expert_set", "weights", "hidden_states", "hidden_states_scale", "router_logits", "routing", "topk_ids", "topk_weights", "output_dtype", "return_routing", "output_shm")
    EXPERT_SET_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_SCALE_FIELD_NUMBER: _ClassVar[int]
    ROUTER_LOGITS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_SHM_FIELD_NUMBER: _ClassVar[int]
    expert_set: str
    weights: ExpertWeights
    hidden_states: Tensor
    hidden_states_scale: Tensor
    router_logits: Tensor
    routing: Routing
    topk_ids: Tensor
    topk_weights: Tensor
    output_dtype: DataType
    return_routing: bool
    output_shm: SharedMemoryRef
    def __init__(self, expert_set: _Optional[str] = ..., weights: _Optional[_Union[ExpertWeights, _Mapping]] = ..., hidden_states: _Optional[_Union[Tensor, _Mapping]] = ..., hidden_states_scale: _Optional[_Union[Tensor, _Mapping]] = ..., router_logits: _Optional[_Union[Tensor, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ..., output_dtype: _Optional[_Union[DataType, str]] = ..., return_routing: _Optional[bool] = ..., output_shm: _Optional[_Union[SharedMemoryRef, _Mapping]] = ...) -> None: ...

class FusedMoEResponse(_message.Message):
    __slots__ = ("output", "topk_ids", "topk_weights", "timings", "backend")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TOPK_IDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    topk_ids: Tensor
    topk_weights: Tensor
    timings: Timings
    backend: str
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., topk_ids: _Optional[_Union[Tensor, _Mapping]] = ..., topk_weights: _Optional[_Union[Tensor, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., backend: _Optional[str] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("decode_nanos", "queue_nanos", "h2d_nanos", "kernel_nanos", "d2h_nanos", "total_nanos", "receive_nanos")
    DECODE_NANOS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NANOS_FIELD_NUMBER: _ClassVar[int]
    H2D_NANOS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NANOS_FIELD_NUMBER: _ClassVar[int]
    D2H_NANOS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NANOS_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_NANOS_FIELD_NUMBER: _ClassVar[int]
    decode_nanos: int
    queue_nanos: int
    h2d_nanos: int
    kernel_nanos: int
    d2h_nanos: int
    total_nanos: int
    receive_nanos: int
    def __init__(self, decode_nanos: _Optional[int] = ..., queue_nanos: _Optional[int] = ..., h2d_nanos: _Optional[int] = ..., kernel_nanos: _Optional[int] = ..., d2h_nanos: _Optional[int] = ..., total_nanos: _Optional[int] = ..., receive_nanos: _Optional[int] = ...) -> None: ...

class LoadExpertsRequest(_message.Message):
    __slots__ = ("header", "chunk", "safetensors")
    class Header(_message.Message):
        __slots__ = ("name", "weights", "total_bytes", "sha256", "overwrite")
        NAME_FIELD_NUMBER: _ClassVar[int]
        WEIGHTS_FIELD_NUMBER: _ClassVar[int]
        TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        OVERWRITE_FIELD_NUMBER: _ClassVar[int]
        name: str
        weights: ExpertWeights
        total_bytes: int
        sha256: str
        overwrite: bool
        def __init__(self, name: _Optional[str] = ..., weights: _Optional[_Union[ExpertWeights, _Mapping]] = ..., total_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., overwrite: _Optional[bool] = ...) -> None: ...
    class Chunk(_message.Message):
        __slots__ = ("tensor", "offset", "data")
        TENSOR_FIELD_NUMBER: _ClassVar[int]
        OFFSET_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        tensor: str
        offset: int
        data: bytes
        def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
    class SafetensorsSource(_message.Message):
        __slots__ = ("name", "path", "layer", "preset", "w13_template", "w2_template", "w13_scale_template", "w2_scale_template", "activation", "num_experts", "overwrite", "weight_block_shape", "tensor_prefix", "gate_template", "up_template", "gate_scale_template", "up_scale_template", "w13_input_scale_template", "w2_input_scale_template", "weight_quantization", "swiglu_limit", "swiglu_alpha")
        NAME_FIELD_NUMBER: _ClassVar[int]
        PATH_FIELD_NUMBER: _ClassVar[int]
        LAYER_FIELD_NUMBER: _ClassVar[int]
        PRESET_FIELD_NUMBER: _ClassVar[int]
        W13_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        W2_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        W13_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        W2_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        ACTIVATION_FIELD_NUMBER: _ClassVar[int]
        NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
        OVERWRITE_FIELD_NUMBER: _ClassVar[int]
        WEIGHT_BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
        TENSOR_PREFIX_FIELD_NUMBER: _ClassVar[int]
        GATE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        UP_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        GATE_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        UP_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        W13_INPUT_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        W2_INPUT_SCALE_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
        WEIGHT_QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
        SWIGLU_LIMIT_FIELD_NUMBER: _ClassVar[int]
        SWIGLU_ALPHA_FIELD_NUMBER: _ClassVar[int]
        name: str
        path: str
        layer: int
        preset: NamingPreset
        w13_template: str
        w2_template: str
        w13_scale_template: str
        w2_scale_template: str
        activation: Activation
        num_experts: int
        overwrite: bool
        weight_block_shape: _containers.RepeatedScalarFieldContainer[int]
        tensor_prefix: str
        gate_template: str
        up_template: str
        gate_scale_template: str
        up_scale_template: str
        w13_input_scale_template: str
        w2_input_scale_template: str
        weight_quantization: WeightQuantization
        swiglu_limit: float
        swiglu_alpha: float
        def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., layer: _Optional[int] = ..., preset: _Optional[_Union[NamingPreset, str]] = ..., w13_template: _Optional[str] = ..., w2_template: _Optional[str] = ..., w13_scale_template: _Optional[str] = ..., w2_scale_template: _Optional[str] = ..., activation: _Optional[_Union[Activation, str]] = ..., num_experts: _Optional[int] = ..., overwrite: _Optional[bool] = ..., weight_block_shape: _Optional[_Iterable[int]] = ..., tensor_prefix: _Optional[str] = ..., gate_template: _Optional[str] = ..., up_template: _Optional[str] = ..., gate_scale_template: _Optional[str] = ..., up_scale_template: _Optional[str] = ..., w13_input_scale_template: _Optional[str] = ..., w2_input_scale_template: _Optional[str] = ..., weight_quantization: _Optional[_Union[WeightQuantization, str]] = ..., swiglu_limit: _Optional[float] = ..., swiglu_alpha: _Optional[float] = ...) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    header: LoadExpertsRequest.Header
    chunk: LoadExpertsRequest.Chunk
    safetensors: LoadExpertsRequest.SafetensorsSource
    def __init__(self, header: _Optional[_Union[LoadExpertsRequest.Header, _Mapping]] = ..., chunk: _Optional[_Union[LoadExpertsRequest.Chunk, _Mapping]] = ..., safetensors: _Optional[_Union[LoadExpertsRequest.SafetensorsSource, _Mapping]] = ...) -> None: ...

class ExpertSetInfo(_message.Message):
    __slots__ = ("name", "activation", "num_experts", "hidden_size", "intermediate_size", "top_k_hint", "w13_scale_granularity", "w2_scale_granularity", "weight_block_shape", "static_a13_scale", "static_a2_scale", "bytes", "fingerprint", "backend", "loaded_at", "routing")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_HINT_FIELD_NUMBER: _ClassVar[int]
    W13_SCALE_GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    W2_SCALE_GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    STATIC_A13_SCALE_FIELD_NUMBER: _ClassVar[int]
    STATIC_A2_SCALE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    name: str
    activation: Activation
    num_experts: int
    hidden_size: int
    intermediate_size: int
    top_k_hint: int
    w13_scale_granularity: str
    w2_scale_granularity: str
    weight_block_shape: _containers.RepeatedScalarFieldContainer[int]
    static_a13_scale: bool
    static_a2_scale: bool
    bytes: int
    fingerprint: str
    backend: str
    loaded_at: _timestamp_pb2.Timestamp
    routing: Routing
    def __init__(self, name: _Optional[str] = ..., activation: _Optional[_Union[Activation, str]] = ..., num_experts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., top_k_hint: _Optional[int] = ..., w13_scale_granularity: _Optional[str] = ..., w2_scale_granularity: _Optional[str] = ..., weight_block_shape: _Optional[_Iterable[int]] = ..., static_a13_scale: _Optional[bool] = ..., static_a2_scale: _Optional[bool] = ..., bytes: _Optional[int] = ..., fingerprint: _Optional[str] = ..., backend: _Optional[str] = ..., loaded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ...) -> None: ...

class ListExpertsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListExpertsResponse(_message.Message):
    __slots__ = ("expert_sets",)
    EXPERT_SETS_FIELD_NUMBER: _ClassVar[int]
    expert_sets: _containers.RepeatedCompositeFieldContainer[ExpertSetInfo]
    def __init__(self, expert_sets: _Optional[_Iterable[_Union[ExpertSetInfo, _Mapping]]] = ...) -> None: ...

class UnloadExpertsRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadExpertsResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "backends", "devices", "limits", "transport", "settings", "ring", "lane")
    class BackendInfo(_message.Message):
        __slots__ = ("name", "activations", "granularities", "devices", "max_tokens", "details")
        class DetailsEntry(_message.Message):
            __slots__ = ("key", "value")
            KEY_FIELD_NUMBER: _ClassVar[int]
            VALUE_FIELD_NUMBER: _ClassVar[int]
            key: str
            value: str
            def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
        NAME_FIELD_NUMBER: _ClassVar[int]
        ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
        GRANULARITIES_FIELD_NUMBER: _ClassVar[int]
        DEVICES_FIELD_NUMBER: _ClassVar[int]
        MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
        DETAILS_FIELD_NUMBER: _ClassVar[int]
        name: str
        activations: _containers.RepeatedScalarFieldContainer[Activation]
        granularities: _containers.RepeatedScalarFieldContainer[str]
        devices: _containers.RepeatedScalarFieldContainer[str]
        max_tokens: int
        details: _containers.ScalarMap[str, str]
        def __init__(self, name: _Optional[str] = ..., activations: _Optional[_Iterable[_Union[Activation, str]]] = ..., granularities: _Optional[_Iterable[str]] = ..., devices: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...
    class Limits(_message.Message):
        __slots__ = ("max_message_bytes", "max_tokens", "max_loaded_bytes", "max_concurrent", "max_shm_regions", "max_shm_bytes", "max_queued", "batch_window_nanos", "batch_max_tokens")
        MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
        MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
        MAX_LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
        MAX_CONCURRENT_FIELD_NUMBER: _ClassVar[int]
        MAX_SHM_REGIONS_FIELD_NUMBER: _ClassVar[int]
        MAX_SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
        MAX_QUEUED_FIELD_NUMBER: _ClassVar[int]
        BATCH_WINDOW_NANOS_FIELD_NUMBER: _ClassVar[int]
        BATCH_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
        max_message_bytes: int
        max_tokens: int
        max_loaded_bytes: int
        max_concurrent: int
        max_shm_regions: int
        max_shm_bytes: int
        max_queued: int
        batch_window_nanos: int
        batch_max_tokens: int
        def __init__(self, max_message_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ..., max_loaded_bytes: _Optional[int] = ..., max_concurrent: _Optional[int] = ..., max_shm_regions: _Optional[int] = ..., max_shm_bytes: _Optional[int] = ..., max_queued: _Optional[int] = ..., batch_window_nanos: _Optional[int] = ..., batch_max_tokens: _Optional[int] = ...) -> None: ...
    class Transport(_message.Message):
        __slots__ = ("stream_workers", "keepalive_min_time_nanos", "keepalive_time_nanos", "keepalive_timeout_nanos", "max_connection_age_nanos", "max_connection_age_grace_nanos")
        STREAM_WORKERS_FIELD_NUMBER: _ClassVar[int]
        KEEPALIVE_MIN_TIME_NANOS_FIELD_NUMBER: _ClassVar[int]
        KEEPALIVE_TIME_NANOS_FIELD_NUMBER: _ClassVar[int]
        KEEPALIVE_TIMEOUT_NANOS_FIELD_NUMBER: _ClassVar[int]
        MAX_CONNECTION_AGE_NANOS_FIELD_NUMBER: _ClassVar[int]
        MAX_CONNECTION_AGE_GRACE_NANOS_FIELD_NUMBER: _ClassVar[int]
        stream_workers: int
        keepalive_min_time_nanos: int
        keepalive_time_nanos: int
        keepalive_timeout_nanos: int
        max_connection_age_nanos: int
        max_connection_age_grace_nanos: int
        def __init__(self, stream_workers: _Optional[int] = ..., keepalive_min_time_nanos: _Optional[int] = ..., keepalive_time_nanos: _Optional[int] = ..., keepalive_timeout_nanos: _Optional[int] = ..., max_connection_age_nanos: _Optional[int] = ..., max_connection_age_grace_nanos: _Optional[int] = ...) -> None: ...
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LaneInfo(_message.Message):
        __slots__ = ("enabled", "max_lanes", "max_depth")
        ENABLED_FIELD_NUMBER: _ClassVar[int]
        MAX_LANES_FIELD_NUMBER: _ClassVar[int]
        MAX_DEPTH_FIELD_NUMBER: _ClassVar[int]
        enabled: bool
        max_lanes: int
        max_depth: int
        def __init__(self, enabled: _Optional[bool] = ..., max_lanes: _Optional[int] = ..., max_depth: _Optional[int] = ...) -> None: ...
    class RingInfo(_message.Message):
        __slots__ = ("enabled", "version", "spin_nanos", "max_per_conn", "max_rings", "max_slot_bytes")
        ENABLED_FIELD_NUMBER: _ClassVar[int]
        VERSION_FIELD_NUMBER: _ClassVar[int]
        SPIN_NANOS_FIELD_NUMBER: _ClassVar[int]
        MAX_PER_CONN_FIELD_NUMBER: _ClassVar[int]
        MAX_RINGS_FIELD_NUMBER: _ClassVar[int]
        MAX_SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
        enabled: bool
        version: int
        spin_nanos: int
        max_per_conn: int
        max_rings: int
        max_slot_bytes: int
        def __init__(self, enabled: _Optional[bool] = ..., version: _Optional[int] = ..., spin_nanos: _Optional[int] = ..., max_per_conn: _Optional[int] = ..., max_rings: _Optional[int] = ..., max_slot_bytes: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    version: str
    backends: _containers.RepeatedCompositeFieldContainer[ServerInfo.BackendInfo]
    devices: _containers.RepeatedScalarFieldContainer[str]
    limits: ServerInfo.Limits
    transport: ServerInfo.Transport
    settings: _containers.ScalarMap[str, str]
    ring: ServerInfo.RingInfo
    lane: ServerInfo.LaneInfo
    def __init__(self, version: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[ServerInfo.BackendInfo, _Mapping]]] = ..., devices: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[ServerInfo.Limits, _Mapping]] = ..., transport: _Optional[_Union[ServerInfo.Transport, _Mapping]] = ..., settings: _Optional[_Mapping[str, str]] = ..., ring: _Optional[_Union[ServerInfo.RingInfo, _Mapping]] = ..., lane: _Optional[_Union[ServerInfo.LaneInfo, _Mapping]] = ...) -> None: ...

class RegisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name", "kind", "key", "offset", "byte_size", "cuda_ipc_handle")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: SharedMemoryKind
    key: str
    offset: int
    byte_size: int
    cuda_ipc_handle: bytes
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[SharedMemoryKind, str]] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ...) -> None: ...

class RegisterSharedMemoryResponse(_message.Message):
    __slots__ = ("region",)
    REGION_FIELD_NUMBER: _ClassVar[int]
    region: SharedMemoryRegion
    def __init__(self, region: _Optional[_Union[SharedMemoryRegion, _Mapping]] = ...) -> None: ...

class SharedMemoryRegion(_message.Message):
    __slots__ = ("name", "kind", "key", "offset", "byte_size", "calls_in_flight", "registered_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CALLS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: SharedMemoryKind
    key: str
    offset: int
    byte_size: int
    calls_in_flight: int
    registered_at: _timestamp_pb2.Timestamp
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[_Union[SharedMemoryKind, str]] = ..., key: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ..., calls_in_flight: _Optional[int] = ..., registered_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class UnregisterSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterSharedMemoryResponse(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSharedMemoryRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListSharedMemoryResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[SharedMemoryRegion]
    def __init__(self, regions: _Optional[_Iterable[_Union[SharedMemoryRegion, _Mapping]]] = ...) -> None: ...

class AttachRingRequest(_message.Message):
    __slots__ = ("region_name", "offset", "slot_count", "slot_size")
    REGION_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SLOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    region_name: str
    offset: int
    slot_count: int
    slot_size: int
    def __init__(self, region_name: _Optional[str] = ..., offset: _Optional[int] = ..., slot_count: _Optional[int] = ..., slot_size: _Optional[int] = ...) -> None: ...

class AttachRingResponse(_message.Message):
    __slots__ = ("version", "spin_nanos")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPIN_NANOS_FIELD_NUMBER: _ClassVar[int]
    version: int
    spin_nanos: int
    def __init__(self, version: _Optional[int] = ..., spin_nanos: _Optional[int] = ...) -> None: ...

class OpenLaneRequest(_message.Message):
    __slots__ = ("call", "depth")
    CALL_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    call: FusedMoERequest
    depth: int
    def __init__(self, call: _Optional[_Union[FusedMoERequest, _Mapping]] = ..., depth: _Optional[int] = ...) -> None: ...

class OpenLaneResponse(_message.Message):
    __slots__ = ("flags_cuda_ipc_handle", "flags_byte_size", "doorbell_offset", "done_offset", "depth", "mps", "skips_on_close")
    FLAGS_CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    FLAGS_BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DONE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    MPS_FIELD_NUMBER: _ClassVar[int]
    SKIPS_ON_CLOSE_FIELD_NUMBER: _ClassVar[int]
    flags_cuda_ipc_handle: bytes
    flags_byte_size: int
    doorbell_offset: int
    done_offset: int
    depth: int
    mps: bool
    skips_on_close: bool
    def __init__(self, flags_cuda_ipc_handle: _Optional[bytes] = ..., flags_byte_size: _Optional[int] = ..., doorbell_offset: _Optional[int] = ..., done_offset: _Optional[int] = ..., depth: _Optional[int] = ..., mps: _Optional[bool] = ..., skips_on_close: _Optional[bool] = ...) -> None: ...
