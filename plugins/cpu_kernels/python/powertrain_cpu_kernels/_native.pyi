"""Type stubs of the Rust extension (src/python.rs). Addresses are ``tensor.data_ptr()``;
the caller checks every dtype, shape and contiguity (the extension cannot).
``openmp_threads``: run on an OpenMP team of that many threads of torch's runtime
(``threads.openmp_team``; 0 or 1: the package's pool, or the calling thread where a
``pool`` flag says no). ``half_scales``: the scales and offsets are float16, else float32."""

def q4_linear(
    x: int,
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    m: int,
    n: int,
    k: int,
    gemm_min_rows: int,
    int16_activations: bool,
    openmp_threads: int,
) -> None: ...
def q8_linear(
    x: int,
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    m: int,
    n: int,
    k: int,
    group: int,
    gemm_min_rows: int,
    int16_activations: bool,
    openmp_threads: int,
) -> None: ...
def q4_linear_amx(
    x: int,
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    m: int,
    n: int,
    k: int,
    openmp_threads: int,
) -> None: ...
def q8_linear_amx(
    x: int,
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    m: int,
    n: int,
    k: int,
    group: int,
    openmp_threads: int,
) -> None: ...
def amx() -> bool: ...
def q4_dequantize(
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    out_bf16: bool,
    n: int,
    k: int,
    openmp_threads: int,
) -> None: ...
def q8_dequantize(
    codes: int,
    scales: int,
    offsets: int,
    half_scales: bool,
    out: int,
    out_bf16: bool,
    n: int,
    k: int,
    group: int,
    openmp_threads: int,
) -> None: ...
def rms_norm(
    x: int, residual: int, weight: int, normed: int, sum: int, rows: int, hidden: int, eps: float, bf16: bool
) -> None: ...
def paged_attention(
    query: int,
    key_cache: int,
    value_cache: int,
    block_tables: int,
    query_start: int,
    seq_lens: int,
    rows: int,
    out: int,
    tokens: int,
    heads: int,
    kv_heads: int,
    dim: int,
    num_blocks: int,
    block_size: int,
    batch: int,
    max_blocks: int,
    num_rows: int,
    scale: float,
    window: int,
    pool: bool,
    openmp_threads: int,
    bf16: bool,
) -> None: ...
def rotary_store(
    query: int,
    key: int,
    value: int,
    cos: int,
    sin: int,
    slots: int,
    rotated: int,
    key_cache: int,
    value_cache: int,
    tokens: int,
    stored: int,
    heads: int,
    kv_heads: int,
    dim: int,
    half: int,
    num_slots: int,
    bf16: bool,
) -> None: ...
def decoder_stack(
    table: int,
    layers: int,
    x: int,
    out: int,
    residual: int,
    tokens: int,
    hidden: int,
    cos: int,
    sin: int,
    half: int,
    slots: int,
    block_tables: int,
    query_start: int,
    seq_lens: int,
    rows: int,
    batch: int,
    max_blocks: int,
    num_rows: int,
    num_blocks: int,
    block_size: int,
    attention_pool: bool,
    openmp_threads: int,
) -> None: ...
def decoder_layer_entries() -> int: ...
def kernel_path() -> str: ...
def best_kernel_path() -> str: ...
def force_scalar(on: bool) -> None: ...
def vnni() -> bool: ...
def force_no_vnni(on: bool) -> None: ...
def set_threads(threads: int) -> None: ...
def threads() -> int: ...
def set_openmp(address: int) -> None: ...
def openmp_available() -> bool: ...
