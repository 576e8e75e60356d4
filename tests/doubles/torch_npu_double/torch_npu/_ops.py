"""TEST DOUBLE of torch_npu's fused operators: strict argument checks, CPU math.

Each check mirrors a documented constraint of the real operator (torch_npu API
reference, "ptaoplist" pages for npu_fusion_attention, npu_rms_norm,
npu_rotary_mul, npu_swiglu). A call outside the contract raises, as the real
operator would refuse it (or, worse, silently compute something else).
"""

from __future__ import annotations

import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INT_MAX = 2147483647
COMPRESSED = 2048


class ContractError(RuntimeError):
    """An argument outside the operator's documented contract."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ContractError(message)


# --- npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd) --------------------------------
def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    _require(isinstance(x, torch.Tensor) and isinstance(gamma, torch.Tensor), "npu_rms_norm: x and gamma must be tensors")
    _require(x.dtype in FLOATS, f"npu_rms_norm: x dtype {x.dtype} not in fp16/bf16/fp32")
    _require(gamma.dtype == x.dtype, f"npu_rms_norm: gamma dtype {gamma.dtype} must match x dtype {x.dtype}")
    _require(1 <= gamma.dim() <= x.dim() and tuple(gamma.shape) == tuple(x.shape[x.dim() - gamma.dim():]),
             f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must equal the trailing dims of x {tuple(x.shape)}")
    _require(isinstance(epsilon, float), f"npu_rms_norm: epsilon must be a float, found {type(epsilon).__name__}")
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    y = (xf * rstd * gamma.float()).to(x.dtype)
    return y, rstd


# --- npu_rotary_mul(input, r1, r2, rotary_mode="half") ---------------------------------
def npu_rotary_mul(input: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half"):
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul: input, r1 and r2 must be 4-D")
    _require(input.dtype in FLOATS and r1.dtype == input.dtype and r2.dtype == input.dtype,
             "npu_rotary_mul: input, r1, r2 must share one dtype of fp16/bf16/fp32")
    _require(rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', found {rotary_mode!r}")
    a, b, c, d = input.shape
    _require(d % 2 == 0 and d < 896, f"npu_rotary_mul: D={d} must be even and < 896")
    _require(r1.shape == r2.shape, "npu_rotary_mul: r1 and r2 must have the same shape")
    allowed = {
        (1, 1, c, d), (a, 1, c, d), (a, b, c, d),  # input BNSD: 11SD, B1SD, BNSD
        (1, b, 1, d), (a, b, 1, d),  # input BSND: 1S1D, BS1D
        (a, 1, 1, d),  # input SBND: S11D (SB1D and SBND coincide with shapes above)
    }
    _require(tuple(r1.shape) in allowed, f"npu_rotary_mul: r1 shape {tuple(r1.shape)} does not match a supported layout of input {tuple(input.shape)}")
    if rotary_mode == "half":
        x1, x2 = input.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = input[..., ::2], input[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return input * r1 + rotated * r2


# --- npu_swiglu(input, dim=-1) ----------------------------------------------------------
def npu_swiglu(input: torch.Tensor, dim: int = -1):
    _require(1 <= input.dim() <= 8 and input.numel() > 0, "npu_swiglu: input must be 1-8 dims and not empty")
    _require(input.is_contiguous(), "npu_swiglu: non-contiguous input is not supported")
    _require(input.dtype in FLOATS, f"npu_swiglu: dtype {input.dtype} not in fp16/bf16/fp32")
    _require(-input.dim() <= dim < input.dim() and input.shape[dim] % 2 == 0, f"npu_swiglu: size of dim {dim} must be even")
    a, b = input.chunk(2, dim=dim)  # A = first half (swish), B = second half
    return (torch.nn.functional.silu(a.float()) * b.float()).to(input.dtype)


# --- npu_fusion_attention ---------------------------------------------------------------
def _to_bnsd(t: torch.Tensor, layout: str, head_num: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.reshape(b, s, head_num, h // head_num).transpose(1, 2)
    if layout == "SBH":
        s, b, h = t.shape
        return t.reshape(s, b, head_num, h // head_num).permute(1, 2, 0, 3)
    raise ContractError(f"npu_fusion_attention: the double does not implement input_layout {layout!r}")


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def npu_fusion_attention(
    query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
    scale=1.0, keep_prob=1.0, pre_tockens=INT_MAX, next_tockens=INT_MAX, inner_precise=0,
    prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
    gen_mask_parallel=True, sync=False,
):
    _require(input_layout in ("BSH", "SBH", "BSND", "BNSD", "TND"), f"npu_fusion_attention: unknown input_layout {input_layout!r}")
    _require(isinstance(head_num, int) and not isinstance(head_num, bool) and head_num > 0, f"npu_fusion_attention: head_num must be a positive int, found {head_num!r}")
    _require(query.dtype in FLOATS and key.dtype == query.dtype and value.dtype == query.dtype, "npu_fusion_attention: q, k, v must share one dtype of fp16/bf16/fp32")
    dims = 3 if input_layout in ("BSH", "SBH") else 4
    _require(query.dim() == key.dim() == value.dim() == dims, f"npu_fusion_attention: layout {input_layout} needs {dims}-D q, k, v")
    if input_layout == "BNSD":
        _require(query.shape[1] == head_num, f"npu_fusion_attention: head_num={head_num} but query (BNSD) has N={query.shape[1]}")
    elif input_layout == "BSND":
        _require(query.shape[2] == head_num, f"npu_fusion_attention: head_num={head_num} but query (BSND) has N={query.shape[2]}")
    else:
        _require(query.shape[-1] % head_num == 0, f"npu_fusion_attention: H={query.shape[-1]} not divisible by head_num={head_num}")
    _require(isinstance(scale, float), f"npu_fusion_attention: scale must be a float, found {type(scale).__name__}")
    _require(pse is None and padding_mask is None and prefix is None, "npu_fusion_attention: the double implements no pse/padding_mask/prefix")
    _require(keep_prob == 1.0, "npu_fusion_attention: the double implements no dropout (keep_prob must be 1.0)")
    _require(sparse_mode in (0, 1, 2, 3, 4), f"npu_fusion_attention: sparse_mode must be 0..4 (for this double), found {sparse_mode!r}")
    _require(sparse_mode != 4, "npu_fusion_attention: the double does not implement band mode (sparse_mode 4)")

    q = _to_bnsd(query, input_layout, head_num)
    if input_layout in ("BSH", "SBH"):
        kv_heads = key.shape[-1] // (query.shape[-1] // head_num)
    else:
        kv_heads = key.shape[1 if input_layout == "BNSD" else 2]
    k = _to_bnsd(key, input_layout, kv_heads)
    v = _to_bnsd(value, input_layout, kv_heads)
    b, n, sq, d = q.shape
    _require(k.shape[0] == b and k.shape[3] == d and k.shape == v.shape, "npu_fusion_attention: key/value shapes do not match query")
    _require(n % k.shape[1] == 0, f"npu_fusion_attention: query heads {n} must be a multiple of key heads {k.shape[1]}")
    if k.shape[1] != n:
        rep = n // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    sk = k.shape[2]

    blocked = torch.zeros(sq, sk, dtype=torch.bool)
    if atten_mask is not None:
        _require(atten_mask.dtype in (torch.bool, torch.uint8), f"npu_fusion_attention: atten_mask must be bool or uint8 (1 = masked out), found {atten_mask.dtype}")
    if sparse_mode in (2, 3):
        _require(atten_mask is not None and tuple(atten_mask.shape) == (COMPRESSED, COMPRESSED),
                 f"npu_fusion_attention: sparse_mode {sparse_mode} needs the compressed {COMPRESSED}x{COMPRESSED} atten_mask")
        expected = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool).triu(1)
        _require(bool((atten_mask.bool().cpu() == expected).all()), "npu_fusion_attention: the compressed mask must be triu(ones(2048, 2048), 1) (True above the diagonal)")
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(sk).unsqueeze(0)
        blocked = j > i if sparse_mode == 2 else j > i + (sk - sq)
    elif atten_mask is not None:
        allowed_shapes = {(sq, sk), (1, 1, sq, sk), (b, 1, sq, sk), (b, n, sq, sk)}
        _require(tuple(atten_mask.shape) in allowed_shapes,
                 f"npu_fusion_attention: atten_mask shape {tuple(atten_mask.shape)} is not SS, 11SS, B1SS or BNSS for B={b}, N={n}, Sq={sq}, Skv={sk}")
        blocked = atten_mask.bool()
        if sparse_mode == 0 and (pre_tockens < INT_MAX or next_tockens < INT_MAX):
            i = torch.arange(sq).unsqueeze(1)
            j = torch.arange(sk).unsqueeze(0)
            blocked = blocked | (j > i + next_tockens) | (i > j + pre_tockens)
    elif sparse_mode == 1:
        raise ContractError("npu_fusion_attention: sparse_mode 1 (allMask) needs an atten_mask")

    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    scores = scores.masked_fill(blocked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # rows with nothing to attend: zeros
    out = _from_bnsd(torch.matmul(probs, v.float()).to(query.dtype), input_layout)
    softmax_max = row_max.expand(b, n, sq, 8).contiguous()
    softmax_sum = torch.ones(b, n, sq, 8)
    return out, softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype), 0, 0, 0
