"""The MoE layer of MiniMax-M3 on the device: router, routed experts (NVFP4 or MXFP8), shared expert, combine.

``fused_moe(x, router_weight, correction_bias, weights, top_k, routed_scaling, alpha, limit)`` equals
`m3serve.model.layers.moe.SparseMoE.forward` (within bf16 rounding): ``experts(x) * routed_scaling + shared(x)``, the
routed weights renormalised to sum to 1. Launches (no host synchronisation, fixed grids: capturable in a CUDA graph):

1. router logits (`moe_router`), 2. top-k + grouping by expert (`moe_router`),
3. gate_up + SwiGLU-OAI for every (token, expert) assignment; the routing weight times ``routed_scaling`` is
   applied here (the down projection is linear),
4. down projection, one fp32 row per assignment,
5. combine: the top_k rows of each token plus its shared row -> ``[T, H]`` in x's dtype.

Expert parallelism (``first_expert``): the weights hold experts [first_expert, first_expert + n) of the router's E.
The router still picks among all E; the expert GEMMs take only the local experts' buckets (`Routing.local`: ids
remapped by the offset), and the combine skips the other assignments (their rows are never written), so the output
is this rank's partial sum, which the ranks' all-reduce completes. Still no host synchronisation.

The shared expert (gate_up, down; one fp32 row per token) rides in the launches 3-4 (no extra pass over the
activations, no extra launch) when its intermediate pads to the routed experts' (one K loop and one gate width
serve both). It needs no routing, so `MoEStep` can also run it in two launches of its own: on a side stream
overlapped with 1-4 (fork / join, capturable in a CUDA graph; ``tuned(moe_overlap=True)``, not yet measured on the
H200), and always when its intermediate differs from the routed one, as on an expert-parallel rank (whole routed
experts of 3072, the shared expert's TP slice of 768 at EP4): padding the shared expert to the routed width would
hold and read 4x its bytes.

Steps 3-4 run the mma kernels (`grouped_gemm_mma`, decoded weights as the mma's M side) on sm_89/sm_90 for
decode-sized steps, the portable ``tl`` kernels (`grouped_gemm`) elsewhere (interpreter, ROCm, prefill-sized
steps), and at the largest steps `dequant_gemm` (experts decoded once to bf16, rows sorted by expert,
``torch._grouped_mm``; one host synchronisation); `dispatch.moe_config` picks the path and tile shapes by token
count (its table: `dispatch.MOE_TABLE`).
Weights are laid out once by `moe_prepare` (`weight_layout`): gate and up rows each padded to ``inter_pad`` (a
multiple of 128) for the routed experts and ``shared_inter_pad`` for the shared expert, the down projections' K
likewise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import dispatch
from .dequant_gemm import dense_grouped_gemm
from .grouped_gemm import MODE_DOWN, MODE_GATE_UP, grouped_gemm, work_dtype
from .moe_router import Routing, route, route_ref, to_x8, to_x8_ref, to_x16
from .codecs import FMT_DENSE, cast_to
from .weight_layout import CHUNK_K, PackedWeight, concat_rows, pack_quant_weight, round_up, unpack


@dataclass
class MoEWeights:
    """Experts laid out for the kernels (see `moe_prepare`)."""
    gate_up: PackedWeight  # [E] x [2 inter_pad, H]: gate rows [0, inter_pad), up rows [inter_pad, 2 inter_pad)
    down: PackedWeight  # [E] x [H, inter_pad]
    shared_gate_up: PackedWeight | None  # [1] x [2 shared_inter_pad, H]
    shared_down: PackedWeight | None  # [1] x [H, shared_inter_pad]
    inter_pad: int
    hidden: int
    shared_inter_pad: int = 0  # 0: no shared expert

    @property
    def n_experts(self) -> int:
        return self.gate_up.groups

    @property
    def shared_rides(self) -> bool:
        """The shared expert's tiles can ride in the routed launches (same padded intermediate)."""
        return self.shared_gate_up is not None and self.shared_inter_pad == self.inter_pad

    def expert_bytes(self) -> int:
        return self.gate_up.bytes_per_group() + self.down.bytes_per_group()

    def shared_bytes(self) -> int:
        return sum(w.nbytes() for w in (self.shared_gate_up, self.shared_down) if w is not None)


def _gate_up(qw, inter: int, inter_pad: int, dtype) -> PackedWeight:
    halves = [pack_quant_weight(qw, slice(0, inter), dtype), pack_quant_weight(qw, slice(inter, 2 * inter), dtype)]
    return concat_rows(halves, inter_pad)


def _down(qw, inter_pad: int, dtype) -> PackedWeight:
    w = pack_quant_weight(qw, None, dtype)
    if w.k_pad == inter_pad:
        return w
    raise ValueError(f"down projection K {w.k} pads to {w.k_pad}, not to the common intermediate {inter_pad}")


def moe_prepare(gate_up, down, shared_gate_up=None, shared_down=None, dtype: torch.dtype = torch.bfloat16
                ) -> MoEWeights:
    """`QuantWeight`s of the routed experts (``gate_up`` [E, 2 I, H] gate rows first, ``down`` [E, H, I]) and of the
    shared expert (``[2 I_s, H]``, ``[H, I_s]``; optional) -> `MoEWeights`. Formats: nvfp4 / mxfp8 / fp8 / dense
    (dense kept in ``dtype``). Done once at load time; the checkpoint tensors are not kept."""
    inter = gate_up.n // 2
    inter_s = shared_gate_up.n // 2 if shared_gate_up is not None else 0
    inter_pad, s_pad = round_up(inter, CHUNK_K), round_up(inter_s, CHUNK_K)
    if down.k != inter or (shared_down is not None and shared_down.k != inter_s):
        raise ValueError("down projections must take the gate_up's intermediate size")
    gu = _gate_up(gate_up, inter, inter_pad, dtype)
    dn = _down(_padded_k(down, inter_pad), inter_pad, dtype)
    sgu = sdn = None
    if shared_gate_up is not None:
        sgu = _gate_up(shared_gate_up, inter_s, s_pad, dtype)
        sdn = _down(_padded_k(shared_down, s_pad), s_pad, dtype)
    return MoEWeights(gu, dn, sgu, sdn, inter_pad, gate_up.k, s_pad)


class _KPadded:
    """A `QuantWeight` view whose K is zero-padded to ``k`` (the down projections' K = the common intermediate)."""

    def __init__(self, qw, k: int):
        self.fmt, self.n, self.k = qw.fmt, qw.n, k
        pad = k - qw.k
        z = lambda t, per: torch.nn.functional.pad(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                                                   (0, pad // per))
        if qw.fmt == "nvfp4":
            self.packed, self.scale_2 = z(qw.packed, 2), qw.scale_2
            self.block_scale = z(qw.block_scale, 16).view(torch.float8_e4m3fn)
        elif qw.fmt in ("mxfp8", "fp8"):
            self.qweight = z(qw.qweight, 1).view(torch.float8_e4m3fn)
            if qw.fmt == "mxfp8":
                self.scale_e8m0 = torch.nn.functional.pad(qw.scale_e8m0, (0, pad // 32), value=127)
            else:
                self.scale = qw.scale
        else:
            self.weight = torch.nn.functional.pad(qw.weight, (0, pad))


def _padded_k(qw, k: int):
    return qw if qw.k == k else _KPadded(qw, k)


def moe_prepare_module(moe, dtype: torch.dtype | None = None) -> MoEWeights:
    """`MoEWeights` of a `SparseMoE` module (its experts, and its shared expert)."""
    ex, sh = moe.experts, moe.shared_experts
    return moe_prepare(ex.gate_up_proj, ex.down_proj, sh.gate_up_proj.w, sh.down_proj.w,
                       dtype or ex.gate_up_proj.dtype)


# ----------------------------------------------------------------------------------------------------- combine
@triton.jit(do_not_specialize=["T", "A", "e_lo", "e_hi"])
def _combine_kernel(y_ptr, out_ptr, so, T, H, A, ids_ptr, e_lo, e_hi, TOPK: tl.constexpr, SHARED: tl.constexpr,
                    LOCAL: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    m = h < H
    acc = tl.zeros((BH,), tl.float32)
    for j in tl.static_range(TOPK):
        mj = m
        if LOCAL:  # expert parallel: only assignments to this rank's experts [e_lo, e_hi) have rows
            e = tl.load(ids_ptr + t * TOPK + j)
            mj = m & (e >= e_lo) & (e < e_hi)
        acc += tl.load(y_ptr + (t * TOPK + j).to(tl.int64) * H + h, mask=mj, other=0.0)
    if SHARED:
        acc += tl.load(y_ptr + (A + t).to(tl.int64) * H + h, mask=m, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * so + h, cast_to(acc, out_ptr.dtype.element_ty), mask=m)


def combine(y: torch.Tensor, T: int, top_k: int, shared: bool, out: torch.Tensor,
            local: tuple[torch.Tensor, int, int] | None = None) -> torch.Tensor:
    """out[t] = sum_j y[t * top_k + j] + (y[T * top_k + t] if shared), in out's dtype. ``local`` = (ids [T, top_k],
    first, stop): only the assignments to experts [first, stop) count (expert parallelism)."""
    if T:
        H = y.shape[1]
        bh = min(1024, triton.next_power_of_2(H))
        ids, lo, hi = local if local is not None else (y, 0, 0)
        _combine_kernel[(T, triton.cdiv(H, bh))](y, out, out.stride(0), T, H, T * top_k, ids, lo, hi, TOPK=top_k,
                                                SHARED=shared, LOCAL=local is not None, BH=bh, num_warps=4)
    return out


# ------------------------------------------------------------------------------------------------------- layer
_SIDE_STREAMS: dict = {}


def _side_stream(device: torch.device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[key]


def _wg16(path: str, cfg: dict) -> bool:
    """Whether a launch of this path and gate_up config takes fp16 activations in the wg16 order (and writes the
    intermediate in it): the portable kernel's ``wg16`` tiles."""
    return path == "tl" and bool(cfg.get("wg16"))


def _fp8_input(path: str, cfg: dict, x: torch.Tensor, k_pad: int, wg16: bool) -> tuple | None:
    """(e4m3 x, {"xs": its row scales}) for a launch of the portable kernel's ``a8`` tiles (`moe_router.to_x8`; in the
    wg16 order where ``wg16`` asks for it), else None."""
    if path != "tl" or not cfg.get("a8"):
        return None
    x8, xs = to_x8(x, k_pad, wg16=wg16)
    return x8, dict(xs=xs)


class MoEStep:
    """One layer call split into its launches, buffers allocated up front: `fused_moe` runs them (`run`), benchmarks
    time them one by one. The shared expert's tiles ride in the routed launches (`gate_up`, `down`) when it has the
    routed experts' padded intermediate; otherwise (an expert-parallel rank), or with ``Tuning.moe_overlap`` (CUDA),
    it runs in two launches of its own (`shared_expert`: gate_up into its own intermediate buffer, then down), with
    its own dispatch row (`dispatch.moe_shared_config`); overlapped, on a side stream with the router and the routed
    experts, `combine` joining them (not yet measured on the H200: off by default). Path and tile shapes:
    `dispatch.moe_config`. ``first_expert``: the weights are experts [first_expert, first_expert + n) of the
    router's (expert parallelism, see the module doc)."""

    def __init__(self, x, router_weight, correction_bias, weights: MoEWeights, *, top_k: int, routed_scaling: float,
                 alpha: float, limit: float, out: torch.Tensor | None = None, first_expert: int = 0):
        if x.dim() != 2 or x.shape[1] != weights.hidden:
            raise ValueError(f"x must be [T, {weights.hidden}], got {tuple(x.shape)}")
        n_router = router_weight.shape[0]
        if not 0 <= first_expert <= n_router - weights.n_experts:
            raise ValueError(f"experts [{first_expert}, {first_expert + weights.n_experts}) outside the router's "
                             f"{n_router}")
        self.first = first_expert
        self.ep = weights.n_experts != n_router  # this rank holds some of the router's experts
        self.x, self.rw, self.bias, self.w = x, router_weight, correction_bias, weights
        self.top_k, self.scaling, self.alpha, self.limit = top_k, routed_scaling, alpha, limit
        T = self.T = x.shape[0]
        self.out = torch.empty_like(x) if out is None else out
        self.path, self.gu_cfg, self.dn_cfg = dispatch.moe_config(T, weights, x.device)
        self.shared = weights.shared_gate_up is not None
        self.overlap = self.shared and x.is_cuda and dispatch.tuning().moe_overlap
        self.apart = self.shared and (self.overlap or not weights.shared_rides)  # its own launches
        self.A = T * top_k
        dev = x.device
        self.x16 = None  # the route's fp16 copy of x for the mma kernels
        if self.path == "mma":
            self.x16 = torch.empty(T, weights.gate_up.k_pad, dtype=torch.float16, device=dev)
        self.xwg = None  # x in the wg16 order for the portable kernel's wg16 tiles (made by `gate_up`)
        rows = self.A + (T if self.shared and not self.apart else 0)
        self.inter = torch.empty(rows, weights.inter_pad, dtype=self._inter_dtype(self.path, self.gu_cfg),
                                 device=dev)
        self.inter_s = None  # the shared expert's intermediate in its own launches (made on first use otherwise)
        if self.shared:
            self.s_path, self.s_gu_cfg, self.s_dn_cfg = dispatch.moe_shared_config(T, weights, dev)
        if self.apart:
            self._shared_buffer()
        self.y = torch.empty(self.A + (T if self.shared else 0), weights.hidden, dtype=torch.float32, device=dev)
        self.routing: Routing | None = None
        self.local: Routing | None = None  # the routing of the experts this rank holds (all of them without EP)

    def _inter_dtype(self, path: str, cfg: dict) -> torch.dtype:
        return torch.float16 if path == "mma" or _wg16(path, cfg) else _torch_dtype(work_dtype(self.x))

    def _shared_buffer(self) -> torch.Tensor:
        if self.inter_s is None:
            self.inter_s = torch.empty(self.T, self.w.shared_inter_pad, dtype=self._inter_dtype(self.s_path,
                                                                                                self.s_gu_cfg),
                                       device=self.x.device)
        return self.inter_s

    def route(self):
        self.routing = route(self.x, self.rw, self.bias, self.top_k, x16=self.x16, h_pad=self.w.gate_up.k_pad)
        self.local = self.routing.local(self.first, self.w.n_experts) if self.ep else self.routing

    def _gemm(self, path: str, mode: int, src, out, **kw):
        if path == "dense":
            launch = dense_grouped_gemm
        else:
            launch = dispatch.gemm_mma_kernels().grouped_gemm_mma if path == "mma" else grouped_gemm
        launch(src, out, mode, routing=self.local, T=self.T, **kw)

    def gate_up(self):
        w, rides = self.w, self.shared and not self.apart
        fp8, kw = _fp8_input(self.path, self.gu_cfg, self.x, w.gate_up.k_pad, _wg16(self.path, self.gu_cfg)), {}
        if fp8 is not None:
            src, kw = fp8
        elif _wg16(self.path, self.gu_cfg):
            self.xwg = src = to_x16(self.x, w.gate_up.k_pad, wg16=True)
        else:
            src = self.x if self.x16 is None else self.x16
        self._gemm(self.path, MODE_GATE_UP, src, self.inter,
                   routed=w.gate_up, plain=w.shared_gate_up if rides else None, x_div=self.top_k, out_off=self.A,
                   ng=w.inter_pad, scaling=self.scaling, alpha=self.alpha, limit=self.limit, **self.gu_cfg, **kw)

    def down(self):
        rides = self.shared and not self.apart
        src, kw = _fp8_input(self.path, self.dn_cfg, self.inter, self.w.inter_pad, False) or (self.inter, {})
        self._gemm(self.path, MODE_DOWN, src, self.y, routed=self.w.down,
                   plain=self.w.shared_down if rides else None, x_off=self.A, out_off=self.A, **self.dn_cfg, **kw)

    def shared_expert(self):
        """The shared expert alone, into rows [A, A + T) of y. Its fp16 activations on the mma path or in wg16 tiles:
        the routed launches' copy when it runs after them and they made one in that order, else its own
        (overlapped: no wait for the router)."""
        w = self.w
        wg16 = _wg16(self.s_path, self.s_gu_cfg)
        fp8, kw = _fp8_input(self.s_path, self.s_gu_cfg, self.x, w.shared_gate_up.k_pad, wg16), {}
        if fp8 is not None:
            src, kw = fp8
        elif self.s_path != "mma" and not wg16:
            src = self.x
        elif not self.overlap and (self.xwg if wg16 else self.x16) is not None:
            src = self.xwg if wg16 else self.x16
        else:
            src = to_x16(self.x, w.shared_gate_up.k_pad, wg16=wg16)
        inter = self._shared_buffer()
        self._gemm(self.s_path, MODE_GATE_UP, src, inter, plain=w.shared_gate_up, ng=w.shared_inter_pad,
                   alpha=self.alpha, limit=self.limit, **self.s_gu_cfg, **kw)
        src, kw = _fp8_input(self.s_path, self.s_dn_cfg, inter, w.shared_inter_pad, False) or (inter, {})
        self._gemm(self.s_path, MODE_DOWN, src, self.y, plain=w.shared_down, out_off=self.A, **self.s_dn_cfg, **kw)

    def combine(self) -> torch.Tensor:
        local = (self.routing.ids, self.first, self.first + self.w.n_experts) if self.ep else None
        return combine(self.y, self.T, self.top_k, self.shared, self.out, local)

    def run(self) -> torch.Tensor:
        if self.T == 0:
            return self.out
        if self.overlap:
            main, side = torch.cuda.current_stream(self.x.device), _side_stream(self.x.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self.shared_expert()
        self.route()
        self.gate_up()
        self.down()
        if self.overlap:
            main.wait_stream(side)
        elif self.apart:
            self.shared_expert()
        return self.combine()


def fused_moe(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, weights: MoEWeights, *,
              top_k: int, routed_scaling: float, alpha: float, limit: float, out: torch.Tensor | None = None,
              routing_out: list | None = None, first_expert: int = 0) -> torch.Tensor:
    """The whole MoE layer: x [T, H] -> [T, H] (x's dtype, or written into ``out``). ``router_weight`` [E, H]
    fp32 and ``correction_bias`` [E] as the model holds them; ``routing_out``, when given, receives the `Routing`
    (tests). ``weights`` may hold experts [first_expert, first_expert + n) of the E alone (expert parallelism: the
    output is then this rank's partial sum). Launch choices (path, tiles, the shared expert's stream):
    `dispatch.tuning`; benchmarks vary them with `dispatch.tuned`."""
    step = MoEStep(x, router_weight, correction_bias, weights, top_k=top_k, routed_scaling=routed_scaling,
                   alpha=alpha, limit=limit, out=out, first_expert=first_expert)
    y = step.run()
    if routing_out is not None and step.routing is not None:
        routing_out.append(step.routing)
    return y


def _torch_dtype(t):
    return {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}[t]


def _e4m3_rows(t: torch.Tensor) -> torch.Tensor:
    """t's rows as the a8 tiles see them (`moe_router.to_x8_ref`): rounded to e4m3 times 448 / each row's largest
    |value|, scaled back, fp32."""
    x8, xs = to_x8_ref(t, t.shape[1])
    return x8.float() * xs[:, None]


def fused_moe_ref(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, weights: MoEWeights, *,
                  top_k: int, routed_scaling: float, alpha: float, limit: float,
                  routing: Routing | None = None, first_expert: int = 0, a8: bool = False) -> torch.Tensor:
    """Torch reference in fp32 on the packed weights (same math as `SparseMoE.forward`). With ``routing`` the
    kernel's expert choice is used (so near-tie flips of the top-k do not count as errors). ``first_expert``: as
    `fused_moe` (only the assignments to the experts the weights hold count). ``a8``: the arithmetic of the ``a8``
    tiles (`Tuning.a8`): each GEMM's activations rounded to e4m3 per row, the quantized weights to e4m3 as the tiles
    round them (`unpack(..., e4m3=True)`); where a weight is dense dispatch drops a8, and so does this."""
    packed = (weights.gate_up, weights.down, weights.shared_gate_up, weights.shared_down)
    a8 = a8 and all(p.fmt != FMT_DENSE for p in packed if p is not None)
    if routing is not None:
        w, idx = routing.weights.float(), routing.ids.long()
    else:
        w, idx, _ = route_ref(x, router_weight, correction_bias, top_k)
    xf = x.float()
    out = torch.zeros_like(xf)
    h = weights.hidden
    rows = _e4m3_rows if a8 else (lambda t: t)

    def ffn(xs, g_u, d):
        g_u, d = (unpack(p, j, e4m3=a8) for p, j in (g_u, d))
        ip = g_u.shape[0] // 2
        z = rows(xs) @ g_u[:, :h].T
        g, u = z[:, :ip].clamp(max=limit), z[:, ip:].clamp(-limit, limit)
        return rows((u + 1.0) * (g * torch.sigmoid(alpha * g))) @ d.T

    for e in torch.unique(idx).tolist():
        if not first_expert <= e < first_expert + weights.n_experts:
            continue
        tok, slot = torch.where(idx == e)
        j = e - first_expert
        y = ffn(xf[tok], (weights.gate_up, j), (weights.down, j))
        out.index_add_(0, tok, y[:, :h] * w[tok, slot, None])
    out = out * routed_scaling
    if weights.shared_gate_up is not None:
        out = out + ffn(xf, (weights.shared_gate_up, 0), (weights.shared_down, 0))[:, :h]
    return out.to(x.dtype)


__all__ = ["MoEWeights", "MoEStep", "moe_prepare", "moe_prepare_module", "fused_moe", "fused_moe_ref", "combine"]
