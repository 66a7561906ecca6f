"""The tokenizer section and chat template of a checkpoint folder: SentencePiece
`tokenizer.model`, byte-level BPE `tokenizer.json`, Mistral tekken or a tiktoken vocabulary (builders in
`spm.py` and `bpe.py`), and the metadata entries they come with."""

from __future__ import annotations

import importlib
import json
import os
from typing import Callable

from ..format import spec as fmt
from ..format.spec import MetaValue
from .spec import ConversionError


def _no_tokenizer(tokenizer: str, say: Callable[[str], None]) -> dict:
    """The metadata of a file without a tokenizer; checks the `tokenizer` option ("auto" or
    "none") and says so when "none" was asked for."""
    if tokenizer not in ("auto", "none"):
        raise ConversionError(f"tokenizer {tokenizer!r}: choose auto or none")
    if tokenizer == "none":
        say("tokenizer: none (asked for); the engine will run on token ids only")
    return {"tokenizer.type": "none", "tokenizer.bos_id": -1, "tokenizer.eos_id": -1,
            "tokenizer.unk_id": -1, "tokenizer.pad_id": -1}


# The tokenizer files of a checkpoint folder, in the order they are looked for, and the
# builder of each (colibri_lab.conversion.<module>.<function>: (section bytes, metadata))
TOKENIZER_FILES = (
    ("tokenizer.model", "spm", "build_tokenizer_section"),      # SentencePiece BPE: Mixtral, Llama
    ("tokenizer.json", "bpe", "build_bpe_tokenizer_section"),   # byte-level BPE: Qwen, OLMoE, GPT-2 style
    ("tekken.json", "bpe", "build_bpe_tokenizer_section"),      # Mistral's tiktoken-style vocabulary
    ("tiktoken.model", "bpe", "build_tiktoken_section"),        # a tiktoken vocabulary and its class: Kimi's
)


def _tokenizer_section(model_dir: str, say: Callable[[str], None], tokenizer: str = "auto"):
    """(section bytes, metadata dict) for the checkpoint's tokenizer.

    "auto": the first of TOKENIZER_FILES the folder holds, else none. "none": write a file
    without a tokenizer (the engine then runs on token ids only)."""
    none = _no_tokenizer(tokenizer, say)
    if tokenizer == "none":
        return b"", none
    found = next((t for t in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, t[0]))), None)
    if found is None:
        say(f"note: no {', '.join(name for name, _m, _f in TOKENIZER_FILES)} in {model_dir}; writing a "
            "file without a tokenizer (the engine then runs on token ids only)")
        return b"", none
    name, module, function = found
    build = getattr(importlib.import_module(f".{module}", __package__), function)
    path = os.path.join(model_dir, name)
    try:
        data, info = build(path)
    except ValueError as e:
        raise ConversionError(f"{e}. To convert the weights anyway, without a tokenizer, pass "
                              "tokenizer='none' (colibri-convert --no_tokenizer)") from e
    # Keys named "tokenizer.*" go to the metadata; others (n_pieces) are information.
    meta = {k: v for k, v in info.items() if k.startswith("tokenizer.")}
    if "n_pieces" in info:
        say(f"tokenizer: {info['n_pieces']} pieces, type {meta.get('tokenizer.type')}")
    for k in ("tokenizer.type", "tokenizer.bos_id", "tokenizer.eos_id", "tokenizer.unk_id",
              "tokenizer.pad_id"):
        if k not in meta:
            raise ConversionError(f"internal: tokenizer builder did not return {k}")
    template, where = read_chat_template(model_dir)
    if template is not None:
        meta["tokenizer.chat_template"] = template
        say(f"chat template: {len(template):,} characters from {where}")
    elif where:
        say(f"note: {where}; no chat template written")
    meta.update(end_ids_entry(read_generation_eos(model_dir, say), meta["tokenizer.eos_id"],
                              info.get("n_pieces"), "generation_config.json", say))
    return bytes(data), meta


def read_generation_eos(model_dir: str, say: Callable[[str], None]) -> list[int]:
    """The `eos_token_id` of the checkpoint's `generation_config.json` (an id or a list of
    them: every one ends transformers' generate), [] when there is none."""
    p = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(p):
        return []
    try:
        with open(p, "r", encoding="utf-8") as f:
            v = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        say(f"note: generation_config.json could not be read ({e}); its end tokens are not kept")
        return []
    v = [v] if isinstance(v, int) and not isinstance(v, bool) else v
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        say(f"note: generation_config.json's eos_token_id {v!r} is not an id or a list of ids; not kept")
        return []
    return v


def end_ids_entry(ids, eos_id, n_pieces, where: str, say: Callable[[str], None]) -> dict:
    """{"tokenizer.end_ids": ...} for the ids after which a generation ends besides EOS (in
    order, each once; ids outside the tokenizer's pieces are left out, said), or {}."""
    out, skipped = [], []
    for i in ids:
        if i == eos_id or i in out:
            continue
        (out if n_pieces is None or 0 <= i < n_pieces else skipped).append(int(i))
    if skipped:
        say(f"note: end token ids {skipped} of {where} are outside the tokenizer's {n_pieces} pieces; "
            "not kept")
    if len(out) > fmt.MAX_END_IDS:
        raise ConversionError(f"{where} names {len(out)} end tokens besides EOS; the format keeps at "
                              f"most {fmt.MAX_END_IDS}")
    if not out:
        return {}
    say(f"end tokens besides EOS: {out} (from {where})")
    return {"tokenizer.end_ids": MetaValue(fmt.MT_ARRAY, out, fmt.MT_I32)}


CHAT_TEMPLATE_FILE = "chat_template.jinja"          # transformers >= 4.43 / 5 save_pretrained
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"    # {"chat_template": "..."} (processors)


def read_chat_template(model_dir: str) -> tuple[str | None, str]:
    """The checkpoint's default chat template (its Jinja source) and where it came from.

    As transformers loads it: a `chat_template.jinja` file first (transformers 5 saves the
    template there), then `chat_template.json` ({"chat_template": ...}), then the
    `chat_template` entry of `tokenizer_config.json`, which is a string or a list of
    {"name", "template"} (the one named "default" is used). Returns (None, "") when the
    checkpoint has none, (None, reason) when one is there but unusable (no "default" among
    several, not a string, a NUL character)."""
    def usable(t, where: str) -> tuple[str | None, str]:
        if not isinstance(t, str):
            return None, f"the chat template in {where} is not a string"
        if "\x00" in t:
            return None, f"the chat template in {where} contains a NUL character"
        if not t:
            return None, f"the chat template in {where} is empty"
        return t, where

    p = os.path.join(model_dir, CHAT_TEMPLATE_FILE)
    if os.path.isfile(p):
        with open(p, "r", encoding="utf-8") as f:
            return usable(f.read(), CHAT_TEMPLATE_FILE)
    for name, key in ((LEGACY_CHAT_TEMPLATE_FILE, "chat_template"),
                      ("tokenizer_config.json", "chat_template")):
        p = os.path.join(model_dir, name)
        if not os.path.isfile(p):
            continue
        try:
            with open(p, "r", encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            if name == LEGACY_CHAT_TEMPLATE_FILE:
                return None, f"{name} could not be read ({e})"
            continue  # the tokenizer builder reports a broken tokenizer_config.json itself
        t = cfg.get(key) if isinstance(cfg, dict) else None
        if t is None:
            continue
        if isinstance(t, list):   # [{"name": ..., "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            if "default" not in named:
                return None, (f"{name} has several chat templates ({', '.join(map(str, named))}) "
                              "and none named 'default'")
            return usable(named["default"], f"{name} (template 'default')")
        if isinstance(t, dict):   # {name: template}
            if "default" not in t:
                return None, (f"{name} has several chat templates ({', '.join(map(str, t))}) "
                              "and none named 'default'")
            return usable(t["default"], f"{name} (template 'default')")
        return usable(t, name)
    return None, ""


def _tokenizer_meta_entries(meta: dict) -> list[tuple[str, MetaValue]]:
    out = [("tokenizer.type", MetaValue(fmt.MT_STRING, str(meta["tokenizer.type"])))]
    for k in ("bos_id", "eos_id", "unk_id", "pad_id"):
        v = meta[f"tokenizer.{k}"]
        out.append((f"tokenizer.{k}", MetaValue(fmt.MT_I32, -1 if v is None else int(v))))
    for k, v in meta.items():
        if any(k == key for key, _ in out):
            continue
        if isinstance(v, MetaValue):
            out.append((k, v))
        elif isinstance(v, bool):
            out.append((k, MetaValue(fmt.MT_BOOL, v)))
        elif isinstance(v, int):
            out.append((k, MetaValue(fmt.MT_U32 if 0 <= v <= fmt.U32_MAX else fmt.MT_I64, v)))
        elif isinstance(v, float):
            out.append((k, MetaValue(fmt.MT_F64, v)))
        elif isinstance(v, str):
            out.append((k, MetaValue(fmt.MT_STRING, v)))
        # anything else (lists, dicts) stays out of the metadata
    return out


