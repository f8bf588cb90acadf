"""The public contract: the records and Protocols the hot path and plugins share.

Assembly (``powertrain.assemble``) turns component records into objects satisfying these
Protocols; after that, the engine, model runner and layers call them directly, with no
pluggy dispatch in between (DESIGN §2). A kernel pack, a scheduler, a speculative
policy or a protocol adapter implements these and imports nothing else of the core's
implementation. One module per concern:

* ``attention``: the KV cache a backend declares, the attention metadata, attention
  backends and the small kernels they may fuse (rotary, RMSNorm);
* ``moe``: the experts a rank holds, routing configs, MoE backends and routers;
* ``communication``: communicators and expert-parallel dispatchers;
* ``kv_store``: stores that keep cache blocks below the device cache;
* ``scheduling``: what a scheduler is given, sees and returns;
* ``speculative``: what the engine and a speculative policy exchange;
* ``sampling``: a request's sampling settings and the distribution they define;
* ``outputs``: what the engine reports back for a request;
* ``protocol``: protocol adapters and the parsed request they hand the server;
* ``images``: the decoded images the server hands an engine that reads them;
* ``quantized``: weights kept as integer codes, and the kernels that multiply by them;
* ``model``: what an architecture's factory is given, and the decoder it builds;
* ``engine``: the engine the front ends (``LLM``, ``AsyncEngine``, the server) drive;
* ``platform``, ``errors``: the platform records and the typed errors.

Contracts are the bottom layer: these modules import only each other and
``powertrain.components`` (the platform records), never the engine, layers or loader.
"""

from powertrain.interfaces.attention import (
    AttentionBackend,
    AttentionBackendContext,
    AttentionLayerSpec,
    AttentionMetadata,
    CacheGroupSpec,
    DecoderLayerParts,
    DecoderStackKernel,
    FusedDecoder,
    KVCacheSpec,
    KVLayout,
    KVStoreAttentionBackend,
    KVTensorSpec,
    LayerKVCache,
    LightningIndexerBackend,
    MLAAttentionBackend,
    RMSNormKernel,
    RotaryAttentionBackend,
    SparseMLAAttentionBackend,
    V4AttentionBackend,
    allocate_caches,
    check_cache_sharing,
)
from powertrain.interfaces.communication import Communicator, CommunicatorContext, ExpertDispatcher
from powertrain.interfaces.engine import Engine, EngineStats, EngineTokenizer
from powertrain.interfaces.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from powertrain.interfaces.images import (
    ImageEncoder,
    ImageInput,
    ImageRows,
    accepts_images,
    expand_image_placeholders,
)
from powertrain.interfaces.kv_store import KVStore, KVStoreContext, StoredBlock, frame_block, unframe_block
from powertrain.interfaces.model import CausalLM, ModelContext
from powertrain.interfaces.moe import (
    ExpertWeights,
    MoEBackend,
    MoEBackendContext,
    MoERouter,
    RoutingConfig,
    dequantize_row_groups,
)
from powertrain.interfaces.outputs import CompletionOutput, RequestOutput
from powertrain.interfaces.platform import Availability, PlatformInfo
from powertrain.interfaces.protocol import (
    ImageFit,
    ImagePart,
    ModelTokenizer,
    ParsedRequest,
    ParserEvent,
    ProtocolAdapter,
    RequestSampling,
    ResponseFormat,
    ResponseWriter,
    StreamParser,
    StructuredOutputsField,
)
from powertrain.interfaces.quantized import (
    QUANT_FORMATS,
    QuantizedLinearContext,
    QuantizedLinearKernel,
    QuantizedWeight,
)
from powertrain.interfaces.sampling import (
    SamplingDefaults,
    SamplingParams,
    StructuredOutput,
    filtered_probs,
    race_noise,
    row_argmax,
    target_probs,
)
from powertrain.interfaces.scheduling import (
    BlockAllocator,
    PrefixMatch,
    ScheduledBatch,
    Scheduler,
    SchedulerContext,
    SchedulerLimits,
    SchedulerSequence,
    SequenceStatus,
)
from powertrain.interfaces.speculative import (
    TAP_FORMS,
    BlockDraftModel,
    DraftModelLoader,
    DraftSlot,
    ExecutedStep,
    ExpertRounds,
    HiddenTap,
    KVCacheAllocator,
    Proposal,
    SpeculativeContext,
    SpeculativePolicy,
    StepsPerSecondProbe,
    TapRecorder,
    VerifyBatch,
)

__all__ = [
    "TAP_FORMS",
    "HiddenTap",
    "TapRecorder",
    "BlockDraftModel",
    "DraftModelLoader",
    # attention
    "AttentionBackend",
    "AttentionBackendContext",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "CacheGroupSpec",
    "KVCacheSpec",
    "KVLayout",
    "KVTensorSpec",
    "LayerKVCache",
    "MLAAttentionBackend",
    "RMSNormKernel",
    "DecoderLayerParts",
    "DecoderStackKernel",
    "FusedDecoder",
    "KVStoreAttentionBackend",
    "RotaryAttentionBackend",
    "SparseMLAAttentionBackend",
    "V4AttentionBackend",
    "LightningIndexerBackend",
    "allocate_caches",
    "check_cache_sharing",
    # moe
    "ExpertWeights",
    "MoEBackend",
    "MoEBackendContext",
    "MoERouter",
    "RoutingConfig",
    "dequantize_row_groups",
    # communication
    "Communicator",
    "CommunicatorContext",
    "ExpertDispatcher",
    # kv_store
    "KVStore",
    "KVStoreContext",
    "StoredBlock",
    "frame_block",
    "unframe_block",
    # scheduling
    "BlockAllocator",
    "PrefixMatch",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerContext",
    "SchedulerLimits",
    "SchedulerSequence",
    "SequenceStatus",
    # speculative
    "DraftSlot",
    "ExecutedStep",
    "ExpertRounds",
    "KVCacheAllocator",
    "Proposal",
    "SpeculativeContext",
    "SpeculativePolicy",
    "StepsPerSecondProbe",
    "VerifyBatch",
    # sampling
    "SamplingDefaults",
    "SamplingParams",
    "StructuredOutput",
    "filtered_probs",
    "race_noise",
    "row_argmax",
    "target_probs",
    # images
    "ImageEncoder",
    "ImageInput",
    "ImageRows",
    "accepts_images",
    "expand_image_placeholders",
    # outputs
    "CompletionOutput",
    "RequestOutput",
    # protocol
    "ImageFit",
    "ImagePart",
    "ModelTokenizer",
    "ParsedRequest",
    "ParserEvent",
    "ProtocolAdapter",
    "RequestSampling",
    "ResponseFormat",
    "ResponseWriter",
    "StreamParser",
    "StructuredOutputsField",
    # quantized
    "QUANT_FORMATS",
    "QuantizedLinearContext",
    "QuantizedLinearKernel",
    "QuantizedWeight",
    # model
    "CausalLM",
    "ModelContext",
    # engine
    "Engine",
    "EngineStats",
    "EngineTokenizer",
    # platform, errors
    "Availability",
    "PlatformInfo",
    "EngineDeadError",
    "InvalidRequestError",
    "RequestFailedError",
]
