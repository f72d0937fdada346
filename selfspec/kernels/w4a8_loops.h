/* The one place that picks w4a8's loops for this build: quantize_row (a row's activations to int8),
 * tile_rows (w4a8) and tile_rows8 (w8a8). Each instruction set has its own file, as ggml-cpu's
 * arch/ folders, whose code compiles only where the build has those instructions (w4a8.h's
 * W4A8_* flags); the plain C file gives whatever none of them did. AMX is w4a8_amx.h. */
#ifndef SELFSPEC_W4A8_LOOPS_H
#define SELFSPEC_W4A8_LOOPS_H
#include "w4a8_avx512.h"
#include "w4a8_avx2.h"
#include "w4a8_generic.h"
#endif
