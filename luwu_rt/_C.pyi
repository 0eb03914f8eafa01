"""Type stub for the native module luwu_rt._C (csrc/bindings.cpp)."""

# ---- IO engine (csrc/io/) ----

# ---- optimizer kernels (csrc/optim/) ----
