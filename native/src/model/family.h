/*
 * family.h — the MoE families the engine runs, as data (family.c): each entry names a family
 * (the file's general.architecture) and the choices it may make for each axis on which MoE
 * families differ — attention, routing, FFN activation, RoPE. The file states its choices
 * as metadata (docs/format.md, "Family options"); model/config.c parses each choice by the
 * axis's name table and checks it against the family's entry, so the forward pass switches
 * on the choice, never on a family's name, and a new family is mostly a new row here (and
 * one in the converter's FAMILY_TABLE, colibri_lab/conversion/families.py).
 */
#ifndef COLIBRI_MODEL_FAMILY_H
#define COLIBRI_MODEL_FAMILY_H

#include <stddef.h>
#include <stdint.h>

/* The axes. Each choice's bit in a family's mask is 1u << choice. */
enum { CB_AXIS_ATTENTION, CB_AXIS_ROUTING, CB_AXIS_ACTIVATION, CB_AXIS_ROPE, CB_N_AXES };
/* model.attention: grouped-query attention (a KV cache per KV head) | multi-head latent */
enum { CB_ATTN_GQA = 0, CB_ATTN_MLA = 1 };
/* model.routing: softmax over all experts then top-k (renormalised when norm_topk_prob) |
 * top-k of the logits then softmax over those k | sigmoid scores then top-k */
enum { CB_ROUTE_SOFTMAX_TOPK = 0, CB_ROUTE_TOPK_SOFTMAX = 1, CB_ROUTE_SIGMOID_TOPK = 2 };
/* model.activation: silu(gate) * up | clamped SwiGLU with biases */
enum { CB_ACT_SILU_GLU = 0, CB_ACT_CLAMPED_SWIGLU = 1 };
/* model.rope_type: default | YaRN (inverse frequencies and attention factor from the file) */
enum { CB_ROPE_DEFAULT = 0, CB_ROPE_YARN = 1 };

typedef struct cb_family {
    const char *name;           /* general.architecture */
    uint32_t allowed[CB_N_AXES]; /* per axis, a mask of the choices this family may make */
} cb_family;

/* The entry of an architecture name (n bytes, not NUL-terminated), or NULL. */
const cb_family *cb_family_find(const uint8_t *name, uint64_t n);
/* "mixtral, qwen2_moe, ...": every family of the table, for messages, into buf. */
void cb_family_names(char *buf, size_t cap);

/* The metadata key of an axis ("model.attention", ...), the choice a file without the key
 * makes (Mixtral's), and the choice named by n bytes of name: its index, or -1 when the
 * axis has no such choice; 1 when the forward pass implements a choice. */
const char *cb_axis_key(int axis);
int cb_axis_default(int axis);
int cb_axis_parse(int axis, const uint8_t *name, uint64_t n);
int cb_axis_implemented(int axis, int choice);
/* The name of choice `choice` of an axis ("?" out of range); the names this build
 * implements, comma-separated, into buf. */
const char *cb_axis_choice_name(int axis, int choice);
void cb_axis_choices(int axis, char *buf, size_t cap);

#endif
