"""From files on disk to what the engine runs: model sources (directories, GGUF files, Hub IDs,
packages), weights, tokenizers, the demo model."""
