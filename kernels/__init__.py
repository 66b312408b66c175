"""OpenAI Triton kernels, each beside its torch reference (m3serve.kernels)."""
