"""The runtime: the engine through its ctypes layer (`_native`), `Engine`, `Tokenizer`,
`Sequence` and `StageRun` (`engine`), traces (`trace`), the engine's statuses as
exceptions (`errors`), and `colibri_server` driven as a child process (`serving`)."""
