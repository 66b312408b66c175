"""OpenAI Triton kernels, each beside its torch reference (m3serve.kernels). One concern per file:

* ``platform``: the platform facts and gates (interpreter, capability, ROCm, Gluon present, SM count);
* ``dispatch``: which kernel runs each op (portable ``tl`` or Gluon mma: attention, indexer, MoE experts,
  quantized linears) and every launch default in one tuning table (`Tuning`, `tuned`; the MoE and linear tables
  by token count), the prefill tile maps;
* ``cache``: one layer's paged cache as the kernels take it (`LayerCache`), its layout, the torch page readers;
* ``codecs``: cache formats (``FMT_*``) and the in-kernel NVFP4 / FP8 encoders and decoders;
* ``nvfp4``, ``fp8``, ``mxfp8``: the number formats in plain torch (quantize / dequantize references);
* ops, each ``*_ref`` + kernel: ``kv_insert``, ``qkv_insert`` (norm + RoPE + insert from the fused QKV GEMM),
  ``indexer`` (lightning indexer: block scores + top-k), ``msa_attention`` (block-sparse / dense attention);
* ``nvfp4_mma``: the NVFP4 decode scan and attention for sm_89 / sm_90 in Gluon (mma.sync).
"""
