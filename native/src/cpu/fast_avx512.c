/* placeholder, replaced below */
#include "cpu/fast.h"
const cb_fast_kernels *cb_fast_avx512vnni(void) { return NULL; }
const cb_fast_kernels *cb_fast_avxvnni(void) { return NULL; }
const cb_fast_kernels *cb_fast_avx2(void) { return NULL; }
