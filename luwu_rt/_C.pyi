"""Type stub for the native module luwu_rt._C (csrc/bindings.cpp)."""

# ---- IO engine (csrc/io/) ----

# ---- optimizer kernels (csrc/optim/) ----

# ---- checksums (csrc/store/) ----
def crc32c(data: object, value: int = 0) -> int:
    """CRC-32C of a C-contiguous buffer, continuing from ``value``. Releases the GIL."""
