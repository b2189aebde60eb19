"""The contract every token mixer follows, and the packing, padding and cache plumbing they share.

A mixer maps hidden states ``[B, T, hidden]`` to ``[B, T, hidden]``. A dense batch runs as it is; a
left-padded batch (``attention_mask``) is packed into one ``[1, total, hidden]`` sequence with
``cu_seqlens``, as is a batch the caller packed. A subclass writes two methods only:

- ``prefill(x, cu_seqlens, use_cache) -> (o, token_state, seq_state)``: the whole of each sequence from an
  empty cache, for ``x [B, T, hidden]`` with ``cu_seqlens=None`` (B sequences of T tokens) or
  ``x [1, total, hidden]`` with ``cu_seqlens [N+1]``. ``token_state`` holds one row per token (shaped like
  ``x``: keys, values, positions ...), ``seq_state`` one row per sequence (``[N, ...]``: recurrent states,
  conv tails). :func:`token_positions` and :func:`segment_cumsum` serve both layouts.
- ``step(x [B, 1, hidden], state, position [B]) -> (o [B, 1, hidden], state)``: one new token per
  sequence. ``state`` is the cache dict: token entries laid out ``[B, L, ...]`` and left-padded, with
  ``state["mask"] [B, L]`` (True for real tokens, already extended by the new token); ``step`` appends
  its own token entries so that they stay as long as the mask. ``position`` counts the real tokens
  before the new one.

The cache of a layer is a plain ``dict[str, Tensor]`` with the batch first in every entry, so the model
cache can reorder or select it generically. ``state["seen"] [B]`` counts each sequence's real tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit.ops.common.utils import autocast_off, segment_bounds
from attnkit.ops.common.validation import check_backend, check_cu_seqlens, checks_data, data_checked

State = dict[str, torch.Tensor]


def check_int(name: str, value: object, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def head_layout(
    hidden_size: object, num_heads: object, num_kv_heads: object, head_dim: object, *, same_heads: bool = False
) -> tuple[int, int, int, int]:
    """The head layout of a layer, ``(hidden_size, HQ, H, D)``: ``H`` defaults to ``HQ`` (and must equal it
    when ``same_heads``), ``D`` to ``hidden_size // HQ``."""
    hidden_size = check_int("hidden_size", hidden_size)
    num_heads = check_int("num_heads", num_heads)
    num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
    if same_heads and num_kv_heads != num_heads:
        raise ValueError(f"num_kv_heads: this layer needs num_kv_heads == num_heads ({num_heads}), got {num_kv_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: num_heads ({num_heads}) must be a multiple of it, got {num_kv_heads}")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size: {hidden_size} is not a multiple of num_heads ({num_heads}); pass head_dim")
        head_dim = hidden_size // num_heads
    return hidden_size, num_heads, num_kv_heads, check_int("head_dim", head_dim)


def _mask_of(attention_mask: object) -> torch.Tensor:
    """A 2-D mask as bool, or the ``ValueError`` every mask check raises for anything else."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError("attention_mask: expected a [B, L] tensor of 0/1")
    return attention_mask.bool()


def _padded_after(mask: torch.Tensor) -> torch.Tensor:
    """Whether a 0 follows a 1 in some row of ``mask`` (padding that is not on the left), a bool on the device."""
    return (mask.int().diff(dim=1) < 0).any()


_LEFT_ONLY = "attention_mask: only left padding is supported (a 0 follows a 1)"


def check_attention_mask(attention_mask: object, batch: int, length: int) -> torch.Tensor:
    """``[B, L]`` of 0/1 (or bool) with padding on the left only; returned as bool. The values are read from the
    device once, unless the caller checked them (:func:`attnkit.ops.common.validation.data_checked`)."""
    mask = _mask_of(attention_mask)
    if tuple(mask.shape) != (batch, length):
        raise ValueError(f"attention_mask: expected shape [{batch}, {length}], got {list(mask.shape)}")
    if checks_data() and _padded_after(mask):
        raise ValueError(_LEFT_ONLY)
    return mask


def check_decode_mask(attention_mask: object, batch: int, new_tokens: int) -> None:
    """An ``attention_mask`` given with a cache: ``[B, past + T]``, left padding only, its ``T`` new tokens real
    (the earlier columns are the cache's business). The shape is always checked; the values are read from the
    device once, unless the caller checked them already (:func:`attnkit.ops.common.validation.data_checked`)."""
    mask = _mask_of(attention_mask)
    if mask.shape[0] != batch or mask.shape[1] < new_tokens:
        raise ValueError(f"attention_mask: expected shape [{batch}, past + {new_tokens}], got {list(mask.shape)}")
    if not checks_data():
        return
    padded_after, new_padding = torch.stack([_padded_after(mask), ~mask[:, -new_tokens:].all()]).tolist()
    if padded_after:
        raise ValueError(_LEFT_ONLY)
    if new_padding:
        raise ValueError("attention_mask: tokens after the prompt must not be padding")


def positions_in_segments(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[total]`` position of every packed token within its own sequence (0, 1, ... per segment)."""
    starts = cu_seqlens[:-1].long()
    lengths = cu_seqlens.diff().long()
    return torch.arange(total, device=cu_seqlens.device) - torch.repeat_interleave(starts, lengths)


def token_positions(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` position of every token of ``x [B, T, ...]`` within its own sequence."""
    if cu_seqlens is None:
        return torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
    return positions_in_segments(cu_seqlens, x.shape[1])[None]


def sequence_lengths(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``[N]`` length of every sequence of ``x`` (``B`` rows of ``T`` without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    return cu_seqlens.diff().long()


def left_pad_layout(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each packed token goes in a left-padded ``[N, L]`` layout (``L`` the longest sequence):
    ``(flat indices [total], mask [N, L])``."""
    lengths = cu_seqlens.diff().long()
    L = int(lengths.max().item()) if lengths.numel() else 0
    col = torch.arange(L, device=cu_seqlens.device)
    mask = col[None, :] >= (L - lengths)[:, None]
    return mask.flatten().nonzero().squeeze(1), mask


@autocast_off
def linear_fp32(x: torch.Tensor, layer: nn.Linear, *more: nn.Linear) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``layer(x)`` in float32 whatever autocast is on (under autocast ``F.linear`` would run in 16 bits, whatever
    its inputs' dtypes): the projections of the gates ``beta`` and ``g``, which the layers keep in float32.

    With ``more`` layers, the tuple of every layer's output from one product on their stacked weights: ``x`` read
    once, and in the backward one gradient of ``x`` (a ``[B, T, hidden]`` float32 product and sum fewer a layer)."""
    if not more:
        bias = None if layer.bias is None else layer.bias.float()
        return torch.nn.functional.linear(x.float(), layer.weight.float(), bias)
    layers = (layer, *more)
    weight = torch.cat([item.weight for item in layers]).float()
    bias = None
    if any(item.bias is not None for item in layers):
        bias = torch.cat([
            item.weight.new_zeros(item.out_features) if item.bias is None else item.bias for item in layers
        ]).float()  # fmt: skip
    out = torch.nn.functional.linear(x.float(), weight, bias)
    return out.split([item.out_features for item in layers], dim=-1)


def segment_cumsum(g: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """``G = cumsum(g)`` along dim 1, restarting at every packed sequence of ``[1, total, ...]`` (or per row of
    a dense ``[B, T, ...]`` when ``cu_seqlens`` is None).

    One cumsum per sequence rather than one global cumsum minus offsets: the difference of two large
    running sums would lose the small gates of a late sequence. Each runs along the last dim: torch's CUDA scan
    along an outer dim gives each column one thread (0.7 ms at ``[4, 4096, 16]`` on an H200)."""

    def scan(x: torch.Tensor) -> torch.Tensor:
        return x.movedim(1, -1).cumsum(-1).movedim(-1, 1)

    if cu_seqlens is None:
        return scan(g)
    parts = [scan(g[:, bos:eos]) for bos, eos in segment_bounds(cu_seqlens, g.shape[1]) if eos > bos]
    return torch.cat(parts, dim=1) if parts else g.clone()


def scatter_tokens(x: torch.Tensor, indices: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[1, total, ...] -> [rows, cols, ...]`` with the tokens at ``indices`` (flat) and zeros elsewhere."""
    out = x.new_zeros(rows * cols, *x.shape[2:])
    out[indices] = x[0]
    return out.view(rows, cols, *x.shape[2:])


class TokenMixer(nn.Module):
    """Base class of the attention layers: validation, packing, left padding and the decoding loop.

    Args:
        hidden_size, num_heads, num_kv_heads, head_dim: the head layout (see :func:`head_layout`).
        layer_idx: index of the layer in a model, or None.
        backend: ``"auto" | "torch" | "triton"``, passed to the ops.
        same_heads: the mixer has no GQA (``num_kv_heads`` must be None or ``num_heads``).
    """

    #: the cache entries ``step`` reads; a cache without them is refused before decoding
    cache_keys: tuple[str, ...] = ()

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        layer_idx: int | None = None,
        backend: str = "auto",
        *,
        same_heads: bool = False,
    ) -> None:
        super().__init__()
        self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim = head_layout(
            hidden_size, num_heads, num_kv_heads, head_dim, same_heads=same_heads
        )
        self.layer_idx = None if layer_idx is None else check_int("layer_idx", layer_idx, low=0)
        self.backend = check_backend(backend)

    def init_qkvo(self) -> None:
        """The bias-free projections ``q: hidden -> HQ*D``, ``k, v: hidden -> H*D``, ``o: HQ*D -> hidden``."""
        HQ, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, HQ * D, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, H * D, bias=False)
        self.o_proj = nn.Linear(HQ * D, self.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, T, hidden]`` -> ``q [B, T, HQ, D]``, ``k, v [B, T, H, D]``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def prefill(self, x: torch.Tensor, cu_seqlens: torch.Tensor, use_cache: bool) -> tuple[torch.Tensor, State, State]:
        """``use_cache`` False: the states may be left empty (training needs no cache)."""
        raise NotImplementedError

    def step(self, x: torch.Tensor, state: State, position: torch.Tensor) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_state: State | None = None,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, State | None]:
        """Mix ``hidden_states [B, T, hidden]``.

        Args:
            attention_mask: ``[B, past + T]`` 1 for tokens and 0 for left padding (Hugging Face layout), or
                None when nothing is padded.
            cu_seqlens: ``[N+1]`` offsets of sequences packed along T (``B == 1``); not with a mask or cache.
            past_state: the state this layer returned for the earlier tokens, or None.
            use_cache: return the state after these tokens.

        Returns:
            ``(output [B, T, hidden], state or None)``; padded positions of the output are zero.
        """
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states: expected [B, T, hidden], got shape {list(hidden_states.shape)}")
        B, T, width = hidden_states.shape
        if width != self.hidden_size:
            raise ValueError(f"hidden_states: expected last dimension {self.hidden_size}, got {width}")
        if cu_seqlens is not None:
            if attention_mask is not None or past_state is not None:
                raise ValueError("cu_seqlens: cannot be combined with attention_mask or past_state")
            check_cu_seqlens(cu_seqlens, B, T, hidden_states.device)
        if past_state is not None:
            if attention_mask is not None:
                check_decode_mask(attention_mask, B, T)
            self._check_state(past_state, B)
        elif attention_mask is not None:
            attention_mask = check_attention_mask(attention_mask, B, T)
        with data_checked():  # checked above, or built valid below: the ops need not read them again
            if past_state is not None:
                return self._decode(hidden_states, past_state, use_cache)
            return self._prefill(hidden_states, attention_mask, cu_seqlens, use_cache)

    def _prefill(
        self,
        hidden_states: torch.Tensor,
        key_mask: torch.Tensor | None,
        cu_seqlens: torch.Tensor | None,
        use_cache: bool,
    ) -> tuple[torch.Tensor, State | None]:
        """The forward without a cache to extend: a dense batch, a left-padded one (``key_mask [B, T]`` bool)
        or packed sequences."""
        B, T, width = hidden_states.shape
        if cu_seqlens is None and key_mask is None:
            # a dense batch runs as it is: the ops batch over B (packing would make B sequences of one batch)
            o, token_state, state = self.prefill(hidden_states, None, use_cache)
            if not use_cache:
                return o, None
            state.update(token_state)
            state["mask"] = torch.ones(B, T, dtype=torch.bool, device=hidden_states.device)
            state["seen"] = sequence_lengths(hidden_states, None)
            return o, state
        if cu_seqlens is None:
            # the cache keeps the columns of the batch as given, so its length counts padding like the mask
            layout = key_mask.flatten().nonzero().squeeze(1)
            x = hidden_states.reshape(B * T, width)[layout][None]
            lengths = key_mask.sum(1)
            cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            o, token_state, seq_state = self.prefill(x, cu_seqlens, use_cache)
            o = scatter_tokens(o, layout, B, T)
        else:
            layout, key_mask = left_pad_layout(cu_seqlens)
            o, token_state, seq_state = self.prefill(hidden_states, cu_seqlens, use_cache)
        if not use_cache:
            return o, None
        N, L = key_mask.shape
        state = {name: scatter_tokens(t, layout, N, L) for name, t in token_state.items()}
        state.update(seq_state)
        state["mask"] = key_mask
        state["seen"] = cu_seqlens.diff().long()
        return o, state

    def _check_state(self, state: object, batch: int) -> None:
        """A cache of this layer type for ``batch`` sequences: a wrong batch would broadcast silently."""
        if not isinstance(state, dict):
            raise ValueError(f"past_state: expected the dict this layer returned, got {type(state).__name__}")
        for name in (*self.cache_keys, "mask", "seen"):
            if not isinstance(state.get(name), torch.Tensor):
                raise ValueError(f"past_state: missing the entry {name!r}; is it the cache of this layer type?")
        for name, value in state.items():
            if value.shape[0] != batch:
                raise ValueError(f"past_state: entry {name!r} holds {value.shape[0]} sequences, hidden_states {batch}")

    def _decode(self, hidden_states: torch.Tensor, state: State, use_cache: bool) -> tuple[torch.Tensor, State]:
        outs = []
        for t in range(hidden_states.shape[1]):
            position = state["seen"]
            state = dict(state)
            state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(position.numel(), 1)], dim=1)
            o, state = self.step(hidden_states[:, t : t + 1], state, position)  # its mask's new slot is real
            state["seen"] = position + 1
            outs.append(o)
        return torch.cat(outs, dim=1), (state if use_cache else None)
