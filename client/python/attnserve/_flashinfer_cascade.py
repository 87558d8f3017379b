"""FlashInfer's merges of attention states (flashinfer.cascade: merge_state,
merge_state_in_place, merge_states) on attnserve.flashinfer: a state is an
output v [seq_len, num_heads, head_dim] and its LSE s [seq_len, num_heads]
(float32, base 2, as run(return_lse=True) gives them; -inf: the state saw no
key of that row). They run here, in torch, on the tensors' device
(attnserve.merge), not on the server: merging two states costs less than
sending them."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from attnserve.merge import merge_states as _merge


def _check_state(v, s, v_name: str, s_name: str, shape=None) -> None:
    for name, t in ((v_name, v), (s_name, s)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
    if v.dim() != 3:
        raise ValueError(f"{v_name} has shape {list(v.shape)}, must be [seq_len, num_heads, "
                         "head_dim]")
    if shape is not None and tuple(v.shape) != tuple(shape):
        raise ValueError(f"{v_name} has shape {list(v.shape)}, must be {list(shape)} (as the "
                         "first state's)")
    if tuple(s.shape) != tuple(v.shape[:2]):
        raise ValueError(f"{s_name} has shape {list(s.shape)}, must be {list(v.shape[:2])} "
                         f"([seq_len, num_heads] of {v_name})")
    if s.device != v.device:
        raise ValueError(f"{s_name} is on {s.device}, {v_name} on {v.device}")


def merge_state(v_a, s_a, v_b, s_b) -> Tuple[torch.Tensor, torch.Tensor]:
    """The state of the keys of both A and B from A's (v_a, s_a) and B's
    (v_b, s_b): (v [seq_len, num_heads, head_dim] in v_a's dtype, s
    [seq_len, num_heads] float32), as FlashInfer's merge_state."""
    _check_state(v_a, s_a, "v_a", "s_a")
    _check_state(v_b, s_b, "v_b", "s_b", v_a.shape)
    return _merge([v_a, v_b], [s_a, s_b])


def merge_state_in_place(v, s, v_other, s_other, mask: Optional[torch.Tensor] = None) -> None:
    """Merges (v_other, s_other) into (v, s) in place, as FlashInfer's
    merge_state_in_place; mask [seq_len] (bool): only the rows where it is
    True (default: all)."""
    _check_state(v, s, "v", "s")
    _check_state(v_other, s_other, "v_other", "s_other", v.shape)
    if s.dtype != torch.float32:
        raise ValueError(f"s has dtype {s.dtype}, must be torch.float32 (it is written in place)")
    merged_v, merged_s = _merge([v, v_other], [s, s_other])
    if mask is None:
        v.copy_(merged_v)
        s.copy_(merged_s)
        return
    if not torch.is_tensor(mask) or mask.dtype != torch.bool or tuple(mask.shape) != (v.shape[0],):
        raise ValueError(f"mask must be a bool tensor of shape [seq_len={v.shape[0]}], got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} "
                         f"{list(getattr(mask, 'shape', []))}")
    rows = mask.to(v.device)
    v[rows] = merged_v[rows]
    s[rows] = merged_s[rows]


def merge_states(v, s) -> Tuple[torch.Tensor, torch.Tensor]:
    """The merge of num_states states of the same rows: v [seq_len,
    num_states, num_heads, head_dim], s [seq_len, num_states, num_heads]
    (float32); returns (v [seq_len, num_heads, head_dim] in v's dtype, s
    [seq_len, num_heads] float32), as FlashInfer's merge_states."""
    for name, t in (("v", v), ("s", s)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
    if v.dim() != 4 or tuple(s.shape) != tuple(v.shape[:3]):
        raise ValueError(f"v has shape {list(v.shape)} and s {list(s.shape)}: must be "
                         "[seq_len, num_states, num_heads, head_dim] and [seq_len, num_states, "
                         "num_heads]")
    if v.shape[1] == 0:
        raise ValueError("merge_states needs at least one state (v.shape[1] is 0)")
    n = v.shape[1]
    return _merge([v[:, i] for i in range(n)], [s[:, i] for i in range(n)])
