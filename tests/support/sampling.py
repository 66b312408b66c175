"""The sampling-kernel check shared by the interpreter tests and the GPU tests."""
import torch

from m3serve.step_io import SamplingInput
from m3serve.executor.sampler import Sampler
from m3serve.kernels.sampling import sample_simple, sample_simple_ref, vocab_splits


def check_sampling_kernel(n, v, device="cpu", seed=0, splits=None):
    """``splits``: forced vocabulary splits (None: the kernel's rule). Rows 0, 3, 6.. are greedy. Row 0: a tie in
    one split; row 3: a tie across the first split boundary (the lower index, in the earlier split, wins); row 1
    (sampled): -inf over its first split and more; row 4: -inf only (token 0 and logprob NaN, as torch)."""
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, generator=g) * 3
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1
    chunk = vocab_splits(n, v, device, splits)[1]
    if n > 3 and chunk < v:
        logits[3, chunk - 1] = logits[3, chunk] = logits[3].max() + 1
    if n > 1:
        logits[1, :min(chunk + 3, v // 2)] = float("-inf")
    if n > 4:
        logits[4] = float("-inf")
    logits = logits.to(device)
    temperature = torch.where(torch.arange(n) % 3 == 0, 0.0, torch.rand(n, generator=g) + 0.3).to(device)
    seeds = torch.randint(-2**63, 2**63 - 1, (n,), generator=g, dtype=torch.int64).to(device)
    positions = torch.randint(0, 1 << 20, (n,), generator=g).to(device)
    tok, lp = sample_simple(logits, temperature, seeds, positions, block=64 if v < 4096 else 2048, splits=splits)
    tok_r, lp_r = sample_simple_ref(logits, temperature, seeds, positions)
    assert tok[0] == 5
    if n > 3 and chunk < v:
        assert tok[3] == chunk - 1
    assert torch.equal(tok, tok_r)
    torch.testing.assert_close(lp, lp_r, rtol=1e-5, atol=1e-4, equal_nan=True)
    s = SamplingInput(temperature, torch.zeros(n, dtype=torch.int32, device=device),
                      torch.ones(n, device=device), torch.zeros(n, device=device), seeds, positions,
                      needs_top_p=True)  # a neutral top-p: the sampler's general torch path, not the kernel
    out = Sampler()(logits.clone(), s)  # draws the same tokens
    assert torch.equal(out.token_ids, tok)
