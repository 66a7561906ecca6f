"""The `.colibri` file format: its constants, numerics and encoders (`spec`, a leaf), the
pure-Python reader and validator (`reader`: `inspect`, `colibri-inspect`), and the block
codecs of the quantized dtypes (`blocks`: byte for byte ggml's blocks)."""
