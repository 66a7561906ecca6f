"""Conversion to `.colibri`: what a conversion produces (`spec`), the file writer
(`writer`), Hugging Face checkpoints (`checkpoint`, `families`, `hf`, `deepseek`),
llama.cpp GGUF files (`gguf`), the tokenizer builders (`tokenizer`, `spm`, `bpe`), the
quantized mixes (`mixes`) and the command line (`cli`)."""
