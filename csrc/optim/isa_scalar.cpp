// Scalar kernels: the fallback for x86-64 CPUs without AVX2 (and the reference
// the SIMD tails share, see [Note: bit-exact tails]).
#include "optim/kernel_body.h"

LUWU_DEFINE_ISA(scalar, VScalar)
