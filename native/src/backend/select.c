/*
 * select.c — the backends this build has, by name (backend/backend.h).
 */
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"

#ifndef COLIBRI_HAVE_CUDA
const cb_backend *cb_backend_cuda(void) { return NULL; }
#endif

const cb_backend *cb_backend_find(const char *name, char *err, size_t err_len) {
    if (strcmp(name, "cpu") == 0) return &cb_backend_cpu;
    if (strcmp(name, "cuda") == 0) {
        const cb_backend *b = cb_backend_cuda();
        if (!b)
            cb_set_err(err, err_len, "this build of Colibri has no CUDA backend: build it with -DCOLIBRI_CUDA=ON "
                       "(nvcc and the CUDA runtime, CUDA 12 or 13; docs/backends.md), or use the cpu backend");
        return b;
    }
    cb_set_err(err, err_len, "unknown backend '%s'; this build has: cpu%s", name, cb_backend_cuda() ? ", cuda" : "");
    return NULL;
}
