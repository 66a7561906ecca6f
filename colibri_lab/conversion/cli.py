"""`colibri-convert` (also `convert_hf_to_colibri` and `python -m colibri_lab convert`): a
Hugging Face checkpoint folder or a llama.cpp GGUF file -> a `.colibri` file."""

from __future__ import annotations

import argparse
import os
import sys

from ..format import spec as fmt
from .hf import QUANT_MIXES, convert
from .spec import FLOAT_DTYPES, ConversionError

# --------------------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="colibri-convert",
        description="Convert a Hugging Face MoE checkpoint folder (Mixtral, Qwen2-MoE, "
                    "Qwen3-MoE, OLMoE, DeepSeek-V2/V3, gpt-oss), or a llama.cpp GGUF file of "
                    "one, into a .colibri file.")
    p.add_argument("--model_name_or_path", required=True,
                   help="checkpoint folder: config.json, *.safetensors, optional tokenizer.model "
                        "or tokenizer.json; or a .gguf file, imported as it is stored (no "
                        "requantizing: --dtype, --quantize_router and --block_size do not apply); "
                        "a split GGUF (NAME-00001-of-00003.gguf ...) by any of its shards, the "
                        "others in the same folder, or by that folder")
    p.add_argument("--output_path", required=True, help="the .colibri file to write")
    p.add_argument("--dtype", choices=list(FLOAT_DTYPES + QUANT_MIXES), default=None,
                   help="weight dtype (norm weights are always f32), or a block-quantized "
                        "mix: q8_0, q4_k, q4_k_m (llama.cpp's Q4_K_M) or mxfp4 (routed experts MXFP4, the rest bf16); default bf16")
    p.add_argument("--quantize_router", choices=["none", "int8"], default=None,
                   help="store router weights as int8 with per-row scale/zero; default none")
    p.add_argument("--block_size", type=int, default=None,
                   help="row block of the packed expert layout; default 32")
    p.add_argument("--max_seq_len", type=int, default=None,
                   help="longest sequence; default the config's max_position_embeddings")
    p.add_argument("--no_tokenizer", action="store_true",
                   help="write no tokenizer (default: tokenizer.model, else tokenizer.json, else "
                        "tekken.json)")
    p.add_argument("--quiet", action="store_true", help="no stages, no progress bar")
    a = p.parse_args(argv)
    try:
        src = a.model_name_or_path
        if os.path.isdir(src) and not os.path.isfile(os.path.join(src, "config.json")):
            from .gguf_file import gguf_in_folder

            src = gguf_in_folder(src) or src   # a folder of one GGUF (or its shards)
        if os.path.isfile(src):
            from .gguf import convert_gguf

            if any(x is not None for x in (a.dtype, a.quantize_router, a.block_size)):
                raise ConversionError("a GGUF is imported with the dtypes it stores; --dtype, "
                                      "--quantize_router and --block_size do not apply to it")
            convert_gguf(src, a.output_path, max_seq_len=a.max_seq_len,
                         progress=not a.quiet, tokenizer="none" if a.no_tokenizer else "auto")
            return 0
        convert(a.model_name_or_path, a.output_path, dtype=a.dtype or "bf16",
                quantize_router=a.quantize_router or "none",
                block_size=fmt.DEFAULT_BLOCK_SIZE if a.block_size is None else a.block_size,
                max_seq_len=a.max_seq_len, progress=not a.quiet,
                tokenizer="none" if a.no_tokenizer else "auto")
    except (ConversionError, fmt.FormatError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
