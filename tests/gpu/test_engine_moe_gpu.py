"""The engine on CUDA runs quantized MoE layers through the Triton MoE kernels (`KernelMoE`: router, grouped expert
GEMMs decoding NVFP4 / MXFP8 in registers, shared expert, combine) and still produces the reference's tokens: the
same checkpoint on the CPU (torch dequantization, fp32). Kernel dots take fp16/bf16 operands, so a near-tie may part
the two runs late. Every quantized layer of the tiny model (64 / 128 wide: no multiple of 128 needed) takes the
kernels, the NVFP4 shared expert and dense MLP included: no torch fallback is left on CUDA."""
import pytest
import torch

from m3serve import LLM, SamplingParams
from m3serve.model.layers.linear import KernelQuantLinear, TorchQuantLinear
from m3serve.model.layers.moe import DenseMoE, KernelMoE
from m3serve.model.quantize import quantize_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("scheme,modules", [("nvfp4", ("experts",)), ("mxfp8", ("experts", "shared_experts")),
                                            ("nvfp4", ("experts", "shared_experts", "dense_mlp"))])
def test_quantized_moe_engine_matches_cpu_reference(tiny_model_dir, tmp_path, scheme, modules):
    q = str(tmp_path / scheme)
    quantize_checkpoint(tiny_model_dir, q, scheme, modules=modules, progress=False)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 480, (n,), generator=g).tolist() for n in (12, 70, 33)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=q, device=device, dtype="float32", max_model_len=256, num_gpu_blocks_override=32)
        model = llm.engine.executor.worker.model
        kinds = {type(m.method) for m in model.modules() if hasattr(m, "method") and m.method is not None}
        if device == "cuda":  # every quantized layer on the kernels, whatever its format and width
            assert KernelMoE in kinds and DenseMoE not in kinds and TorchQuantLinear not in kinds, kinds
            assert ("dense_mlp" in modules) == (KernelQuantLinear in kinds), kinds
        outs[device] = llm.generate(prompts, sp)
    for ref, got in zip(outs["cpu"], outs["cuda"]):
        n = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), len(ref.token_ids))
        assert n >= 6, (n, ref.token_ids, got.token_ids)
        lp_r = [d[t] for d, t in zip(ref.logprobs, ref.token_ids)][:n]
        lp_g = [d[t] for d, t in zip(got.logprobs, got.token_ids)][:n]
        assert max(abs(a - b) for a, b in zip(lp_r, lp_g)) < 0.2
