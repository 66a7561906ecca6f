/*
 * dtype.h — the element types of the engine, as data: one table (dtype.c) says for each
 * colibri_dtype (colibri.h: one name space for the types of file tensors and of the arrays
 * handed to callers) its name, its size in bytes and whether a .colibri file may store a
 * tensor of it. Code asks the table instead of testing types one by one, so that a new
 * type (a quantized block format, say) is a new row here and kernels that consume it.
 */
#ifndef COLIBRI_CORE_DTYPE_H
#define COLIBRI_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "colibri.h"

/* Bytes per element of a dtype; 0 for an unknown dtype. */
size_t cb_dtype_size(uint32_t dt);
/* Its name ("f32", "f16", "bf16", "int8", "i32", "i64", "u64"); "unknown" otherwise. */
const char *cb_dtype_name(uint32_t dt);
/* 1 when a tensor of a .colibri file may have this dtype (docs/format.md, "Tensor
 * directory section"): f32, f16, bf16, int8. The array-only types are not file types. */
int cb_dtype_in_file(uint32_t dt);

/* IEEE binary16 <-> binary32 in software (subnormals, inf and nan handled;
 * f32 -> f16 rounds to nearest, ties to even). */
float cb_f16_to_f32(uint16_t h);
uint16_t cb_f32_to_f16(float f);
/* bfloat16 <-> binary32: bf16 is the upper half; f32 -> bf16 rounds to nearest even
 * (nan stays nan). */
float cb_bf16_to_f32(uint16_t h);
uint16_t cb_f32_to_bf16(float f);

#endif
