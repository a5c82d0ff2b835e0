/*
 * A stand-in for libgdrapi.so.2 that lets the RAII paths of ibgda-gdr run on a machine with no
 * GPU and no gdrdrv: "GPU addresses" are host addresses, pinning records them, mapping returns
 * the same address, copies are memcpy. Every call appends its name to a log the test reads.
 * Written for this project's tests from the prototypes of gdrapi.h; not GDRCopy code.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static char call_log[4096];
static int fail_open;

static void note(const char *what) {
    size_t n = strlen(call_log);
    if (n + strlen(what) + 2 < sizeof(call_log)) {
        if (n) strcat(call_log, " ");
        strcat(call_log, what);
    }
}

const char *stub_log(void) { return call_log; }
void stub_reset(void) { call_log[0] = 0; fail_open = 0; }
void stub_fail_open(int on) { fail_open = on; }

typedef struct { unsigned long h; } gdr_mh_t;

struct handle { uintptr_t addr; size_t size; int mapped; };

void *gdr_open(void) {
    note("open");
    if (fail_open) return NULL;
    return malloc(1);
}

#ifndef ONLY_OPEN
int gdr_close(void *g) { note("close"); free(g); return 0; }

int gdr_pin_buffer(void *g, unsigned long addr, size_t size, uint64_t tok, uint32_t vas, gdr_mh_t *mh) {
    (void)g; (void)tok; (void)vas;
    note("pin");
    if (size > ((size_t)1 << 30)) return -22;
    struct handle *h = calloc(1, sizeof *h);
    h->addr = addr;
    h->size = size;
    mh->h = (unsigned long)h;
    return 0;
}

int gdr_unpin_buffer(void *g, gdr_mh_t mh) {
    (void)g;
    struct handle *h = (struct handle *)mh.h;
    note(h->mapped ? "unpin-while-mapped" : "unpin");
    free(h);
    return 0;
}

int gdr_map(void *g, gdr_mh_t mh, void **va, size_t size) {
    (void)g;
    struct handle *h = (struct handle *)mh.h;
    note(size == h->size ? "map" : "map-bad-size");
    h->mapped = 1;
    *va = (void *)h->addr;
    return 0;
}

int gdr_unmap(void *g, gdr_mh_t mh, void *va, size_t size) {
    (void)g;
    struct handle *h = (struct handle *)mh.h;
    note(((uintptr_t)va == h->addr && size == h->size) ? "unmap" : "unmap-bad-args");
    h->mapped = 0;
    return 0;
}

typedef struct {
    uint64_t va, mapped_size;
    uint32_t page_size;
    uint64_t tm_cycles;
    uint32_t cycles_per_ms;
    unsigned mapped : 1;
    unsigned wc_mapping : 1;
    int mapping_type;
} info_t;

int gdr_get_info_v2(void *g, gdr_mh_t mh, info_t *info) {
    (void)g;
    struct handle *h = (struct handle *)mh.h;
    note("info");
    memset(info, 0, sizeof *info);
    info->va = h->addr;
    info->mapped_size = h->size;
    info->page_size = 65536;
    info->mapped = h->mapped;
    info->wc_mapping = 1;
    info->mapping_type = 1;
    return 0;
}

int gdr_copy_to_mapping(gdr_mh_t mh, void *dst, const void *src, size_t n) {
    (void)mh;
    note("copy_to");
    memcpy(dst, src, n);
    return 0;
}

int gdr_copy_from_mapping(gdr_mh_t mh, void *dst, const void *src, size_t n) {
    (void)mh;
    note("copy_from");
    memcpy(dst, src, n);
    return 0;
}

void gdr_runtime_get_version(int *major, int *minor) { *major = 2; *minor = 5; }

int gdr_driver_get_version(void *g, int *major, int *minor) { (void)g; *major = 2; *minor = 4; return 0; }
#endif
