/*
 * crc32.c — CRC-32 as zlib.crc32 (IEEE, reflected polynomial 0xEDB88320), slice-by-8.
 * cb_crc32(0, p, n) equals Python's zlib.crc32(bytes); chaining cb_crc32(prev, ...) works
 * as zlib.crc32(bytes, prev).
 */
#include <pthread.h>

#include "format/container.h"

static uint32_t crc_tab[8][256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_init_tables(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
        crc_tab[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_tab[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_tab[0][c & 0xffu] ^ (c >> 8);
            crc_tab[t][i] = c;
        }
    }
}

uint32_t cb_crc32(uint32_t crc, const void *data, uint64_t n) {
    pthread_once(&crc_once, crc_init_tables);
    const uint8_t *p = (const uint8_t *)data;
    uint32_t c = ~crc;
    while (n >= 8) {
        /* little-endian host (the format refuses big-endian hosts) */
        uint32_t lo = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                      ((uint32_t)p[3] << 24);
        uint32_t hi = (uint32_t)p[4] | ((uint32_t)p[5] << 8) | ((uint32_t)p[6] << 16) |
                      ((uint32_t)p[7] << 24);
        lo ^= c;
        c = crc_tab[7][lo & 0xffu] ^ crc_tab[6][(lo >> 8) & 0xffu] ^
            crc_tab[5][(lo >> 16) & 0xffu] ^ crc_tab[4][lo >> 24] ^ crc_tab[3][hi & 0xffu] ^
            crc_tab[2][(hi >> 8) & 0xffu] ^ crc_tab[1][(hi >> 16) & 0xffu] ^ crc_tab[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_tab[0][(c ^ *p++) & 0xffu] ^ (c >> 8);
    return ~c;
}
