"""Parity with the numerical reference: transformers 5.25 `MiniMaxM3VLForCausalLM`, random tiny configs,
fp32, prompts longer than top-k x block so that block selection changes the result. Both layouts."""
from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("USE_HUB_KERNELS", "0")
from support.required import require  # noqa: E402

transformers = require("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import MiniMaxM3VLForCausalLM  # noqa: E402

from m3serve import LLM, SamplingParams  # noqa: E402
from m3serve.model.loader import load_model  # noqa: E402
from support.hf import hf_config, hf_model  # noqa: E402
from support.reference import reference_logits  # noqa: E402

PROMPT_LEN = 44  # 11 blocks >> top-2


def ours_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return reference_logits(model, ids.tolist())


def original_layout_state(hf: MiniMaxM3VLForCausalLM, cfg) -> dict[str, torch.Tensor]:
    """The Hub layout written out by hand from formats.md section 4 (independent of our layout tables)."""
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    out = {"language_model.model.embed_tokens.weight": sd.pop("model.embed_tokens.weight"),
           "language_model.model.norm.weight": sd.pop("model.norm.weight"),
           "language_model.lm_head.weight": sd.pop("lm_head.weight")}
    for i in range(cfg.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"language_model.model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm"):
            out[f"{dst}{n}.weight"] = sd.pop(f"{src}{n}.weight")
        if cfg.layer_types[i] == "minimax_m3_sparse":
            for a, b in (("q_proj", "index_q_proj"), ("k_proj", "index_k_proj"), ("q_norm", "index_q_norm"),
                         ("k_norm", "index_k_norm")):
                out[f"{dst}self_attn.{b}.weight"] = sd.pop(f"{src}self_attn.indexer.{a}.weight")
        if cfg.mlp_layer_types[i] == "sparse":
            moe = f"{dst}block_sparse_moe."
            out[moe + "gate.weight"] = sd.pop(f"{src}mlp.gate.weight")
            out[moe + "e_score_correction_bias"] = sd.pop(f"{src}mlp.gate.e_score_correction_bias")
            gu, down = sd.pop(f"{src}mlp.experts.gate_up_proj"), sd.pop(f"{src}mlp.experts.down_proj")
            inter = cfg.intermediate_size
            for e in range(cfg.num_local_experts):
                out[f"{moe}experts.{e}.w1.weight"] = gu[e, :inter].clone()
                out[f"{moe}experts.{e}.w3.weight"] = gu[e, inter:].clone()
                out[f"{moe}experts.{e}.w2.weight"] = down[e].clone()
            sgu = sd.pop(f"{src}mlp.shared_experts.gate_up_proj.weight")
            half = sgu.shape[0] // 2
            out[moe + "shared_experts.gate_proj.weight"] = sgu[:half].clone()
            out[moe + "shared_experts.up_proj.weight"] = sgu[half:].clone()
            out[moe + "shared_experts.down_proj.weight"] = sd.pop(f"{src}mlp.shared_experts.down_proj.weight")
        else:
            gu = sd.pop(f"{src}mlp.gate_up_proj.weight")
            half = gu.shape[0] // 2
            out[f"{dst}mlp.gate_proj.weight"] = gu[:half].clone()
            out[f"{dst}mlp.up_proj.weight"] = gu[half:].clone()
            out[f"{dst}mlp.down_proj.weight"] = sd.pop(f"{src}mlp.down_proj.weight")
    assert not sd, f"unmapped reference tensors: {sorted(sd)}"
    # parts a real Hub checkpoint carries that the text model must skip
    out["vision_tower.vision_model.pre_layrnorm.weight"] = torch.ones(8)
    out["language_model.model.mtp.layers.0.enorm.weight"] = torch.ones(8)
    return out


def write_original(tmp_path, hf, cfg) -> str:
    import json
    d = str(tmp_path / "original")
    os.makedirs(d)
    state = original_layout_state(hf, cfg)
    names = sorted(state)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: state[k].contiguous() for k in part}, os.path.join(d, fn))
        weight_map.update({k: fn for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    text = cfg.to_dict()
    # the Hub config: VL wrapper, legacy spellings for the layer plan
    text["sparse_attention_config"] = {
        "sparse_attention_freq": [int(t == "minimax_m3_sparse") for t in text.pop("layer_types")],
        "sparse_num_index_heads": text.pop("index_n_heads"), "sparse_index_dim": text.pop("index_head_dim"),
        "sparse_block_size": text.pop("index_block_size"), "sparse_topk_blocks": text.pop("index_topk_blocks"),
        "sparse_local_block": text.pop("index_local_blocks")}
    text["moe_layer_freq"] = [int(t == "sparse") for t in text.pop("mlp_layer_types")]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"model_type": "minimax_m3_vl", "text_config": text}, f)
    return d


@pytest.fixture(scope="module", params=[0, 1])
def reference(request, tmp_path_factory):
    seed = request.param
    cfg = hf_config(seed)
    hf = hf_model(cfg, seed)
    tmp = tmp_path_factory.mktemp(f"hf{seed}")
    tf_dir = str(tmp / "transformers")
    hf.save_pretrained(tf_dir, max_shard_size="200KB")
    assert len([f for f in os.listdir(tf_dir) if f.endswith(".safetensors")]) > 1  # really sharded
    orig_dir = write_original(tmp, hf, cfg)
    ids = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    return dict(cfg=cfg, hf=hf, dirs={"transformers": tf_dir, "original": orig_dir}, ids=ids, ref=ref)


@pytest.mark.parametrize("layout", ["transformers", "original"])
def test_logits_match_transformers(reference, layout):
    model, report = load_model(reference["dirs"][layout], progress=False)
    assert report.layout == layout
    out = ours_logits(model, reference["ids"])
    ref = reference["ref"]
    err = (out - ref).abs().max().item()
    assert err < 1e-4 * max(1.0, ref.abs().max().item()), err
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def test_block_selection_changes_the_result(reference):
    """With top-k >= all blocks the same weights give dense attention: the logits must differ,
    otherwise the parity above would not exercise the sparse path."""
    cfg = reference["cfg"]
    dense_cfg = hf_config(0, **{k: getattr(cfg, k) for k in ("num_key_value_heads", "num_attention_heads",
                                                               "index_n_heads")}, index_topk_blocks=10_000)
    dense = MiniMaxM3VLForCausalLM(dense_cfg).eval()
    dense.load_state_dict(reference["hf"].state_dict())
    with torch.no_grad():
        dense_logits = dense(reference["ids"][None]).logits[0]
    diff = (dense_logits - reference["ref"]).abs().max().item()
    assert diff > 1e-2, f"sparse selection made no difference ({diff})"
    # and ours follows the sparse reference, not the dense one
    model, _ = load_model(reference["dirs"]["transformers"], progress=False)
    out = ours_logits(model, reference["ids"])
    assert (out - reference["ref"]).abs().max() < (out - dense_logits).abs().max() / 100


def test_greedy_tokens_match_transformers_generate(reference):
    ids = reference["ids"]
    with torch.no_grad():
        hf_out = reference["hf"].generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, min_new_tokens=12)
    want = hf_out[0, ids.numel():].tolist()
    for layout in ("transformers", "original"):
        llm = LLM(model=reference["dirs"][layout], device="cpu", dtype="float32")
        got = llm.generate([ids.tolist()], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
        assert got.token_ids == want, layout


def test_engine_batch_with_chunked_prefill_and_preemption_matches_transformers_generate(reference):
    """The oracle for the engine itself (the engine tests in tests/unit compare it with the same model run
    unpaged): a batch of four prompts under a 16-token budget (chunked prefill, mixed steps) and a pool too small
    for all of them (preemption and recompute) gives, per prompt, transformers' greedy tokens (fp32)."""
    from m3serve.config import EngineConfig
    from m3serve.engine.llm_engine import LLMEngine

    cfg, hf = reference["cfg"], reference["hf"]
    g = torch.Generator().manual_seed(11)
    prompts = [reference["ids"].tolist()] + [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist()
                                             for n in (30, 17, 9)]
    new = 12
    want = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
    eng = LLMEngine(EngineConfig(model=reference["dirs"]["transformers"], device="cpu", dtype="float32",
                                 max_model_len=64, max_num_batched_tokens=16, num_gpu_blocks_override=20))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p,
                        sampling_params=SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    got = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    st = eng.stats()
    assert st["num_preemptions"] > 0 and st["num_chunked_prefills"] > 0 and st["num_mixed_steps"] > 0, st
