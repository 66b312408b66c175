"""The one-launch RMSNorm (kernels/rms_norm.py, the interpreter) against the model's torch form: row counts that do
not fill a block, widths that are not powers of two, heads as a middle dim, bf16 and fp32, a strided row view."""
import pytest
import torch

from m3serve.kernels.rms_norm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("shape", [(1, 96), (37, 256), (5, 3, 64), (19, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_torch_form(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], generator=g) * 0.1
    got, want = rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: a last-bit difference at most
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    # a mutation: without the (1 + w) offset the result is off
    assert not torch.allclose(rms_norm(x, w - 1.0, 1e-6).float(), want.float(), rtol=0.1, atol=0.1)


def test_rms_norm_of_a_row_view_and_a_bad_weight():
    g = torch.Generator().manual_seed(3)
    full = torch.randn(10, 384, generator=g)
    x = full[:, 128:256]  # rows of stride 384
    w = torch.zeros(128)
    assert torch.allclose(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-6)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm(x, torch.zeros(64), 1e-5)
