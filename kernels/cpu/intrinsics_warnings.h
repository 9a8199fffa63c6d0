// Included by the vector-kernel sources, never by a header (the pragmas hold to the end of the
// including file): GCC 12 reports the deliberately undefined pass-through operands of its own
// intrinsics (_mm512_undefined_* in _mm512_cvtepi32_ps, _mm512_inserti64x4; the AVX2 casts
// and broadcasts) as uninitialized, in every file that uses them.
#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
