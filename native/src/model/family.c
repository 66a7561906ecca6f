/*
 * family.c — the family table (family.h). The choices the forward pass implements are the
 * rows of the axis tables; a family's masks say which of them its files may use.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "model/family.h"

#define BIT(c) (1u << (c))

static const cb_family FAMILIES[] = {
    /*  name          attention        routing                     activation            rope */
    {"mixtral",   {BIT(CB_ATTN_GQA), BIT(CB_ROUTE_SOFTMAX_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"qwen2_moe", {BIT(CB_ATTN_GQA), BIT(CB_ROUTE_SOFTMAX_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"qwen3_moe", {BIT(CB_ATTN_GQA), BIT(CB_ROUTE_SOFTMAX_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"olmoe",     {BIT(CB_ATTN_GQA), BIT(CB_ROUTE_SOFTMAX_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"deepseek_v2", {BIT(CB_ATTN_MLA), BIT(CB_ROUTE_SOFTMAX_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"deepseek_v3", {BIT(CB_ATTN_MLA), BIT(CB_ROUTE_SIGMOID_TOPK), BIT(CB_ACT_SILU_GLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
    {"gpt_oss",   {BIT(CB_ATTN_GQA), BIT(CB_ROUTE_TOPK_SOFTMAX), BIT(CB_ACT_CLAMPED_SWIGLU),
                   BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)}},
};
#define N_FAMILIES (sizeof FAMILIES / sizeof FAMILIES[0])

typedef struct axis {
    const char *key;
    const char *const *names; /* indexed by choice */
    int n;                    /* choices named */
    uint32_t implemented;     /* mask of the choices the forward pass implements */
} axis;

static const char *const ATTN[] = {"gqa", "mla"};
static const char *const ROUTE[] = {"softmax_topk", "topk_softmax", "sigmoid_topk"};
static const char *const ACT[] = {"silu_glu", "clamped_swiglu"};
static const char *const ROPE[] = {"default", "yarn"};

static const axis AXES[CB_N_AXES] = {
    {"model.attention", ATTN, 2, BIT(CB_ATTN_GQA) | BIT(CB_ATTN_MLA)},
    {"model.routing", ROUTE, 3, BIT(CB_ROUTE_SOFTMAX_TOPK) | BIT(CB_ROUTE_TOPK_SOFTMAX) | BIT(CB_ROUTE_SIGMOID_TOPK)},
    {"model.activation", ACT, 2, BIT(CB_ACT_SILU_GLU) | BIT(CB_ACT_CLAMPED_SWIGLU)},
    {"model.rope_type", ROPE, 2, BIT(CB_ROPE_DEFAULT) | BIT(CB_ROPE_YARN)},
};

static int bytes_are(const uint8_t *p, uint64_t n, const char *s) {
    size_t k = strlen(s);
    return n == k && memcmp(p, s, k) == 0;
}

const cb_family *cb_family_find(const uint8_t *name, uint64_t n) {
    for (size_t i = 0; i < N_FAMILIES; i++)
        if (bytes_are(name, n, FAMILIES[i].name)) return &FAMILIES[i];
    return NULL;
}

void cb_family_names(char *buf, size_t cap) {
    size_t k = 0;
    if (cap) buf[0] = 0;
    for (size_t i = 0; i < N_FAMILIES && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, "%s%s", i ? ", " : "", FAMILIES[i].name);
}

const char *cb_axis_key(int axis) { return axis >= 0 && axis < CB_N_AXES ? AXES[axis].key : "?"; }

int cb_axis_default(int axis) {
    (void)axis;
    return 0; /* the first choice of every axis is Mixtral's */
}

int cb_axis_parse(int axis, const uint8_t *name, uint64_t n) {
    if (axis < 0 || axis >= CB_N_AXES) return -1;
    for (int c = 0; c < AXES[axis].n; c++)
        if (bytes_are(name, n, AXES[axis].names[c])) return c;
    return -1;
}

int cb_axis_implemented(int axis, int choice) {
    return axis >= 0 && axis < CB_N_AXES && choice >= 0 && choice < AXES[axis].n &&
           (AXES[axis].implemented >> choice & 1u);
}

const char *cb_axis_choice_name(int axis, int choice) {
    if (axis < 0 || axis >= CB_N_AXES || choice < 0 || choice >= AXES[axis].n) return "?";
    return AXES[axis].names[choice];
}

void cb_axis_choices(int axis, char *buf, size_t cap) {
    size_t k = 0;
    if (cap) buf[0] = 0;
    if (axis < 0 || axis >= CB_N_AXES) return;
    for (int c = 0; c < AXES[axis].n && k < cap; c++)
        if (cb_axis_implemented(axis, c))
            k += (size_t)snprintf(buf + k, cap - k, "%s%s", k ? ", " : "", AXES[axis].names[c]);
}
