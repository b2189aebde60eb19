"""Input checks shared by every public op.

Validation happens once, at the public boundary; the implementations behind it trust their inputs.
Every failure is a ``ValueError`` whose message starts with the name of the offending argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

import torch

from attnkit.ops.common.triton_utils import kernel_device

BACKENDS = ("auto", "torch", "triton")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: object, ndim: int) -> torch.Tensor:
    """``x`` is a floating tensor of rank ``ndim``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected a floating dtype, got {x.dtype}")
    return x


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, same_heads: bool = False) -> None:
    """``q [B,T,HQ,K]``, ``k [B,T,H,K]``, ``v [B,T,H,V]`` on one device with one dtype; ``HQ % H == 0``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
    B, T, HQ, K = q.shape
    if k.shape[:2] != (B, T) or k.shape[3] != K:
        raise ValueError(f"k: expected shape [B={B}, T={T}, H, K={K}], got {tuple(k.shape)}")
    H = k.shape[2]
    if v.shape[:3] != (B, T, H):
        raise ValueError(f"v: expected shape [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    check_heads(HQ, H)
    if same_heads and HQ != H:
        raise ValueError(f"q: expected as many heads as k ({H}), got {HQ}")
    if K == 0 or v.shape[3] == 0:
        raise ValueError("k: head dimensions must be non-empty")
    for name, x in (("k", k), ("v", v)):
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (that of q), got {x.device}")
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (that of q), got {x.dtype}")


def check_heads(HQ: int, H: int) -> None:
    """At least one key/value head, and a positive multiple of it as query heads (GQA)."""
    if H == 0 or HQ == 0 or HQ % H != 0:
        raise ValueError(f"q: the query heads ({HQ}) must be a positive multiple of the key/value heads ({H})")


def check_step_qkv(q: object, k: object, v: object, *, same_heads: bool = False) -> tuple[int, int, int, int, int]:
    """A recurrent decode step's token: :func:`check_qkv` with one token per sequence. Returns ``(B, HQ, H, K, V)``."""
    check_qkv(q, k, v, same_heads=same_heads)
    B, T, HQ, K = q.shape
    if T != 1:
        raise ValueError(f"q: expected one token per sequence, [B, 1, HQ, K], got shape {list(q.shape)}")
    return B, HQ, k.shape[2], K, v.shape[3]


def check_like(name: str, x: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A per-token side input (``w``, ``beta``, ``g``, ``u``): floating, of exactly ``shape``, on ``device``."""
    x = check_tensor(name, x, len(shape))
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    return x


def check_cu_seqlens(cu_seqlens: object, batch: int, seq_len: int, device: torch.device) -> int:
    """FlashAttention's convention: int ``[N+1]``, ``0 = c_0 <= c_1 <= ... <= c_N = T``, with ``B == 1``.

    Returns the number of sequences ``N``."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens: expected dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 1, got {tuple(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"cu_seqlens: requires batch size 1 (sequences packed along T), got B={batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens: expected device {device} (that of q), got {cu_seqlens.device}")
    if checks_data():  # one device read (see data_checked), and no operator on the device
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != seq_len:
            raise ValueError(f"cu_seqlens: must start at 0 and end at T={seq_len}, got {values[0]} ... {values[-1]}")
        if any(b < a for a, b in zip(values[:-1], values[1:])):
            raise ValueError("cu_seqlens: must be non-decreasing")
    return cu_seqlens.numel() - 1


def check_scalar(
    name: str, value: object, *, low: float | None = None, high: float | None = None, strict: bool = True
) -> float:
    """A finite real number, optionally within ``(low, high)`` (``[low, high]`` when ``strict=False``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    if low is not None and (value <= low if strict else value < low):
        raise ValueError(f"{name}: expected a value {'>' if strict else '>='} {low}, got {value}")
    if high is not None and (value >= high if strict else value > high):
        raise ValueError(f"{name}: expected a value {'<' if strict else '<='} {high}, got {value}")
    return value


def check_backend(backend: object) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return backend


def resolve_backend(
    backend: object,
    op: str,
    device: torch.device,
    *,
    has_triton: bool = False,
    auto_triton: bool = True,
    dtype: torch.dtype | None = None,
    head_dims: tuple[int, ...] = (),
    max_head_dim: int | None = None,
) -> str:
    """``"auto"`` picks the Triton kernel for CUDA tensors when ``op`` has one, the PyTorch backend otherwise.

    ``"triton"`` needs CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``, how the tests run kernels) and
    inputs of float16 / bfloat16 / float32 (``dtype``; float64 is the tests' reference precision, which only the
    PyTorch backend computes, and ``"auto"`` sends it there). ``auto_triton=False`` keeps ``"auto"`` on PyTorch
    for kernels that have not run on a GPU yet; ``"triton"`` still reaches them. ``head_dims`` past
    ``max_head_dim`` (the widest the kernels are built for) send ``"auto"`` to PyTorch and make ``"triton"`` a
    ``ValueError``.
    """
    backend = check_backend(backend)
    kernel_dtype = dtype != torch.float64
    kernel_dims = max_head_dim is None or max(head_dims, default=0) <= max_head_dim
    if backend == "auto":
        use = has_triton and auto_triton and kernel_dtype and kernel_dims and device.type == "cuda"
        return "triton" if use else "torch"
    if backend == "triton" and not has_triton:
        raise NotImplementedError(f"{op}: the Triton backend is not implemented yet; use backend='torch'")
    if backend == "triton" and not kernel_device(device):
        raise ValueError(
            f"backend: {op}'s Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU), got {device}"
        )
    if backend == "triton" and not kernel_dtype:
        raise ValueError(f"backend: {op}'s Triton kernels take float16, bfloat16 or float32, got float64")
    if backend == "triton" and not kernel_dims:
        raise ValueError(f"backend: {op}'s Triton kernels take head dims up to {max_head_dim}, got {list(head_dims)}")
    return backend


def check_state(
    name: str, state: object, shapes: tuple[tuple[int, ...], ...], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """A recurrent state: a tuple of float32/float64 tensors of exactly ``shapes`` on ``device``.

    With one shape the state is a bare tensor and messages name ``name``; otherwise it is a tuple and
    messages name ``name[i]``. Returns the state as a tuple.
    """
    if len(shapes) == 1:
        items, names = (state,), (name,)
    else:
        if not isinstance(state, (tuple, list)) or len(state) != len(shapes):
            raise ValueError(f"{name}: expected a tuple of {len(shapes)} tensors, got {type(state).__name__}")
        items, names = tuple(state), tuple(f"{name}[{i}]" for i in range(len(shapes)))
    for item_name, x, shape in zip(names, items, shapes, strict=True):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{item_name}: expected a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{item_name}: expected shape {list(shape)}, got {list(x.shape)}")
        if x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{item_name}: expected dtype float32 or float64, got {x.dtype}")
        if x.device != device:
            raise ValueError(f"{item_name}: expected device {device} (that of q), got {x.device}")
    return items


def _check_exact(
    name: str, x: object, dtypes: tuple[torch.dtype, ...], what: str, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """A tensor of one of ``dtypes`` (``what`` in messages), of exactly ``shape``, on ``device``."""
    if not isinstance(x, torch.Tensor) or x.dtype not in dtypes:
        raise ValueError(f"{name}: expected a {what} tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (that of q), got {x.device}")
    return x


def check_cache_mask(cache_mask: object, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A decoding cache's ``[B, L]`` bool mask (True for real slots) on ``device``."""
    return _check_exact("cache_mask", cache_mask, (torch.bool,), "bool", shape, device)


def check_rows_have_slots(name: str, empty_rows: int, what: str = "real slot") -> None:
    """``empty_rows``, the number of mask rows without a True slot (read from the device by the caller), is 0."""
    if empty_rows:
        raise ValueError(
            f"{name}: {empty_rows} row(s) without a {what}; every sequence needs one (its new token's slot at least)"
        )


def reads_data() -> bool:
    """Whether checks of preconditions on data (which read the device) run: in eager mode, yes; under
    ``torch.compile`` they would break the graph, and while a CUDA graph is captured a read is an error, so compiled
    and captured callers are trusted (``make_graphed_callables`` runs them eagerly, checked, before it captures)."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


_DATA_CHECKED = contextvars.ContextVar("attnkit_data_checked", default=False)


def data_checked() -> contextlib.AbstractContextManager[None]:
    """Within this context the caller vouches for the values of the index inputs it passes, which it checked
    itself or built valid: ``cu_seqlens`` (:func:`check_cu_seqlens`), a ``cache_mask`` with a real slot in every
    row, an ``attention_mask`` given with a cache that is left padding with real new tokens. A model checks them
    once a call and a layer once, and their ops read nothing again, so that a training step or a generated token
    costs no device read per layer; a public op called outside this context still checks."""
    if torch.compiler.is_compiling():  # nothing is read under torch.compile anyway, and a ContextVar breaks graphs
        return contextlib.nullcontext()
    return _vouch()


@contextlib.contextmanager
def _vouch() -> Iterator[None]:
    token = _DATA_CHECKED.set(True)
    try:
        yield
    finally:
        _DATA_CHECKED.reset(token)


def checks_data() -> bool:
    """Whether the values of index inputs are read from the device and checked: in eager mode (:func:`reads_data`)
    and outside :func:`data_checked`."""
    return reads_data() and not _DATA_CHECKED.get()


def check_real_slots(cache_mask: torch.Tensor) -> None:
    """Every row of a ``[B, L]`` bool ``cache_mask`` has a real slot (a softmax over no slot is undefined).

    Reads the device once (a synchronisation on CUDA): the precondition is data, not shape (see
    :func:`checks_data`)."""
    if cache_mask.shape[0] and checks_data():
        check_rows_have_slots("cache_mask", int((~cache_mask.any(-1)).sum()))


def check_positions(name: str, x: object, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Token positions: an int32/int64 tensor of exactly ``shape`` on ``device`` (their signs are data: the caller
    reads them with the rest of its preconditions)."""
    return _check_exact(name, x, (torch.int32, torch.int64), "int32/int64", shape, device)


def check_decode_cache(q: object, k_cache: object, v_cache: object) -> tuple[int, int, int, int, int]:
    """One query token ``q [B, 1, HQ, K]`` against a cache ``k_cache [B, L, H, K]``, ``v_cache [B, L, H, V]``,
    floating and on the device of ``q`` (the caches may be kept in another float dtype than ``q``), with
    ``HQ`` a positive multiple of ``H`` and non-empty head dims. Returns ``(B, L, HQ, H, K)``."""
    check_tensor("q", q, 4)
    B, _, HQ, K = q.shape
    if q.shape[1] != 1:
        raise ValueError(f"q: expected one token per sequence [B, 1, HQ, K], got {list(q.shape)}")
    check_tensor("k_cache", k_cache, 4)
    L, H = k_cache.shape[1], k_cache.shape[2]
    check_like("k_cache", k_cache, (B, L, H, K), q.device)
    check_tensor("v_cache", v_cache, 4)
    check_like("v_cache", v_cache, (B, L, H, v_cache.shape[3]), q.device)
    check_heads(HQ, H)
    for name, dim in (("k_cache", K), ("v_cache", v_cache.shape[3])):
        if dim == 0:
            raise ValueError(f"{name}: head dimensions must be non-empty")
    return B, L, HQ, H, K


def check_step_token(
    q: torch.Tensor, k: object, v: object, heads: int, key_dim: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's new token: ``k [B, 1, H, K]``, ``v [B, 1, H, V]`` of exactly these shapes (a broadcasting
    shape is refused), on the device and in the dtype of ``q [B, 1, HQ, K]``."""
    B = q.shape[0]
    check_like("k", k, (B, 1, heads, key_dim), q.device)
    check_like("v", v, (B, 1, heads, value_dim), q.device)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: expected dtype {q.dtype} (that of q), got {x.dtype}")
    return k, v
