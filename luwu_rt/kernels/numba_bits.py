"""float32 <-> bf16/fp16 rounding as Numba functions, for Numba code beyond the optimizer kernels (the
gradient codecs of ``luwu_rt.compress``): the optimizer kernels' own functions, one copy of each.

``f32_to_half_bits(x, kind)`` rounds to nearest even (torch's ``.to(dtype)`` bit for bit) and returns
the uint16 bits; ``half_bits_to_f32(bits, kind)`` widens them back. ``kind`` is ``KIND_BF16`` or
``KIND_F16``; pass it as a constant so that the branch on it folds away in compiled code.
"""

from luwu_rt.kernels._numba_common import KIND_BF16, KIND_F16, f32_to_half_bits, half_bits_to_f32

__all__ = ["KIND_BF16", "KIND_F16", "f32_to_half_bits", "half_bits_to_f32"]
