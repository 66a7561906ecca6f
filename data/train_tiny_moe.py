"""Train the embedded default model data/tiny-mixtral/ : a tiny Mixtral on Python source.

The corpus is the standard library's own `.py` source of the Python that runs this script
(`sysconfig.get_paths()["stdlib"]`, without `site-packages/`), so it ships with every
Python installation. Files are listed in sorted order; about 3 % of them (a stable
sha256 of the relative path) are held out for evaluation, the rest is training text.
Each file is tokenized with the real Mixtral SentencePiece tokenizer (data/tokenizer.model.v1,
32000 pieces) and files are joined with BOS (id 1) in front of each.

The model is `transformers.MixtralForCausalLM` with tied input/output embeddings, trained
in float32 on the CPU (torch.set_num_threads(2), seeded) with AdamW, linear warmup and a
cosine decay, and the router load-balancing auxiliary loss on, per layer, so
that the experts do not collapse. The schedule runs over `--steps` optimizer steps; the
`--minutes` wall-clock budget can shorten it: the schedule's progress is
max(step / steps, elapsed / budget), so a slower machine ends on time with the learning
rate decayed (the run is then no longer step-for-step reproducible; the summary says so).

At the end it writes

    data/tiny-mixtral/config.json, model.safetensors (bf16, hub-style key names as
        save_pretrained writes them), tokenizer.model, tokenizer_config.json,
        special_tokens_map.json  -- AutoTokenizer and from_pretrained work offline
    docs/training/loss.csv        step, tokens, seconds, lr, train loss, aux loss, held-out loss
    docs/training/summary.json    configuration, corpus and token counts, perplexities, samples
    docs/training/loss.svg        the loss curve (hand-written SVG, no plotting dependency)

and prints a summary. The defaults are the committed run; run it by hand (not in CI),
from the repository root:

    nice -n 5 /work/devenv/bin/python data/train_tiny_moe.py

Needs torch, transformers, safetensors, sentencepiece, numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time

import numpy as np

# On a shared, oversubscribed machine OpenMP's default spin-waiting burns the CPU that
# the other thread needs: a training step measured 4-6 CPU-s and 16-23 s wall with it,
# about 1 CPU-s and 2-4 s wall with passive waiting. It must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TOKENIZER = os.path.join(HERE, "tokenizer.model.v1")

TOKENIZER_CONFIG = {
    "tokenizer_class": "LlamaTokenizer",
    "add_bos_token": True,
    "add_eos_token": False,
    "add_prefix_space": None,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": None,
    "clean_up_tokenization_spaces": False,
    "legacy": True,
    "model_max_length": 4096,
    "sp_model_kwargs": {},
    "spaces_between_special_tokens": False,
    "use_default_system_prompt": False,
}
SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
SAMPLE_PROMPTS = ["import os\n", "def ", "class "]


# ------------------------------------------------------------------------------ corpus

def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def list_sources(root: str) -> list[str]:
    """Sorted relative paths of the standard library's .py files (no site-packages)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != "site-packages"]
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for fn in filenames:
            if fn.endswith(".py"):
                out.append(os.path.normpath(os.path.join(rel_dir, fn)).replace(os.sep, "/"))
    return sorted(out)


def is_heldout(rel: str, permille: int) -> bool:
    """Stable split by file: the first 32 bits of sha256(relative path) mod 1000 < permille."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) % 1000 < permille


def read_text(path: str) -> str | None:
    """The file as UTF-8 text, or None if it is not UTF-8 (a few test fixtures are not)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def build_corpus(root: str, permille: int, sp) -> dict:
    """Tokenize every file; returns the two token streams (BOS before each file) and counts."""
    files = list_sources(root)
    parts = {"train": [], "heldout": []}
    names = {"train": [], "heldout": []}
    skipped = []
    for rel in files:
        text = read_text(os.path.join(root, rel))
        if text is None or not text.strip():
            skipped.append(rel)
            continue
        split = "heldout" if is_heldout(rel, permille) else "train"
        parts[split].append(text)
        names[split].append(rel)
    out = {"root": root, "files_skipped": skipped}
    for split in ("train", "heldout"):
        ids = sp.encode(parts[split])
        stream = np.fromiter((t for doc in ids for t in [sp.bos_id()] + doc), dtype=np.int32)
        out[split] = stream
        out[split + "_files"] = names[split]
        out[split + "_bytes"] = sum(len(t.encode("utf-8")) for t in parts[split])
    return out


def unigram_nll(train: np.ndarray, held: np.ndarray, vocab: int) -> float:
    """Mean held-out NLL (nats) of the add-one-smoothed unigram distribution of the train
    stream, predicting every held-out token after the first (like the model does)."""
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held[1:]].mean())


# ------------------------------------------------------------------------------ model

def make_config(a):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=32000, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        head_dim=a.hidden // a.heads, num_local_experts=a.experts, num_experts_per_tok=a.top_k,
        max_position_embeddings=4096, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None, tie_word_embeddings=True,
        attention_dropout=0.0, initializer_range=0.02, router_aux_loss_coef=a.aux_coef,
        router_jitter_noise=0.0, output_router_logits=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=None, use_cache=True)


def per_layer_aux_loss(router_logits, n_experts: int, top_k: int):
    """The Switch/Mixtral load-balancing loss computed for each layer and averaged.

    transformers' `load_balancing_loss_func` given all layers at once pools the counts of
    expert index e over the layers, so layer 2 sending everything to expert 4 and layer 3
    sending everything to expert 2 look balanced: a first run with it (coefficient 0.01)
    ended with one expert taking nearly every token in two layers and dead experts in
    three. Its value is top_k for a perfectly even router."""
    import torch
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return torch.stack([load_balancing_loss_func((r,), n_experts, top_k) for r in router_logits]).mean()


def lr_at(progress: float, a) -> float:
    """Linear warmup over warmup/steps of the run, then cosine from lr down to lr*min_lr_ratio."""
    w = a.warmup / a.steps
    if progress < w:
        return a.lr * progress / w
    t = min(1.0, (progress - w) / max(1e-9, 1.0 - w))
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def windows(stream: np.ndarray, T: int) -> np.ndarray:
    """Non-overlapping (T+1)-token windows (stride T) covering the stream; (n, T+1) int64."""
    n = (len(stream) - 1) // T
    idx = np.arange(n)[:, None] * T + np.arange(T + 1)[None, :]
    return stream[idx].astype(np.int64)


def spaced(wins: np.ndarray, n: int) -> np.ndarray:
    """n windows evenly spaced over the stream (all of them if n is 0 or too large)."""
    if n <= 0 or n >= len(wins):
        return wins
    return wins[np.unique(np.linspace(0, len(wins) - 1, n).round().astype(int))]


def evaluate(model, wins: np.ndarray, batch: int) -> float:
    """Mean next-token NLL (nats) over all positions of the given windows."""
    import torch
    import torch.nn.functional as F

    total, n = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(wins), batch):
            x = torch.from_numpy(wins[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   x[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            n += x[:, 1:].numel()
    model.train()
    return total / n


def greedy(model, sp, prompt: str, n: int) -> str:
    import torch

    ids = [sp.bos_id()] + sp.encode(prompt)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=2, eos_token_id=None)
    return sp.decode(out[0, 1:].tolist())


# ------------------------------------------------------------------------------ outputs

def write_svg(path: str, rows: list[dict], title: str) -> None:
    """A plain SVG line chart of train loss (per logged step) and held-out loss vs tokens."""
    W, H, L, R, T, B = 720, 420, 64, 20, 40, 52
    tr = [(r["tokens"], r["train_loss"]) for r in rows if r["train_loss"] is not None]
    ev = [(r["tokens"], r["heldout_loss"]) for r in rows if r["heldout_loss"] is not None]
    xs = [p[0] for p in tr + ev]
    ys = [p[1] for p in tr + ev]
    x0, x1 = 0.0, max(xs) if xs else 1.0
    y0 = math.floor(min(ys)) if ys else 0.0
    y1 = math.ceil(min(max(ys), 11.0)) if ys else 1.0

    def px(x):
        return L + (x - x0) / (x1 - x0 or 1) * (W - L - R)

    def py(y):
        return T + (1 - (min(y, y1) - y0) / (y1 - y0 or 1)) * (H - T - B)

    def poly(pts, colour, width):
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        return f'<polyline fill="none" stroke="{colour}" stroke-width="{width}" points="{d}"/>'

    s = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
          f'viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">'),
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for k in range(int(y0), int(y1) + 1):
        s.append(f'<line x1="{L}" x2="{W - R}" y1="{py(k):.1f}" y2="{py(k):.1f}" stroke="#ddd"/>')
        s.append(f'<text x="{L - 6}" y="{py(k) + 4:.1f}" text-anchor="end">{k}</text>')
    step = 10 ** math.floor(math.log10(x1 or 1))
    if x1 / step < 4:
        step /= 2
    k = 0.0
    while k <= x1:
        s.append(f'<line x1="{px(k):.1f}" x2="{px(k):.1f}" y1="{T}" y2="{H - B}" stroke="#eee"/>')
        s.append(f'<text x="{px(k):.1f}" y="{H - B + 16}" text-anchor="middle">{k / 1e6:g}M</text>')
        k += step
    s.append(f'<rect x="{L}" y="{T}" width="{W - L - R}" height="{H - T - B}" fill="none" stroke="#333"/>')
    s.append(f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">training tokens</text>')
    s.append(f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 16 {(T + H - B) / 2})">cross-entropy (nats/token)</text>')
    if tr:
        s.append(poly(tr, "#1f77b4", 1))
    if ev:
        s.append(poly(ev, "#d62728", 2))
        for x, y in ev:
            s.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="#d62728"/>')
    s.append(f'<line x1="{W - 200}" x2="{W - 180}" y1="{T + 16}" y2="{T + 16}" stroke="#1f77b4"/>'
             f'<text x="{W - 175}" y="{T + 20}">train (batch)</text>')
    s.append(f'<line x1="{W - 200}" x2="{W - 180}" y1="{T + 34}" y2="{T + 34}" stroke="#d62728" '
             f'stroke-width="2"/><text x="{W - 175}" y="{T + 38}">held-out</text>')
    s.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(s) + "\n")


def save_folder(model, out: str) -> None:
    """bf16 checkpoint with save_pretrained's hub-style names, plus the tokenizer files."""
    import torch

    os.makedirs(out, exist_ok=True)
    for fn in os.listdir(out):
        os.remove(os.path.join(out, fn))
    model.config.output_router_logits = False
    model.to(torch.bfloat16).save_pretrained(out)
    model.to(torch.float32)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump(SPECIAL_TOKENS_MAP, f, indent=2, sort_keys=True)
        f.write("\n")
    shutil.copyfile(TOKENIZER, os.path.join(out, "tokenizer.model"))


def check_folder(out: str, sp) -> None:
    """transformers loads the checkpoint and the tokenizer offline; AutoTokenizer matches sp."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer, MixtralForCausalLM

    m = MixtralForCausalLM.from_pretrained(out, dtype=torch.float32)
    t = AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x + 1\n"
    ids = t(text).input_ids
    want = [sp.bos_id()] + sp.encode(text)
    if ids != want:
        raise SystemExit(f"error: AutoTokenizer gives {ids}, sentencepiece {want}")
    with torch.no_grad():
        logits = m(torch.tensor([ids])).logits
    if logits.shape != (1, len(ids), 32000) or not torch.isfinite(logits).all():
        raise SystemExit(f"error: bad logits {tuple(logits.shape)}")


# ------------------------------------------------------------------------------ main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--hidden", type=int, default=96)
    g.add_argument("--intermediate", type=int, default=192)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv_heads", type=int, default=2)
    g.add_argument("--experts", type=int, default=8)
    g.add_argument("--top_k", type=int, default=2)
    g = p.add_argument_group("training")
    g.add_argument("--seq_len", type=int, default=256)
    g.add_argument("--batch", type=int, default=4, help="sequences per optimizer step")
    g.add_argument("--steps", type=int, default=2000, help="length of the lr schedule")
    g.add_argument("--minutes", type=float, default=25.0,
                   help="wall-clock budget of the training loop (0: none)")
    g.add_argument("--experts_impl", default="grouped_mm", choices=["grouped_mm", "eager"],
                   help="transformers' expert implementation used for training")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min_lr_ratio", type=float, default=0.1)
    g.add_argument("--warmup", type=int, default=30, help="warmup steps")
    g.add_argument("--weight_decay", type=float, default=0.1)
    g.add_argument("--grad_clip", type=float, default=1.0)
    g.add_argument("--aux_coef", type=float, default=0.02,
                   help="weight of the per-layer load-balancing loss (router_aux_loss_coef)")
    g.add_argument("--seed", type=int, default=20261130)
    g.add_argument("--threads", type=int, default=2)
    g = p.add_argument_group("data and evaluation")
    g.add_argument("--heldout_permille", type=int, default=30)
    g.add_argument("--eval_every", type=int, default=40)
    g.add_argument("--eval_windows", type=int, default=16,
                   help="held-out windows (evenly spaced) for the periodic evaluation")
    g.add_argument("--final_eval_windows", type=int, default=160,
                   help="held-out windows (evenly spaced) for the final evaluation (0: all)")
    g.add_argument("--log_every", type=int, default=5)
    g = p.add_argument_group("output")
    g.add_argument("--out", default=os.path.join(HERE, "tiny-mixtral"))
    g.add_argument("--docs", default=os.path.join(REPO, "docs", "training"))
    g.add_argument("--trial", action="store_true",
                   help="throughput trial: train within --minutes, write nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    import sentencepiece as spm
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import MixtralForCausalLM

    for v in (a.hidden, a.intermediate, a.hidden // a.heads):
        if v % 4:
            raise SystemExit(f"error: size {v} is not a multiple of 4 (transformers' CPU grouped_mm)")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t_start = time.time()
    load_start = os.getloadavg()

    sp = spm.SentencePieceProcessor(model_file=TOKENIZER)
    corpus = build_corpus(stdlib_root(), a.heldout_permille, sp)
    train, held = corpus["train"], corpus["heldout"]
    t_corpus = time.time() - t_start
    print(f"corpus: {corpus['root']} (Python {platform.python_version()}): "
          f"{len(corpus['train_files'])} train files / {len(train):,} tokens, "
          f"{len(corpus['heldout_files'])} held-out files / {len(held):,} tokens, "
          f"{len(corpus['files_skipped'])} skipped (not UTF-8 or empty); {t_corpus:.0f} s", flush=True)

    T = a.seq_len
    held_w = windows(held, T)
    eval_w = spaced(held_w, a.eval_windows)
    final_w = spaced(held_w, a.final_eval_windows)

    config = make_config(a)
    model = MixtralForCausalLM(config)
    model.set_experts_implementation(a.experts_impl)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    print(f"model: {n_params:,} parameters ({n_embed:,} in the tied embedding), "
          f"{n_params * 2 / 1e6:.1f} MB in bf16", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(a.seed)
    train_t = torch.from_numpy(train.astype(np.int64))
    offsets = torch.arange(T + 1)

    rows = []
    unigram = unigram_nll(train, held, 32000)
    init_loss = evaluate(model, eval_w, a.batch)
    rows.append({"step": 0, "tokens": 0, "seconds": 0.0, "lr": 0.0, "train_loss": None,
                 "aux_loss": None, "heldout_loss": init_loss})
    print(f"untrained held-out loss {init_loss:.3f} (ppl {math.exp(init_loss):,.0f}); "
          f"unigram {unigram:.3f} (ppl {math.exp(unigram):,.0f})", flush=True)

    budget = a.minutes * 60.0
    t0 = time.time()
    step, tokens, time_bound = 0, 0, False
    smooth = None
    while True:
        elapsed = time.time() - t0
        progress = step / a.steps
        if budget > 0 and elapsed / budget > progress:
            progress, time_bound = elapsed / budget, True
        if progress >= 1.0 or (a.trial and budget > 0 and elapsed >= budget):
            break
        lr = lr_at(progress, a)
        for g_ in opt.param_groups:
            g_["lr"] = lr
        start = torch.randint(0, len(train_t) - T - 1, (a.batch,), generator=gen)
        x = train_t[start[:, None] + offsets[None, :]]
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), x[:, 1:].reshape(-1))
        aux = per_layer_aux_loss(out.router_logits, a.experts, a.top_k)
        loss = ce + a.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        step += 1
        tokens += a.batch * T
        ce_v = float(ce.detach())
        smooth = ce_v if smooth is None else 0.9 * smooth + 0.1 * ce_v
        row = None
        if step % a.log_every == 0:
            row = {"step": step, "tokens": tokens, "seconds": round(time.time() - t0, 1), "lr": lr,
                   "train_loss": ce_v, "aux_loss": float(aux.detach()), "heldout_loss": None}
        if step % a.eval_every == 0 and not a.trial:
            row = row or {"step": step, "tokens": tokens, "seconds": round(time.time() - t0, 1),
                          "lr": lr, "train_loss": ce_v, "aux_loss": float(aux.detach())}
            row["heldout_loss"] = evaluate(model, eval_w, a.batch)
        if row:
            rows.append(row)
            ev = f" held-out {row['heldout_loss']:.3f}" if row["heldout_loss"] is not None else ""
            print(f"step {step:5d}  {tokens / 1e6:6.2f}M tok  {row['seconds']:7.0f} s  lr {lr:.2e}  "
                  f"loss {ce_v:.3f} (avg {smooth:.3f})  aux {row['aux_loss']:.3f}{ev}  "
                  f"{tokens / (time.time() - t0):,.0f} tok/s", flush=True)
    train_s = time.time() - t0
    print(f"trained {step} steps, {tokens:,} tokens in {train_s / 60:.1f} min "
          f"({tokens / train_s:,.0f} tok/s){' -- stopped by the time budget' if time_bound else ''}",
          flush=True)
    if a.trial:
        return 0

    final_f32 = evaluate(model, final_w, a.batch)
    rows.append({"step": step, "tokens": tokens, "seconds": round(train_s, 1), "lr": 0.0,
                 "train_loss": None, "aux_loss": None, "heldout_loss": evaluate(model, eval_w, a.batch)})
    save_folder(model, a.out)
    check_folder(a.out, sp)
    bf16 = MixtralForCausalLM.from_pretrained(a.out, dtype=torch.float32)
    final_bf16 = evaluate(bf16, final_w, a.batch)
    samples = {p: greedy(bf16, sp, p, 48) for p in SAMPLE_PROMPTS}

    os.makedirs(a.docs, exist_ok=True)
    with open(os.path.join(a.docs, "loss.csv"), "w") as f:
        keys = ["step", "tokens", "seconds", "lr", "train_loss", "aux_loss", "heldout_loss"]
        f.write(",".join(keys) + "\n")

        def cell(v):
            return "" if v is None else (f"{v:.5g}" if isinstance(v, float) else str(v))

        f.writelines(",".join(cell(r.get(k)) for k in keys) + "\n" for r in rows)
    write_svg(os.path.join(a.docs, "loss.svg"), rows,
              f"tiny-mixtral on the Python {platform.python_version()} stdlib: loss vs tokens")
    with open(os.path.join(a.out, "model.safetensors"), "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    summary = {
        "command": "python data/train_tiny_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(a) | {"out": os.path.relpath(a.out, REPO), "docs": os.path.relpath(a.docs, REPO)},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
                    "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "sentencepiece": spm.__version__},
        "corpus": {"stdlib": corpus["root"], "train_files": len(corpus["train_files"]),
                   "heldout_files": len(corpus["heldout_files"]),
                   "skipped_files": corpus["files_skipped"],
                   "train_tokens": len(train), "heldout_tokens": len(held),
                   "train_bytes": corpus["train_bytes"], "heldout_bytes": corpus["heldout_bytes"],
                   "heldout_file_list": corpus["heldout_files"]},
        "model": {"parameters": n_params, "embedding_parameters": n_embed,
                  "active_parameters_per_token": n_params - n_embed - (a.experts - a.top_k) * a.layers
                  * 3 * a.hidden * a.intermediate,
                  "safetensors_bytes": os.path.getsize(os.path.join(a.out, "model.safetensors")),
                  "safetensors_sha256": sha},
        "training": {"steps": step, "tokens": tokens, "seconds": round(train_s, 1),
                     "corpus_seconds": round(t_corpus, 1), "epochs": tokens / len(train),
                     "stopped_by_time_budget": time_bound},
        "heldout": {"windows": len(final_w), "of_windows": len(held_w),
                    "tokens_scored": int(len(final_w) * T),
                    "loss_f32": final_f32, "ppl_f32": math.exp(final_f32),
                    "loss_bf16": final_bf16, "ppl_bf16": math.exp(final_bf16),
                    "untrained_loss_subset": init_loss, "untrained_ppl_subset": math.exp(init_loss),
                    "unigram_loss": unigram, "unigram_ppl": math.exp(unigram),
                    "bits_per_byte_bf16": final_bf16 / math.log(2) * (len(held) - 1)
                    / corpus["heldout_bytes"]},
        "samples_greedy_bf16": samples,
    }
    with open(os.path.join(a.docs, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")

    print(f"held-out ({len(final_w) * T:,} tokens): loss {final_f32:.3f} ppl {math.exp(final_f32):.2f} "
          f"(f32), ppl {math.exp(final_bf16):.2f} (bf16 checkpoint); unigram ppl "
          f"{math.exp(unigram):,.0f}; untrained ppl {math.exp(init_loss):,.0f}")
    for fn in sorted(os.listdir(a.out)):
        print(f"  {fn:<28} {os.path.getsize(os.path.join(a.out, fn)):>12,} bytes")
    print(f"model.safetensors sha256 {sha}")
    for p, s in samples.items():
        print(f"--- greedy from {p!r}:\n{s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
