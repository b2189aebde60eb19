"""How fast an attention tile loop runs on this GPU with each tile shape, warps and stages: the question behind the
PaTH kernels' launches, asked without PaTH (issue 16).

    python benchmarks/tile_probe.py [--seq-len 4096] [--batch 4] [--heads 16] [--head-dim 64] [--out FILE]

PaTH's forward between superblocks and its backward sweep between superblocks (``triton/forward.py``,
``triton/backward_super.py``) are FlashAttention loops over ``[B, T, H, D]`` rows read through strides, with
64-row query and key tiles (the chunk), four warps and one stage. This script times the same two loops alone, full
(not causal: every query tile meets every key tile, so the work is ``4·B·H·T²·D`` FLOPs forward and 2.5× that
backward), bf16 operands and float32 accumulation, at each launch of :data:`FWD` and :data:`BWD`:

- forward: a program per (query tile of ``BM`` rows, head) walks the key tiles (``BN`` rows) with the online
  softmax;
- backward: a program per (key tile of ``BN`` rows, head) walks the query tiles (``BM`` rows): ``P`` from the saved
  log-sum-exp, ``dS = P (dP − Δ)``, ``dV``, ``dK`` kept, ``dQ`` by float32 atomic adds (FlashAttention-2's, and the
  sweep's); query-major (``S`` as ``BM × BN``, the sweep's orientation today) or key-major (``Sᵀ`` as ``BN × BM``,
  FlashAttention-2's Triton orientation, no transposes for ``dV`` and ``dK``);
- the backward's ``dQ`` alone (:data:`DQ`): a program per (query tile, head) walks the key tiles with ``S`` and ``dP``
  recomputed and no atomics (FlashAttention-2's Triton ``dQ`` kernel), which with a "no dQ" row is the other way to
  the gradient.

Each launch is first held to a float32 PyTorch reference at a small size, then timed by ``do_bench`` (median) with
SDPA (flash) on the same shapes in the same run. Prints a table (TFLOP/s, fastest first) and writes JSON.
``--device cpu`` runs a tiny case of every launch under ``TRITON_INTERPRET=1`` (the tests' smoke run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnkit.experiments.output import write_json  # noqa: E402
from attnkit.ops.common.triton_utils import interpreting  # noqa: E402
from attnkit.ops.common.utils import rel_rms  # noqa: E402

# (BM query rows, BN key rows, num_warps, num_stages); the first row is PaTH's launch today
FWD = [
    (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 1), (128, 64, 8, 2), (128, 64, 8, 3),
    (128, 128, 8, 2), (128, 64, 4, 2), (64, 128, 4, 2),
]  # fmt: skip
# (key-major, BN key rows, BM query rows, num_warps, num_stages, dQ by atomics); the first row is the sweep's today
BWD = [
    (False, 64, 64, 4, 1, True), (False, 64, 64, 4, 2, True), (True, 64, 64, 4, 1, True), (True, 64, 64, 4, 2, True),
    (True, 128, 64, 8, 1, True), (True, 128, 64, 8, 2, True), (True, 128, 64, 8, 3, True), (True, 128, 32, 8, 2, True),
    (True, 128, 32, 4, 2, True), (True, 64, 32, 4, 2, True), (True, 128, 128, 8, 2, True),
    (False, 64, 64, 4, 1, False), (True, 64, 64, 4, 2, False), (True, 128, 64, 8, 2, False),
    (True, 128, 32, 4, 2, False),
]  # fmt: skip
# (BM query rows, BN key rows, num_warps, num_stages) of the backward's dQ alone, query-major, no atomics
# (FlashAttention-2's Triton dQ kernel: S and dP recomputed, three products a pair): with a "no dQ" row of BWD, the
# other way to the gradient than the atomics
DQ = [(64, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 32, 4, 2)]


@triton.jit
def fwd_probe_kernel(q, k, v, o, T, scale, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """``o = softmax(scale · q kᵀ) v`` for one (query tile, head), ``[B, T, H, D]`` rows, online softmax."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, D)
    rows = i_b.to(tl.int64) * T + i_m * BM + tl.arange(0, BM)
    b_q = tl.load(q + rows[:, None] * (H * D) + i_h * D + o_d[None, :])
    b_max = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_sum = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, D], dtype=tl.float32)
    for j in range(0, T, BN):
        cols = i_b.to(tl.int64) * T + j + tl.arange(0, BN)
        b_k = tl.load(k + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
        b_v = tl.load(v + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale
        b_new = tl.maximum(b_max, tl.max(b_s, 1))
        b_p = tl.exp(b_s - b_new[:, None])
        b_r = tl.exp(b_max - b_new)
        b_sum = b_sum * b_r + tl.sum(b_p, 1)
        b_acc = b_acc * b_r[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)
        b_max = b_new
    tl.store(o + rows[:, None] * (H * D) + i_h * D + o_d[None, :], (b_acc / b_sum[:, None]).to(o.dtype.element_ty))


@triton.jit
def bwd_probe_kernel(
    q, k, v, do, lse, delta, dq, dk, dv, T, scale,
    H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, KEY_MAJOR: tl.constexpr,
    ATOMICS: tl.constexpr,
):  # fmt: skip
    """One (key tile, head) of the attention backward: ``dk``, ``dv`` written, ``dq`` (float32) added to by atomics
    when ``ATOMICS``. ``lse, delta [B, T, H]`` float32."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, D)
    cols = i_b.to(tl.int64) * T + i_n * BN + tl.arange(0, BN)
    b_k = tl.load(k + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
    b_v = tl.load(v + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
    b_dk = tl.zeros([BN, D], dtype=tl.float32)
    b_dv = tl.zeros([BN, D], dtype=tl.float32)
    for i in range(0, T, BM):
        rows = i_b.to(tl.int64) * T + i + tl.arange(0, BM)
        p_rows = rows[:, None] * (H * D) + i_h * D + o_d[None, :]
        b_q = tl.load(q + p_rows)
        b_do = tl.load(do + p_rows)
        b_lse = tl.load(lse + rows * H + i_h)
        b_delta = tl.load(delta + rows * H + i_h)
        if KEY_MAJOR:
            b_pt = tl.exp(tl.dot(b_k, tl.trans(b_q)) * scale - b_lse[None, :])  # [BN, BM]
            b_dst = b_pt * (tl.dot(b_v, tl.trans(b_do)) - b_delta[None, :])
            b_dv += tl.dot(b_pt.to(b_do.dtype), b_do)
            b_dk += tl.dot(b_dst.to(b_q.dtype), b_q)
            if ATOMICS:
                b_dq = tl.dot(tl.trans(b_dst.to(b_k.dtype)), b_k)
                tl.atomic_add(dq + p_rows, b_dq * scale, sem="relaxed")
        else:
            b_p = tl.exp(tl.dot(b_q, tl.trans(b_k)) * scale - b_lse[:, None])  # [BM, BN]
            b_ds = b_p * (tl.dot(b_do, tl.trans(b_v)) - b_delta[:, None])
            b_dv += tl.dot(tl.trans(b_p).to(b_do.dtype), b_do)
            b_dk += tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q)
            if ATOMICS:
                b_dq = tl.dot(b_ds.to(b_k.dtype), b_k)
                tl.atomic_add(dq + p_rows, b_dq * scale, sem="relaxed")
    p_cols = cols[:, None] * (H * D) + i_h * D + o_d[None, :]
    tl.store(dk + p_cols, b_dk * scale)
    tl.store(dv + p_cols, b_dv)


@triton.jit
def dq_probe_kernel(
    q, k, v, do, lse, delta, dq, T, scale, H: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr
):  # fmt: skip
    """One (query tile, head) of the attention backward's ``dq`` (float32, written), walking the key tiles."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, D)
    rows = i_b.to(tl.int64) * T + i_m * BM + tl.arange(0, BM)
    p_rows = rows[:, None] * (H * D) + i_h * D + o_d[None, :]
    b_q = tl.load(q + p_rows)
    b_do = tl.load(do + p_rows)
    b_lse = tl.load(lse + rows * H + i_h)
    b_delta = tl.load(delta + rows * H + i_h)
    b_dq = tl.zeros([BM, D], dtype=tl.float32)
    for j in range(0, T, BN):
        cols = i_b.to(tl.int64) * T + j + tl.arange(0, BN)
        b_k = tl.load(k + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
        b_v = tl.load(v + cols[:, None] * (H * D) + i_h * D + o_d[None, :])
        b_p = tl.exp(tl.dot(b_q, tl.trans(b_k)) * scale - b_lse[:, None])
        b_ds = b_p * (tl.dot(b_do, tl.trans(b_v)) - b_delta[:, None])
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k)
    tl.store(dq + p_rows, b_dq * scale)


def inputs(B: int, T: int, H: int, D: int, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x = {n: (torch.randn(B, T, H, D, generator=g) * (0.5 if n in "qk" else 1.0)) for n in ("q", "k", "v", "do")}
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


def reference(x: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """float32 forward, log-sum-exp, Δ and gradients, ``[B, T, H, *]``."""
    q, k, v, do = (x[n].float().transpose(1, 2) for n in ("q", "k", "v", "do"))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * scale
    o = s.softmax(-1) @ v
    o.backward(do)
    lse = s.logsumexp(-1)
    delta = (do * o).sum(-1)
    out = {"o": o, "dq": q.grad, "dk": k.grad, "dv": v.grad}
    out = {n: t.detach().transpose(1, 2) for n, t in out.items()}
    out.update(lse=lse.detach().transpose(1, 2).contiguous(), delta=delta.detach().transpose(1, 2).contiguous())
    return out


def run_fwd(x, scale, BM, BN, warps, stages):
    B, T, H, D = x["q"].shape
    o = torch.empty_like(x["q"])
    fwd_probe_kernel[(T // BM, B * H)](
        x["q"], x["k"], x["v"], o, T, scale, H=H, D=D, BM=BM, BN=BN, num_warps=warps, num_stages=stages
    )
    return o


def run_bwd(x, lse, delta, scale, key_major, BN, BM, warps, stages, atomics):
    B, T, H, D = x["q"].shape
    dq = torch.zeros(x["q"].shape, dtype=torch.float32, device=x["q"].device)
    dk = torch.empty(x["k"].shape, dtype=torch.float32, device=x["q"].device)
    dv = torch.empty_like(dk)
    bwd_probe_kernel[(T // BN, B * H)](
        x["q"], x["k"], x["v"], x["do"], lse, delta, dq, dk, dv, T, scale, H=H, D=D, BN=BN, BM=BM,
        KEY_MAJOR=key_major, ATOMICS=atomics, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


def run_dq(x, lse, delta, scale, BM, BN, warps, stages):
    B, T, H, D = x["q"].shape
    dq = torch.empty(x["q"].shape, dtype=torch.float32, device=x["q"].device)
    dq_probe_kernel[(T // BM, B * H)](
        x["q"], x["k"], x["v"], x["do"], lse, delta, dq, T, scale, H=H, D=D, BM=BM, BN=BN, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return dq


def check(device: str, dtype: torch.dtype, T: int, H: int, D: int) -> dict[str, float]:
    """Largest error of each launch from the float32 reference at ``B = 1``: ``{label: error}``."""
    x = inputs(1, T, H, D, device, dtype)
    scale = D**-0.5
    ref = reference(x, scale)
    errors = {}
    for BM, BN, warps, stages in FWD:
        errors[fwd_label(BM, BN, warps, stages)] = rel_rms(run_fwd(x, scale, BM, BN, warps, stages), ref["o"])
    for key_major, BN, BM, warps, stages, atomics in BWD:
        dq, dk, dv = run_bwd(x, ref["lse"], ref["delta"], scale, key_major, BN, BM, warps, stages, atomics)
        errs = [rel_rms(dk, ref["dk"]), rel_rms(dv, ref["dv"])] + ([rel_rms(dq, ref["dq"])] if atomics else [])
        errors[bwd_label(key_major, BN, BM, warps, stages, atomics)] = max(errs)
    for launch in DQ:
        errors[dq_label(*launch)] = rel_rms(run_dq(x, ref["lse"], ref["delta"], scale, *launch), ref["dq"])
    return errors


def fwd_label(BM, BN, warps, stages) -> str:
    return f"fwd BM={BM} BN={BN} warps={warps} stages={stages}"


def dq_label(BM, BN, warps, stages) -> str:
    return f"bwd dQ alone BM={BM} BN={BN} warps={warps} stages={stages}"


def bwd_label(key_major, BN, BM, warps, stages, atomics) -> str:
    major = "key-major" if key_major else "query-major"
    return f"bwd {major} BN={BN} BM={BM} warps={warps} stages={stages}{'' if atomics else ' no dQ'}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # the kernels take whole tiles, unmasked: every length a multiple of the widest tile
    widest = max(max(row[0], row[1]) for row in FWD + DQ)
    if args.seq_len < widest or args.seq_len % widest:
        parser.error(f"--seq-len: expected a positive multiple of {widest}, got {args.seq_len}")
    if args.head_dim < 16 or args.head_dim & (args.head_dim - 1):
        parser.error(f"--head-dim: expected a power of two from 16, got {args.head_dim}")
    if args.batch < 1 or args.heads < 1:
        parser.error(f"--batch, --heads: expected positive integers, got {args.batch}, {args.heads}")
    device = args.device
    if device == "cpu" and not interpreting():
        parser.error("--device cpu runs the kernels under TRITON_INTERPRET=1")
    dtype = torch.float16 if device == "cpu" else torch.bfloat16  # the interpreter's bf16 dots are wrong
    errors = check(device, dtype, 128 if device == "cpu" else 512, 2, 16 if device == "cpu" else args.head_dim)
    result: dict = {"errors": errors, "rows": []}
    if device == "cpu":
        for label, err in errors.items():
            print(f"{label}: err {err:.1e}")
        return result
    from triton.testing import do_bench

    from benchmarks.ops import environment

    B, T, H, D = args.batch, args.seq_len, args.heads, args.head_dim
    x = inputs(B, T, H, D, device, dtype)
    scale = D**-0.5
    flops = 4 * B * H * T * T * D
    # the saved statistics of the real softmax, so that P stays in [0, 1] as in a real backward
    with torch.no_grad():
        qf, kf = x["q"].float().transpose(1, 2), x["k"].float().transpose(1, 2)
        lse = torch.cat(
            [(qf[:, :, i : i + 512] @ kf.transpose(-1, -2) * scale).logsumexp(-1) for i in range(0, T, 512)], 2
        )
        lse = lse.transpose(1, 2).contiguous()
        delta = torch.zeros_like(lse)
    rows = []

    def timed(label, fn, work):
        try:
            ms = do_bench(fn, warmup=25, rep=200, return_mode="median")
            rows.append({"label": label, "ms": ms, "tflops": work / ms / 1e9, "error": errors.get(label)})
        except Exception as e:  # a launch that does not compile or fit is a row too
            rows.append({"label": label, "ms": None, "tflops": None, "error": f"{type(e).__name__}: {e}"[:200]})

    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        timed("SDPA flash fwd", lambda: torch.nn.functional.scaled_dot_product_attention(qh, kh, vh), flops)
        leaves = [t.detach().requires_grad_() for t in (qh, kh, vh)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves)
        grad = x["do"].transpose(1, 2)
        timed("SDPA flash bwd", lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True), 2.5 * flops)
    for BM, BN, warps, stages in FWD:
        launch = (BM, BN, warps, stages)
        timed(fwd_label(*launch), lambda launch=launch: run_fwd(x, scale, *launch), flops)
    for key_major, BN, BM, warps, stages, atomics in BWD:
        launch = (key_major, BN, BM, warps, stages, atomics)
        timed(bwd_label(*launch), lambda launch=launch: run_bwd(x, lse, delta, scale, *launch), 2.5 * flops)
    for launch in DQ:  # three of the backward's five products: 1.5 forward's FLOPs
        timed(dq_label(*launch), lambda launch=launch: run_dq(x, lse, delta, scale, *launch), 1.5 * flops)
    result.update(environment=environment(torch.device(device)), shape=dict(B=B, T=T, H=H, D=D), rows=rows)
    if args.out:
        write_json(args.out, result)
    print(f"B={B} T={T} H={H} D={D}, full (not causal), bf16; error from float32 at T=512")
    for row in sorted(rows, key=lambda r: r["ms"] or float("inf")):
        ms = "failed" if row["ms"] is None else f"{row['ms']:.3f} ms {row['tflops']:6.1f} TFLOP/s"
        err = row["error"]
        print(f"  {row['label']:<52} {ms}  {err if isinstance(err, str) else f'err {err:.1e}' if err else ''}")
    return result


if __name__ == "__main__":
    main()
