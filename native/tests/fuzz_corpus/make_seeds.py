"""Regenerate the committed seed corpus of the libFuzzer targets (native/tests/fuzz_corpus/).

    .venv/bin/python native/tests/fuzz_corpus/make_seeds.py

The seeds are committed (CI and tools/fuzz.sh only read them); this script is how they were
made, kept so that they can be remade after a format change. Deterministic: seeded models,
tokenizers cut down from data/tokenizer.model.v1 and built from a fixed vocabulary.

  loader/     whole .colibri files (fuzz_loader): tiny Mixtral models in bf16 (int8 router) and
              q8_0 (version 2: Q8_0 blocks, split FFNs), one with a SentencePiece tokenizer and
              one with a byte-level BPE tokenizer
  tokenizer/  [L][L bytes of text][tokenizer section] (fuzz_tokenizer): SentencePiece-BPE
              (type 1) and byte-level BPE (type 2, patterns GPT-2 / Qwen2 / Llama-3, NFC)
  server/     [kind][JSON body] (fuzz_server_api): kind 0 /v1/completions, 1 /v1/chat/completions
  chat/       [flags][a model's output] (fuzz_chat_output): flags bits 0-1 and 5 the tool-call
              syntax (hermes, mistral, deepseek, none, mistral-v11, harmony), bit 2 thinking, bit 3 tools, bit 4 also a
              tools array for the required-call constraint
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import colibri_lab  # noqa: E402
from colibri_lab.conversion.bpe import build_bpe_tokenizer_section, bytes_to_unicode  # noqa: E402
from colibri_lab.conversion.spm import build_tokenizer_section  # noqa: E402

N_SPM = 400  # pieces kept of the Mistral v1 vocabulary: <unk> <s> </s>, 256 bytes, the first merges


def small_spm(path: Path) -> Path:
    """data/tokenizer.model.v1 cut to its first N_SPM pieces (a valid BPE model)."""
    from sentencepiece import sentencepiece_model_pb2 as pb2

    m = pb2.ModelProto()
    m.ParseFromString((REPO / "data" / "tokenizer.model.v1").read_bytes())
    del m.pieces[N_SPM:]
    path.write_bytes(m.SerializeToString())
    return path


GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def small_bpe(folder: Path, pattern: str | None, nfc: bool) -> Path:
    """A byte-level BPE tokenizer.json: the 256 byte symbols, a few merges, added tokens."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: i for i, b in enumerate(range(256))}
    words = ["Ġt", "he", "Ġthe", "in", "er", "Ġa", "on", "Ġo", "en", "Ġw", "ing", "re", "Ġthe re", "ĠĠ", "ĠĠĠĠ", "ÃŃ",
             "Ċ", "ĊĊ", "12", "123"]
    merges = []
    for w in words:
        parts = w.split(" ") if " " in w else None
        if parts is None:
            # split into the two longest known halves
            for k in range(len(w) - 1, 0, -1):
                if w[:k] in vocab and w[k:] in vocab:
                    parts = [w[:k], w[k:]]
                    break
        if parts is None or "".join(parts) in vocab:
            continue
        merges.append(" ".join(parts))
        vocab["".join(parts)] = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    added = []
    for s in specials:
        vocab[s] = len(vocab)
        added.append({"id": vocab[s], "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    if pattern is None:
        pre = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        pre = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
          "normalizer": {"type": "NFC"} if nfc else None, "pre_tokenizer": pre, "post_processor": None,
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                    "ignore_merges": False, "vocab": vocab, "merges": merges}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|im_end|>",
                                                             "pad_token": "<|endoftext|>"}))
    return folder / "tokenizer.json"


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    print(f"{path.relative_to(REPO)}: {len(data)} bytes")


def tokenizer_seed(text: bytes, section: bytes) -> bytes:
    assert len(text) < 256
    return bytes([len(text)]) + text + section


def main() -> None:
    from colibri_lab.conversion.bpe import LLAMA3_PATTERN, QWEN2_PATTERN
    from colibri_lab.bench.models import MixtralShape, build_model, save_checkpoint

    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        # ---- tokenizer sections
        spm_model = small_spm(tmp / "tokenizer.model")
        spm_section, _ = build_tokenizer_section(spm_model)
        text = "Hello world, the  there\n\tcaf\u00e9 \u4f60\u597d 123 <s>".encode()
        write(HERE / "tokenizer" / "spm", tokenizer_seed(text, spm_section))
        write(HERE / "tokenizer" / "spm-notext", tokenizer_seed(b"", spm_section))
        bpe_sections = {}
        for name, pat, nfc in (("gpt2", None, False), ("qwen2", QWEN2_PATTERN, True), ("llama3", LLAMA3_PATTERN,
                                                                                        False)):
            tj = small_bpe(tmp / f"bpe-{name}", pat, nfc)
            bpe_sections[name], _ = build_bpe_tokenizer_section(tj)
            t = "the there  in 123 \u00ed<|im_start|>user\nhi<|im_end|> e\u0301".encode()
            write(HERE / "tokenizer" / f"bpe-{name}", tokenizer_seed(t, bpe_sections[name]))

        # ---- model files
        def model(shape, name, dtype, tok=None, **kw):
            folder = save_checkpoint(build_model(shape), tmp / f"hf-{name}", tokenizer="none")
            if tok == "spm":
                shutil.copy(spm_model, folder / "tokenizer.model")
            elif tok == "bpe":
                for f in (tmp / "bpe-qwen2").iterdir():
                    shutil.copy(f, folder / f.name)
            out = colibri_lab.convert(folder, tmp / f"{name}.colibri", dtype=dtype, progress=False, **kw)
            write(HERE / "loader" / f"{name}.colibri", Path(out).read_bytes())

        model(MixtralShape(vocab=300, hidden=16, inter=8, layers=2, heads=2, kv_heads=1, experts=4, top_k=2),
              "bf16-int8router", "bf16", quantize_router="int8")
        model(MixtralShape(vocab=300, hidden=32, inter=32, layers=2, heads=2, kv_heads=1, experts=4, top_k=2, seed=1),
              "q8_0", "q8_0")
        model(MixtralShape(vocab=N_SPM, hidden=16, inter=8, layers=1, heads=2, kv_heads=1, experts=2, top_k=1, seed=2),
              "spm", "bf16", tok="spm")
        model(MixtralShape(vocab=300, hidden=16, inter=8, layers=1, heads=2, kv_heads=1, experts=2, top_k=1, seed=3),
              "bpe", "bf16", tok="bpe")

    # ---- server request bodies
    seeds = [
        (0, {"model": "fuzz", "prompt": "def f(x):", "max_tokens": 3, "temperature": 0.5, "seed": 1,
             "stop": ["\n", "x"], "logprobs": 2, "echo": True, "n": 2}),
        (0, {"prompt": [1, 415, 2936], "max_tokens": 2, "stream": True, "top_p": 0.9, "top_k": 5}),
        (0, {"prompt": ["a", "b"], "max_tokens": 0, "presence_penalty": 0.5, "frequency_penalty": -0.5,
             "stream_options": {"include_usage": True}, "user": "u"}),
        (0, {"prompt": "x" * 40, "max_tokens": 100000, "temperature": -1, "n": 9}),
        (1, {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi \u00e9"}],
             "max_tokens": 4, "logprobs": True, "top_logprobs": 3, "stream": True}),
        (1, {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}], "stop": "c", "seed": 7}),
        (1, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "max_completion_tokens": 2, "response_format": {"type": "text"}}),
        (1, {"messages": [{"role": "tool", "content": "?"}, {"role": "user"}], "n": 0}),
    ]
    for i, (kind, body) in enumerate(seeds):
        write(HERE / "server" / f"seed{i}", bytes([kind]) + json.dumps(body, ensure_ascii=False).encode())
    write(HERE / "server" / "not-json", b"\x00{\"prompt\": \"a\", ")
    write(HERE / "server" / "bad-utf8", b"\x01{\"messages\": [{\"role\": \"user\", \"content\": \"\xc3\x28\"}]}")
    tool_seeds()


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def tool_seeds() -> None:
    """Request bodies with tools (server/) and model outputs with tool calls (chat/)."""
    bodies = [
        {"messages": [{"role": "user", "content": "w?"}], "tools": TOOLS, "tool_choice": "auto",
         "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": False}},
        {"messages": [{"role": "user", "content": "w?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "abcdefghi", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "abcdefghi", "content": "2"}], "tools": TOOLS,
         "tool_choice": {"type": "function", "function": {"name": "add"}}},
    ]
    for i, body in enumerate(bodies):
        write(HERE / "server" / f"tools{i}", bytes([1]) + json.dumps(body).encode())
    outputs = [
        (0 | 8, '<think>\nhm\n</think>\n\nOk.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'
                '</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
        (1 | 8, '[TOOL_CALLS][{"name": "add", "arguments": {"a": [1, 2.5e3]}, "id": "abcdefghi"}]'),
        (2 | 4 | 8, "x</think>y<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
                    "<｜tool▁calls▁end｜>"),
        (0 | 8 | 16, json.dumps(TOOLS)),
        (3, "plain <tool_call> text <think>"),
        (0 | 8 | 32, '[TOOL_CALLS]add[CALL_ID]abcdefghi[ARGS]{"a": 1}[TOOL_CALLS]get_weather[ARGS]{}'),
        (1 | 8 | 32, "<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.add<|channel|>commentary "
                     'json<|message|>{"a": 1}<|call|>'),
    ]
    for i, (flags, text) in enumerate(outputs):
        write(HERE / "chat" / f"seed{i}", bytes([flags]) + text.encode())


if __name__ == "__main__":
    main()
