"""m3serve: serving the MiniMax-M3 model family on Triton Inference Server."""
