"""``grouped_mlp`` on the CPU: each MoE expert's whole SwiGLU MLP on its rows at once.

The reference runs three grouped GEMMs over all experts with SwiGLU in between, so SwiGLU
and its backward pass over whole-batch buffers ([assignments, ffn]: 8 MiB at 4,096 x 512
in float32) that no longer sit in cache. Here one autograd node loops over the groups and
runs a group's gate and up GEMMs, SiLU times up and the down GEMM back to back, while its
rows are in cache; its backward does the same per group. It keeps the gate and up
products only (SiLU and the product are recomputed per group in the backward, in cache),
one [assignments, ffn] buffer fewer than autograd's chain holds.

The products are those of ``silu(x W_g) * (x W_u) @ W_d`` through torch's own ops, and the
backward forms autograd's: ``dh = dy W_d^T``, ``du = dh * silu(g)``, ``dg =
silu_backward(dh * u, g)``, ``dx = dg W_g^T + du W_u^T``, each weight's gradient
``d(out)^T @ in`` as ``nn.Linear``'s. Float32 only, as the cpu backend's ``swiglu``: in
16-bit dtypes ``F.silu`` rounds at other points than the reference; not under autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _cpu(*ts) -> bool:
    return all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in ts)


def grouped_mlp_available(x, w_gate, w_up, w_down, offs) -> bool:
    ws = (w_gate, w_up, w_down)
    if not _cpu(x, *ws, offs) or x.dtype != torch.float32 or any(w.dtype != torch.float32 for w in ws):
        return False
    if x.dim() != 2 or any(w.dim() != 3 for w in ws) or offs.dtype != torch.int32 or offs.dim() != 1:
        return False
    groups, hidden, ffn = w_gate.shape
    if w_up.shape != w_gate.shape or w_down.shape[:2] != (groups, ffn) or offs.shape != (groups,) or groups == 0:
        return False
    # Every row in a group, as the reference's; under autocast the unfused GEMMs cast and this one would not.
    return x.shape[1] == hidden and int(offs[-1]) == x.shape[0] and not torch.is_autocast_enabled("cpu")


def _spans(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, spans):
        rows, ffn = x.shape[0], w_gate.shape[2]
        gate, up, y = x.new_empty(rows, ffn), x.new_empty(rows, ffn), x.new_empty(rows, w_down.shape[2])
        for e, (a, b) in enumerate(spans):
            if a < b:
                g = torch.mm(x[a:b], w_gate[e], out=gate[a:b])
                u = torch.mm(x[a:b], w_up[e], out=up[a:b])
                torch.mm(F.silu(g).mul_(u), w_down[e], out=y[a:b])
        ctx.save_for_backward(x, w_gate, w_up, w_down, gate, up)
        ctx.spans = spans
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, gate, up = ctx.saved_tensors
        need_x, need_g, need_u, need_d = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        groups, hidden, ffn = w_gate.shape
        # Weight gradients in nn.Linear's layout [groups, out, in], handed back as the views' shapes.
        dwg = x.new_empty(groups, ffn, hidden) if need_g else None
        dwu = x.new_empty(groups, ffn, hidden) if need_u else None
        dwd = x.new_empty(groups, w_down.shape[2], ffn) if need_d else None
        dx = x.new_empty(x.shape) if need_x else None
        for e, (a, b) in enumerate(ctx.spans):
            if a == b:
                for dw in (dwg, dwu, dwd):
                    if dw is not None:
                        dw[e].zero_()
                continue
            xs, dys, g, u = x[a:b], dy[a:b], gate[a:b], up[a:b]
            s = F.silu(g)
            if need_d:
                torch.mm(dys.t(), s * u, out=dwd[e])
            dh = torch.mm(dys, w_down[e].t())
            du = dh * s
            dg = torch.ops.aten.silu_backward(dh.mul_(u), g)
            if need_g:
                torch.mm(dg.t(), xs, out=dwg[e])
            if need_u:
                torch.mm(du.t(), xs, out=dwu[e])
            if need_x:
                torch.mm(dg, w_gate[e].t(), out=dx[a:b]).add_(torch.mm(du, w_up[e].t()))
        grads = [None if dw is None else dw.transpose(1, 2) for dw in (dwg, dwu, dwd)]
        return dx, *grads, None


def grouped_mlp(x, w_gate, w_up, w_down, offs):
    return _GroupedMLP.apply(x, w_gate, w_up, w_down, _spans(offs))
