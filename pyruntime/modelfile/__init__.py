"""The model file and how it splits: the GGUF reader, model sources, the split plan, the boundary between stages."""
