"""Measure how the routers of data/tiny-mixtral use their experts on held-out Python text.

Runs the checkpoint with transformers (`output_router_logits=True`, float32; the Colibri
engine is not involved) on held-out windows of the training corpus (the same file split
as data/train_tiny_moe.py: the standard library's .py files whose path hash falls in the
held-out ~3 %) and reports, per layer:

- load entropy: the entropy of the expert-load distribution (the share of the top-k
  assignments each expert receives) divided by log(E); 1.0 is a perfectly even load;
- token entropy: the mean over tokens of the entropy of the router's softmax, next to
  log(E) (the value for a router that cannot tell its experts apart);
- I(expert; class): the mutual information, in bits, between the chosen expert (each of
  a token's top-k experts counted with weight 1/k) and the token's lexical class, also as
  a fraction of H(class); the same number with the classes shuffled (what chance gives);
- for each class, the experts that take the largest share of its assignments (an even
  spread would give each expert 1/E).

Token classes come from the sentencepiece piece and the Python `tokenize` module run on
the source file: a piece that is only whitespace is `newline` if it holds a line break,
else `indent/space`; any other piece takes the class of its first non-blank character in
the file: inside a STRING or COMMENT token -> `str/comment`, a NAME that is a keyword ->
`keyword`, another NAME -> `name`, NUMBER -> `digit`, OP (or anything else) -> `punct/op`.
Files that `tokenize` cannot read fall back to the piece text alone.

The same numbers for an untrained model of the same shape (seeded random init) are
printed for contrast. Output: a markdown report on stdout and, with --json, a JSON file.

    /work/devenv/bin/python data/analyse_routing.py --json docs/training/routing.json
"""

from __future__ import annotations

import argparse
import io
import json
import keyword
import math
import os
import sys
import tokenize

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import train_tiny_moe as T

CLASSES = ["newline", "indent/space", "keyword", "name", "digit", "punct/op", "str/comment"]
NEWLINE, SPACE, KEYWORD, NAME, DIGIT, PUNCT, STRCOM = range(len(CLASSES))
BOS_CLASS = -1


def char_classes(text: str) -> np.ndarray | None:
    """Class of each character of a Python source file from `tokenize` (None if it fails)."""
    cls = np.full(len(text), PUNCT, dtype=np.int8)
    line_start = [0]
    for line in text.splitlines(keepends=True):
        line_start.append(line_start[-1] + len(line))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT):
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            a, b = line_start[r0 - 1] + c0, line_start[r1 - 1] + c1
            if tok.type in (tokenize.STRING, tokenize.COMMENT) or tokenize.tok_name[tok.type].startswith("FSTRING"):
                c = STRCOM
            elif tok.type == tokenize.NAME:
                c = KEYWORD if keyword.iskeyword(tok.string) else NAME
            elif tok.type == tokenize.NUMBER:
                c = DIGIT
            elif tok.type in (tokenize.NEWLINE, tokenize.NL):
                c = NEWLINE
            else:
                c = PUNCT
            cls[a:b] = c
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    return cls


def piece_class(surface: str) -> int:
    """Class from the piece text alone (fallback for files tokenize cannot read)."""
    s = surface.strip(" \t\f")
    if not s.strip():
        return NEWLINE if ("\n" in surface or "\r" in surface) else SPACE
    if s[0].isdigit():
        return DIGIT
    if s[0].isalpha() or s[0] == "_":
        word = s.split()[0]
        return KEYWORD if keyword.iskeyword(word) else NAME
    return PUNCT


def classify_file(text: str, sp) -> tuple[list[int], list[int], bool]:
    """(token ids, token classes, whether tokenize read the file) for one source file."""
    proto = sp.encode(text, return_type="proto")
    chars = char_classes(text)
    # byte offset -> character index
    b2c = np.repeat(np.arange(len(text)), [len(ch.encode("utf-8")) for ch in text]) if text else []
    raw = text.encode("utf-8")
    ids, classes = [], []
    for p in proto.pieces:
        ids.append(p.id)
        surface = raw[p.begin:p.end].decode("utf-8", "replace")
        if not surface.strip():
            classes.append(NEWLINE if ("\n" in surface or "\r" in surface) else SPACE)
            continue
        if chars is None:
            classes.append(piece_class(surface))
            continue
        lead = len(surface) - len(surface.lstrip())
        first = surface[lead:][:1]
        ci = int(b2c[p.begin]) + lead if p.begin < len(b2c) else len(text) - 1
        c = int(chars[min(ci, len(text) - 1)])
        if c in (NEWLINE,) and first not in "\r\n":
            c = PUNCT  # a line-continuation backslash and the like
        classes.append(c)
    return ids, classes, chars is not None


def heldout_stream(sp, permille: int) -> tuple[np.ndarray, np.ndarray, dict]:
    root = T.stdlib_root()
    ids, cls = [], []
    info = {"files": 0, "tokenize_fallback": []}
    for rel in T.list_sources(root):
        if not T.is_heldout(rel, permille):
            continue
        text = T.read_text(os.path.join(root, rel))
        if text is None or not text.strip():
            continue
        i, c, ok = classify_file(text, sp)
        ids += [sp.bos_id()] + i
        cls += [BOS_CLASS] + c
        info["files"] += 1
        if not ok:
            info["tokenize_fallback"].append(rel)
    return np.array(ids, dtype=np.int64), np.array(cls, dtype=np.int64), info


def entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def mutual_information(experts: np.ndarray, classes: np.ndarray, E: int, C: int) -> float:
    """I(expert; class) in bits; experts (N, k), each assignment weighted 1/k."""
    k = experts.shape[1]
    joint = np.zeros((E, C))
    np.add.at(joint, (experts.reshape(-1), np.repeat(classes, k)), 1.0 / k)
    joint /= joint.sum()
    return (entropy(joint.sum(1)) + entropy(joint.sum(0)) - entropy(joint.reshape(-1))) / math.log(2)


def route(model, ids: np.ndarray, seq_len: int, batch: int) -> list[np.ndarray]:
    """Per layer, the router logits (N, E) of every token of the (n, seq_len) windows."""
    import torch

    wins = ids.reshape(-1, seq_len)
    per_layer = None
    model.eval()
    with torch.no_grad():
        for i in range(0, len(wins), batch):
            out = model(input_ids=torch.from_numpy(wins[i:i + batch]), output_router_logits=True)
            logits = [r.float().numpy().reshape(-1, r.shape[-1]) for r in out.router_logits]
            per_layer = logits if per_layer is None else [np.concatenate([a, b]) for a, b in
                                                          zip(per_layer, logits)]
    return per_layer


def analyse(router_logits: list[np.ndarray], classes: np.ndarray, top_k: int, seed: int) -> list[dict]:
    keep = classes >= 0
    cls = classes[keep]
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(cls)
    C = len(CLASSES)
    out = []
    for layer, logits in enumerate(router_logits):
        logits = logits[keep]
        E = logits.shape[1]
        z = logits - logits.max(1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(1, keepdims=True)
        top = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
        load = np.bincount(top.reshape(-1), minlength=E) / top.size
        tok_ent = float((-(probs * np.log(np.clip(probs, 1e-30, None))).sum(1)).mean())
        class_ent = entropy(np.bincount(cls, minlength=C) / len(cls)) / math.log(2)
        mi = mutual_information(top, cls, E, C)
        mi_shuffled = mutual_information(top, shuffled, E, C)
        per_class = {}
        for c in range(C):
            sel = top[cls == c]
            if len(sel) == 0:
                continue
            share = np.bincount(sel.reshape(-1), minlength=E) / sel.size
            order = np.argsort(-share, kind="stable")
            per_class[CLASSES[c]] = {"tokens": len(sel),
                                     "top": [[int(e), float(share[e])] for e in order[:3]]}
        out.append({"layer": layer, "load": load.tolist(),
                    "load_entropy_norm": entropy(load) / math.log(E),
                    "token_entropy": tok_ent, "log_E": math.log(E),
                    "mi_bits": mi, "class_entropy_bits": class_ent,
                    "mi_fraction_of_class_entropy": mi / class_ent,
                    "mi_bits_shuffled_classes": mi_shuffled, "per_class": per_class})
    return out


def markdown(res: dict) -> str:
    lines = []
    E = len(res["trained"][0]["load"])
    lines.append(f"Held-out text: {res['tokens']:,} tokens ({res['windows']} windows of "
                 f"{res['seq_len']}) from {res['files']} held-out files; top-{res['top_k']} of {E} "
                 f"experts; log(E) = {math.log(E):.3f} nats.\n")
    lines.append("| layer | load entropy / log E | mean token routing entropy (nats) | "
                 "I(expert; class) bits | of H(class) | shuffled classes | untrained: load ent. / "
                 "token ent. / I |")
    lines.append("|---|---|---|---|---|---|---|")
    for t, u in zip(res["trained"], res["untrained"]):
        lines.append(f"| {t['layer']} | {t['load_entropy_norm']:.3f} | {t['token_entropy']:.3f} "
                     f"| {t['mi_bits']:.3f} | {100 * t['mi_fraction_of_class_entropy']:.1f} % "
                     f"| {t['mi_bits_shuffled_classes']:.4f} | {u['load_entropy_norm']:.3f} / "
                     f"{u['token_entropy']:.3f} / {u['mi_bits']:.3f} |")
    lines.append(f"\nH(class) = {res['trained'][0]['class_entropy_bits']:.3f} bits. Class counts: "
                 + ", ".join(f"{k} {v:,}" for k, v in res["class_counts"].items()) + ".\n")
    lines.append(f"Experts taking the largest share of each class's top-{res['top_k']} assignments "
                 f"(an even spread gives {100 / E:.1f} % each):\n")
    lines.append("| layer | " + " | ".join(CLASSES) + " |")
    lines.append("|---|" + "---|" * len(CLASSES))
    for t in res["trained"]:
        cells = []
        for c in CLASSES:
            pc = t["per_class"].get(c)
            cells.append("" if pc is None else
                         ", ".join(f"e{e} {100 * s:.0f}%" for e, s in pc["top"][:2]))
        lines.append(f"| {t['layer']} | " + " | ".join(cells) + " |")
    lines.append(f"\nExpert load per layer (share of assignments, e0..e{E - 1}):\n")
    for t in res["trained"]:
        lines.append(f"- layer {t['layer']}: " + " ".join(f"{100 * x:.1f}" for x in t["load"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(HERE, "tiny-mixtral"))
    p.add_argument("--windows", type=int, default=128, help="held-out windows, evenly spaced")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heldout_permille", type=int, default=30)
    p.add_argument("--seed", type=int, default=0, help="for the class shuffle and the untrained model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the full results here")
    a = p.parse_args(argv)

    import sentencepiece as spm
    import torch
    from transformers import MixtralForCausalLM

    torch.set_num_threads(a.threads)
    sp = spm.SentencePieceProcessor(model_file=os.path.join(a.model, "tokenizer.model"))
    ids, cls, info = heldout_stream(sp, a.heldout_permille)
    n = (len(ids) // a.seq_len)
    pick = np.unique(np.linspace(0, n - 1, min(a.windows, n)).round().astype(int))
    idx = (pick[:, None] * a.seq_len + np.arange(a.seq_len)[None, :]).reshape(-1)
    ids_w, cls_w = ids[idx], cls[idx]

    model = MixtralForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    top_k = model.config.num_experts_per_tok
    trained = analyse(route(model, ids_w, a.seq_len, a.batch), cls_w, top_k, a.seed)
    torch.manual_seed(a.seed)
    fresh = MixtralForCausalLM(model.config)
    untrained = analyse(route(fresh, ids_w, a.seq_len, a.batch), cls_w, top_k, a.seed)

    counts = np.bincount(cls_w[cls_w >= 0], minlength=len(CLASSES))
    res = {"model": os.path.relpath(os.path.abspath(a.model), T.REPO), "files": info["files"],
           "tokenize_fallback_files": info["tokenize_fallback"], "windows": len(pick),
           "seq_len": a.seq_len, "tokens": len(ids_w), "top_k": top_k, "classes": CLASSES,
           "class_counts": {c: int(counts[i]) for i, c in enumerate(CLASSES)},
           "trained": trained, "untrained": untrained}
    report = markdown(res)
    print(report)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res | {"markdown": report}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
