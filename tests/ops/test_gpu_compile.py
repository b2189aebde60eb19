"""Kernels that have not yet run on a GPU compile for one (sm_90, Triton's CUDA backend on the CPU): the interpreter
runs a kernel's Python, so it misses what only the compiler checks, such as a name carried through a loop with another
shape (linear attention's backward state kernel had one, caught this way before its first GPU run), or more shared
memory than a Hopper block has (its dK/dV kernel wanted 329 KB at K = 128 in float32 with three stages).

Each launch of a step is recorded with the GPU's choices (chunks, tiles, warps, stages, precisions) instead of run
(``benchmarks.kernel_resources.record_launches``) and compiled as ``kernel_resources.py`` compiles them
(``benchmarks.sass_report.compile_report``), in a child process without ``TRITON_INTERPRET``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import functools, sys, torch
from benchmarks.kernel_resources import record_launches, specialisation
from benchmarks.sass_report import compile_report
from attnkit.ops.baselines.linear_triton.backward import linear_bwd_fn
from attnkit.ops.baselines.linear_triton.forward import linear_fwd_fn
from attnkit.ops.common.triton import delta_fwd
from attnkit.ops.path.triton import prepare

def linear(K, dtype, packed):
    HQ, H, T = 4, 2, 256
    q, do = (torch.randn(1, T, HQ, K, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, T, H, K, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, 100, 100, T], dtype=torch.int32) if packed else None
    N = 3 if packed else 1
    s0, n0 = torch.zeros(N, H, K, K), torch.zeros(N, H, K)
    o, st, nt, hs, ns, z = linear_fwd_fn(q, k, v, s0, n0, cu, True, 1e-4)
    linear_bwd_fn(do, q, k, v, o, hs, ns, z, st, nt, cu, True, 1e-4)

def delta_prepare(K, dtype, low=False, deltanet=False):
    delta_fwd.PREPARE_16BIT_Z = low
    q, k, v, a = (torch.randn(1, 256, 2, K, dtype=dtype) for _ in range(4))
    if deltanet:
        delta_fwd.delta_fwd_fn(q, k, v, None, None, 64, "tf32", None, torch.rand(1, 256, 2))
    else:
        delta_fwd.delta_fwd_fn(q, k, v, a, None, 64, "tf32")

def delta_bwd(K, V):
    from attnkit.ops.common.triton.delta_bwd import delta_bwd_fn
    q, k, a = (torch.randn(1, 256, 2, K) for _ in range(3))
    v, do = (torch.randn(1, 256, 2, V, dtype=torch.bfloat16) for _ in range(2))
    saved = {"w": torch.empty(1, 2, 256, K), "hs": torch.empty(1, 2, 4, K, V), "u_new": torch.empty(1, 2, 256, V),
             "tm": torch.empty(1, 2, 256, 64)}
    delta_bwd_fn(q.bfloat16(), k, v, a, saved, do, None, 64, "tf32")

def delta_strided(K, V, dtype, deltanet):
    from attnkit.ops.common.triton.delta_bwd import delta_bwd_fn
    qkv = torch.randn(1, 256, 2, 2 * K + V, dtype=dtype)
    q, k, v = qkv[..., :K], qkv[..., K : 2 * K], qkv[..., 2 * K :]
    a, beta = (None, torch.rand(1, 256, 2)) if deltanet else (torch.randn(1, 256, 2, K), None)
    o, _, saved = delta_fwd.delta_fwd_fn(q, k, v, a, None, 64, "tf32", None, beta, K**-0.5)
    delta_bwd_fn(q, k, v, a, saved, torch.randn_like(o), None, 64, "tf32", None, beta, K**-0.5)

def delta_wy(K, V, warps):
    # the WY-form kernel's warps (delta_bwd.WY_WARPS), DeltaNet's beta form
    from attnkit.ops.common.triton import delta_bwd
    delta_bwd.WY_WARPS = warps
    delta_strided(K, V, torch.bfloat16, True)

def delta_state(K, V, bv, stages, low=False, prefetch=False, local=False):
    from attnkit.ops.common.triton import delta_bwd
    delta_fwd.STATE_BV, delta_fwd.STATE_STAGES, delta_fwd.STATE_16BIT = bv, stages, low
    delta_fwd.STATE_PREFETCH, delta_bwd.LOCAL_DU = prefetch, local
    delta_strided(K, V, torch.bfloat16, True)

def vla(K, dtype):
    from attnkit.ops.vla.parallel import vla_triton
    qkv = torch.randn(1, 256, 2, 3 * K, dtype=dtype)
    q, k, v = (qkv[..., i * K : (i + 1) * K].requires_grad_() for i in range(3))
    u = torch.randn(1, 256, 2, K, requires_grad=True)
    o, _ = vla_triton(q, k, v, u, 0.1, 1e-4, True, True, None, None)
    o.backward(torch.randn_like(o))

def path_prepare(K):
    prepare.SOLVE_BATCHED = True
    from attnkit.ops.path.triton.forward import path_fwd_fn
    q, k, v = (torch.randn(1, 256, 2, K, dtype=torch.bfloat16) for _ in range(3))
    w = torch.nn.functional.normalize(torch.randn(1, 256, 2, K), dim=-1)
    path_fwd_fn(q, k, v, w, torch.rand(1, 256, 2) * 2, None, K**-0.5, None)

def path_options(K):
    # PaTH-FoX's step with the memory and carry settings that were the default until the twentieth session off
    # (path_tune.py's LOCAL rows): float32 working copies, the superblock terms after the kernels between chunks
    # (no ADD_DX) with their carries in their precision; the default step compiles in the other groups
    from benchmarks import path_tune
    from benchmarks.kernel_resources import path_step
    rows = dict(path_tune.LOCAL)
    with path_tune.patched({**rows["memory: all three off"], **rows["superblock terms' carries in their precision"]}):
        path_step(K, True)

def path_float32(K, V):
    # float32 inputs, whose dots take prepare.FLOAT32_PRECISIONS (3xTF32) at K, V <= 128: on the tensor cores
    from benchmarks.kernel_resources import path_step
    H = 1024 // K
    q, k = (torch.randn(1, 2048, H, K) for _ in range(2))
    v, do = (torch.randn(1, 2048, H, V) for _ in range(2))
    w = torch.nn.functional.normalize(torch.randn(1, 2048, H, K), dim=-1)
    path_step(K, True, (q, k, v, w, torch.rand(1, 2048, H) * 2, -torch.rand(1, 2048, H), do))

def fox_float32(K):
    # float32 FoX in 3xTF32 (forward.FLOAT32_PRECISION), exact at a padded head dim of 128
    from attnkit.ops.baselines.fox.triton import forward
    from attnkit.ops.baselines.fox.triton.backward import fox_bwd_fn
    forward.FLOAT32_PRECISION = "tf32x3"
    q, k, v, do = (torch.randn(1, 256, 1024 // K, K) for _ in range(4))
    g = -torch.rand(1, 256, 1024 // K)
    o, lse = forward.fox_fwd_fn(q, k, v, g, None, K**-0.5)
    fox_bwd_fn(do, q, k, v, g, o, lse, None, K**-0.5)

def path_forward(K, dtype):
    from attnkit.ops.path.triton.forward import path_fwd_fn
    q, k, v = (torch.randn(1, 64, 2, K, dtype=dtype) for _ in range(3))
    w = torch.nn.functional.normalize(torch.randn(1, 64, 2, K), dim=-1)
    path_fwd_fn(q, k, v, w, torch.rand(1, 64, 2) * 2, -torch.rand(1, 64, 2), K**-0.5, None)

def layer_norm(N, dtype):
    from attnkit.ops.common.triton.layer_norm import layer_norm_bwd_fn, layer_norm_fwd_fn
    x, w, b = torch.randn(4096, N, dtype=dtype), torch.randn(N), torch.randn(N)
    y, mean, rstd = layer_norm_fwd_fn(x, w, b, 1e-5, dtype)
    layer_norm_bwd_fn(torch.randn_like(y), x, mean, rstd, w)

def feature_map(dtype):
    from attnkit.ops.common.triton.feature_map import elu_plus_one_bwd_fn, elu_plus_one_fwd_fn
    q, k = (torch.randn(4, 256, 16, 64, dtype=dtype) for _ in range(2))
    elu_plus_one_bwd_fn(q, k, *elu_plus_one_fwd_fn(q, k))

steps = {
    "linear": [functools.partial(linear, K, d, p) for K, d, p in
               ((64, torch.bfloat16, False), (128, torch.float16, True), (128, torch.float32, False))],
    # and K Aᵀ on the 16-bit rows (delta_fwd.PREPARE_16BIT_Z), DeltaNet's beta form and a generic a
    "delta_prepare": [functools.partial(delta_prepare, K, d) for K, d in ((64, torch.bfloat16), (128, torch.float32))] +
                     [functools.partial(delta_prepare, K, torch.bfloat16, True, n) for K, n in
                      ((64, True), (128, True), (64, False))],
    "path_prepare": [functools.partial(path_prepare, K) for K in (64, 128)],
    "path_wide": [functools.partial(path_forward, 256, d) for d in (torch.float32, torch.bfloat16)],
    "path_options": [functools.partial(path_options, K) for K in (64, 128)],
    "path_float32": [functools.partial(path_float32, 64, 64)],
    "path_float32_wide": [functools.partial(path_float32, K, V) for K, V in ((64, 128), (128, 128))],
    "fox_float32": [functools.partial(fox_float32, K) for K in (64, 128, 256)],
    "delta_bwd": [functools.partial(delta_bwd, K, V) for K, V in ((64, 64), (128, 128))] +
                 [functools.partial(delta_wy, K, K, warps) for K, warps in ((64, 4),)],
    "delta_strided": [functools.partial(delta_strided, K, V, d, n) for K, V, d, n in
                      ((64, 64, torch.bfloat16, True), (128, 128, torch.bfloat16, True), (64, 64, torch.float32, False),
                       (128, 128, torch.float16, False))],
    "delta_state": [functools.partial(delta_state, K, K, bv, st, low, pre) for K, bv, st, low, pre in
                    ((64, 16, 3, False, False), (64, 32, 2, False, False), (128, 64, 3, False, False),
                     (128, 32, 2, False, False), (64, 16, 1, True, False), (64, 64, 1, True, False),
                     (128, 64, 1, True, False), (64, 16, 1, False, True), (64, 64, 1, True, True),
                     (128, 64, 1, False, True))] +
                   [functools.partial(delta_state, K, K, bv, 1, low, pre, True) for K, bv, low, pre in
                    ((64, 16, False, False), (64, 16, False, True), (64, 64, True, True), (128, 64, False, True))],
    "vla": [functools.partial(vla, K, torch.bfloat16) for K in (64, 128)],
    "layer_norm": [functools.partial(layer_norm, N, d) for N, d in
                   ((1024, torch.bfloat16), (8192, torch.bfloat16), (1000, torch.float32))],
    "feature_map": [functools.partial(feature_map, d) for d in (torch.bfloat16, torch.float32)],
}[sys.argv[1]]
WANTED = {
    "linear": ("linear_fwd_state_kernel", "linear_fwd_output_kernel", "linear_bwd_state_kernel", "linear_bwd_dq_kernel",
               "linear_bwd_dkdv_kernel"),
    "delta_prepare": ("delta_prepare_kernel",),
    "path_prepare": ("path_prepare_kernel",),
    "path_wide": ("path_fwd_kernel",),
    "path_options": ("path_query_terms_kernel", "path_super_terms_bwd_kernel", "path_bwd_q_kernel"),
    "path_float32": ("path_prepare_kernel", "path_fwd_kernel", "path_query_terms_kernel", "path_bwd_super_kv_kernel",
                     "path_super_terms_bwd_kernel", "path_bwd_q_kernel", "path_local_bwd_kernel"),
    "path_float32_wide": ("path_prepare_kernel", "path_fwd_kernel", "path_query_terms_kernel",
                          "path_bwd_super_kv_kernel", "path_super_terms_bwd_kernel", "path_bwd_q_kernel",
                          "path_local_bwd_kernel"),
    "fox_float32": ("fox_fwd_kernel", "fox_bwd_dkdv_kernel", "fox_bwd_dq_kernel"),
    "delta_bwd": ("delta_bwd_read_kernel", "delta_bwd_wy_kernel"),
    "delta_strided": ("delta_prepare_kernel", "delta_fwd_state_kernel", "delta_fwd_output_kernel",
                      "delta_bwd_state_kernel", "delta_bwd_read_kernel", "delta_bwd_wy_kernel", "delta_bwd_sum_kernel"),
    "delta_state": ("delta_fwd_state_kernel", "delta_bwd_state_kernel", "delta_bwd_local_kernel"),
    "vla": ("unit_rows_fwd_kernel", "unit_rows_bwd_kernel", "gram_prefix_kernel", "gram_suffix_kernel",
            "vla_gates_fwd_kernel", "vla_gates_bwd_g_kernel", "vla_gates_bwd_u_kernel", "normalize_prefix_kernel",
            "normalize_fwd_kernel", "normalize_dden_kernel", "normalize_bwd_kernel"),
    "layer_norm": ("layer_norm_fwd_kernel", "layer_norm_bwd_kernel"),
    "feature_map": ("elu_plus_one_fwd_kernel", "elu_plus_one_bwd_kernel"),
}
seen = set()
for step in steps:
    for launch in record_launches(step):
        signature, constants, warps, stages = specialisation(launch)
        name = launch["kernel"].fn.__name__
        if name not in WANTED[sys.argv[1]]:
            continue
        key = (name, repr(sorted(constants.items(), key=str)), warps, stages)
        if key in seen:
            continue
        seen.add(key)
        report = compile_report(launch["kernel"], signature, constants, warps, stages)
        shared = report["shared"]
        if shared > 227 * 1024:  # what a block may have on Hopper: the launch would fail
            raise SystemExit(f"{name} {constants}: {shared} bytes of shared memory")
        exact = sys.argv[1] == "fox_float32" and constants.get("PRECISION") == "ieee"
        if sys.argv[1] in ("path_float32", "fox_float32") and not exact and not report["wgmma"] + report["mma_sync"]:
            raise SystemExit(f"{name} {constants}: no tensor-core instruction")
        print("compiled", name, shared, flush=True)
"""


@pytest.mark.parametrize(
    "group, kernels",
    [
        ("linear", {"linear_fwd_state_kernel", "linear_fwd_output_kernel", "linear_bwd_state_kernel",
                    "linear_bwd_dq_kernel", "linear_bwd_dkdv_kernel"}),
        ("delta_prepare", {"delta_prepare_kernel"}),
        ("path_prepare", {"path_prepare_kernel"}),
        # PaTH's forward at K = 256 in float32 (its exact carries wanted 272 KB: forward.wide_carry) and bf16
        ("path_wide", {"path_fwd_kernel"}),
        # prepare.BUFFERS_16BIT, local.SUPER_TERMS_IN_PLACE, local.TERMS_CARRY_LOW off (on by default)
        ("path_options", {"path_query_terms_kernel", "path_super_terms_bwd_kernel", "path_bwd_q_kernel"}),
        # float32 inputs at K = 64 in 3xTF32 (prepare.FLOAT32_PRECISIONS): every kernel with products on the tensor
        # cores and within Hopper's shared memory (exact FMA dots took the local adjoint 442 s to compile); the
        # backward takes the forward's carried queries there (forward.keeps_carried), so no query terms kernel
        ("path_float32", {"path_prepare_kernel", "path_fwd_kernel",
                          "path_bwd_super_kv_kernel", "path_super_terms_bwd_kernel", "path_bwd_q_kernel",
                          "path_local_bwd_kernel"}),
        # and at V = 128 and K = V = 128, 3xTF32 too, the sweep on 32-row tiles (on 64-row tiles it wanted 256 and
        # 352 KB of shared memory; exact products took ptxas minutes and spilled up to 85 KB a thread)
        ("path_float32_wide", {"path_prepare_kernel", "path_fwd_kernel", "path_query_terms_kernel",
                               "path_bwd_super_kv_kernel", "path_super_terms_bwd_kernel", "path_bwd_q_kernel",
                               "path_local_bwd_kernel"}),
        # FoX's float32 option, 3xTF32 (forward.FLOAT32_PRECISION): on the tensor cores and within shared memory at
        # K = 64 and 256, exact at 128 (3xTF32 there wanted 262-328 KB)
        ("fox_float32", {"fox_fwd_kernel", "fox_bwd_dkdv_kernel", "fox_bwd_dq_kernel"}),
        # and the WY-form kernel's delta_bwd.WY_WARPS
        ("delta_bwd", {"delta_bwd_read_kernel", "delta_bwd_wy_kernel"}),
        ("delta_strided", {"delta_prepare_kernel", "delta_fwd_state_kernel", "delta_fwd_output_kernel",
                           "delta_bwd_state_kernel", "delta_bwd_read_kernel", "delta_bwd_wy_kernel",
                           "delta_bwd_sum_kernel"}),
        # delta_fwd.STATE_BV, STATE_STAGES, STATE_16BIT, STATE_PREFETCH; delta_bwd.LOCAL_DU
        ("delta_state", {"delta_fwd_state_kernel", "delta_bwd_state_kernel", "delta_bwd_local_kernel"}),
        ("vla", {"unit_rows_fwd_kernel", "unit_rows_bwd_kernel", "gram_prefix_kernel", "gram_suffix_kernel",
                 "vla_gates_fwd_kernel", "vla_gates_bwd_g_kernel", "vla_gates_bwd_u_kernel",
                 "normalize_prefix_kernel", "normalize_fwd_kernel", "normalize_dden_kernel", "normalize_bwd_kernel"}),
        # the VLA layer's LayerNorm (attnkit::layer_norm) at its width, the widest a test holds, and an odd one
        ("layer_norm", {"layer_norm_fwd_kernel", "layer_norm_bwd_kernel"}),
        # and its feature map elu + 1 (attnkit::elu_plus_one), q and k in one launch
        ("feature_map", {"elu_plus_one_fwd_kernel", "elu_plus_one_bwd_kernel"}),
    ],
)  # fmt: skip
def test_untested_kernels_compile_for_the_gpu(group, kernels):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, group], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = {line.split()[1] for line in done.stdout.splitlines() if line.startswith("compiled ")}
    assert compiled >= kernels, sorted(kernels - compiled)
