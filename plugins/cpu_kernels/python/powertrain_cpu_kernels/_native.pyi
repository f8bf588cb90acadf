"""Type stubs of the Rust extension (src/python.rs). Addresses are ``tensor.data_ptr()``;
the caller checks every dtype, shape and contiguity (the extension cannot)."""

def q4_linear(x: int, codes: int, scales: int, offsets: int, out: int, m: int, n: int, k: int) -> None: ...
def q8_linear(x: int, codes: int, scales: int, offsets: int, out: int, m: int, n: int, k: int, group: int) -> None: ...
def q4_dequantize(codes: int, scales: int, offsets: int, out: int, n: int, k: int) -> None: ...
def q8_dequantize(codes: int, scales: int, offsets: int, out: int, n: int, k: int, group: int) -> None: ...
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
    parallel: bool,
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
) -> None: ...
def kernel_path() -> str: ...
def best_kernel_path() -> str: ...
def force_scalar(on: bool) -> None: ...
def set_threads(threads: int) -> None: ...
def threads() -> int: ...
