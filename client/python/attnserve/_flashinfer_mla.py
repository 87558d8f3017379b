"""FlashInfer's multi-head latent attention API on attnserve (an MLA server,
--attention=mla): BatchMLAPagedAttentionWrapper and append_paged_mla_kv_cache,
exported by attnserve.flashinfer (docs/flashinfer.md, "Multi-head latent
attention").

FlashInfer's caller keeps two cache tensors per layer, ckv_cache [pages,
page_size, head_dim_ckv] and kpe_cache [pages, page_size, head_dim_kpe];
attnserve's server keeps both halves of each token's latent row together
([c_kv | k_pe], kv_lora_rank + qk_rope_head_dim values), so kv_cache[layer]
of a PagedKVCache stands for both: run(q_nope, q_pe, kv_cache[layer],
kv_cache[layer]). The queries are the absorbed ones (q_nope already
multiplied by W_UK), as FlashInfer's wrapper takes them.
"""

from __future__ import annotations

import numpy as np
import torch

from attnserve._flashinfer_transport import AttentionFuture
from attnserve._flashinfer_cache import (LayerCache, _append_slots, _check_geometry,
                                         _check_layout, _ints, _layer_of, _unsupported)
from attnserve._flashinfer_wrapper import _Wrapper


class BatchMLAPagedAttentionWrapper(_Wrapper):
    """FlashInfer's BatchMLAPagedAttentionWrapper (flashinfer.mla) on attnserve.

    float_workspace_buffer: the attnserve.flashinfer.PagedKVCache of an MLA
      server (the server owns the cache and the workspace). use_cuda_graph,
      its buffers (qo_indptr, kv_indptr, kv_indices, kv_len_arr) and a
      backend other than "auto" raise NotImplementedError.
    """

    _mla = True

    def __init__(self, float_workspace_buffer, use_cuda_graph: bool = False,
                 qo_indptr=None, kv_indptr=None, kv_indices=None, kv_len_arr=None,
                 backend: str = "auto") -> None:
        _unsupported(
            use_cuda_graph=(use_cuda_graph, False, "no CUDA graphs: each run is a request"),
            qo_indptr=(qo_indptr, None, "CUDA-graph buffers"),
            kv_indptr=(kv_indptr, None, "CUDA-graph buffers"),
            kv_indices=(kv_indices, None, "CUDA-graph buffers"),
            kv_len_arr=(kv_len_arr, None, "CUDA-graph buffers"),
            backend=(backend, "auto", "the server picks its kernels"))
        super().__init__(float_workspace_buffer, "NHD")

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads: int,
             head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool,
             sm_scale: float, q_data_type, kv_data_type, use_profiler: bool = False) -> None:
        """Plans a step (FlashInfer's arguments): qo_indptr [batch + 1] (query
        rows of each request), kv_indptr [batch + 1] into kv_indices (page
        indices into the PagedKVCache, 0..max_num_pages-1), kv_len_arr
        [batch] (each request's KV length in tokens: it reads the first
        ceil(kv_len / page_size) of its pages); num_heads, head_dim_ckv (kv_lora_rank),
        head_dim_kpe (qk_rope_head_dim) and page_size must be the server's.
        causal: bottom-right (a request's last query row sees every key).
        sm_scale: the model's (DeepSeek: 1/sqrt(qk_nope_head_dim +
        qk_rope_head_dim), times YaRN's mscale^2 where used)."""
        _unsupported(use_profiler=(use_profiler, False, "no kernel profiler"))
        cache = self._cache
        _check_geometry(cache, num_heads=(num_heads, "num_qo_heads"),
                        head_dim_ckv=(head_dim_ckv, "kv_lora_rank"),
                        head_dim_kpe=(head_dim_kpe, "qk_rope_head_dim"),
                        page_size=(page_size, "page_size"))
        qo = _ints(qo_indptr, "qo_indptr")
        kv_indptr_a = _ints(kv_indptr, "kv_indptr")
        kv_lens = _ints(kv_len_arr, "kv_len_arr")
        batch = len(kv_lens)
        if len(kv_indptr_a) != batch + 1:
            raise ValueError(f"kv_indptr has {len(kv_indptr_a)} entries, must have "
                             f"len(kv_len_arr) + 1 = {batch + 1}")
        if batch and np.any(kv_lens < 0):
            raise ValueError(f"kv_len_arr[{int(np.nonzero(kv_lens < 0)[0][0])}] is negative")
        ps = cache.page_size
        pages = np.diff(kv_indptr_a) if batch else np.zeros(0, np.int64)
        need = -(-kv_lens // ps)
        if np.any(pages < need):
            b = int(np.nonzero(pages < need)[0][0])
            raise ValueError(f"request {b} has {int(pages[b])} pages in kv_indptr for "
                             f"kv_len_arr[{b}]={int(kv_lens[b])}: it needs ceil(kv_len / "
                             f"page_size={ps}) = {int(need[b])}")
        if np.any(pages > need):
            # As FlashInfer: a request reads its first ceil(kv_len / page_size)
            # pages; the spare ones after them are not used.
            idx = _ints(kv_indices, "kv_indices")
            if kv_indptr_a[0] < 0 or kv_indptr_a[-1] > len(idx):
                raise ValueError(f"kv_indptr runs from {int(kv_indptr_a[0])} to "
                                 f"{int(kv_indptr_a[-1])}, outside [0, len(kv_indices)="
                                 f"{len(idx)}]")
            keep = np.concatenate([np.arange(kv_indptr_a[b], kv_indptr_a[b] + need[b])
                                   for b in range(batch)]).astype(np.int64)
            kv_indices = idx[keep]
            kv_indptr_a = np.concatenate([[0], np.cumsum(need)]).astype(np.int64)
        last = np.where(kv_lens > 0, kv_lens - (need - 1) * ps, 0)
        kv_indptr_a, kv_pages, kv_last = _check_layout(
            cache, kv_indptr_a, kv_indices, last, ("kv_indptr", "kv_indices", "kv_len_arr"))
        if sm_scale is None:
            raise ValueError("sm_scale: a number (FlashInfer's MLA plan takes the model's scale)")
        if causal:
            q_lens = np.diff(qo)
            if len(q_lens) == batch and np.any(q_lens > kv_lens):
                b = int(np.nonzero(q_lens > kv_lens)[0][0])
                raise ValueError(f"request {b} has {int(q_lens[b])} query rows but "
                                 f"kv_len_arr[{b}]={int(kv_lens[b])}: causal rows must "
                                 "already be in the cache")
        self._set_plan(qo, kv_indptr_a, kv_pages, kv_last, causal=bool(causal),
                       sm_scale=sm_scale, window_left=-1, logits_soft_cap=None,
                       q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=None)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None,
            return_lse: bool = False, profiler_buffer=None, kv_len=None, page_table=None,
            return_lse_base_on_e: bool = False, o_scale=None, *, ckv_scale=None,
            ckv_scale_arr=None, kpe_scale=None):
        """Attention of the absorbed queries q_nope [rows, num_heads,
        head_dim_ckv] and q_pe [rows, num_heads, head_dim_kpe] over the
        latent rows of ckv_cache = kpe_cache = kv_cache[layer]: the output
        [rows, num_heads, head_dim_ckv] (each head's latent, to multiply by
        W_UV), or (output, lse [rows, num_heads]) with return_lse (base 2;
        base e with return_lse_base_on_e)."""
        return self._now(lambda: self.run_async(q_nope, q_pe, ckv_cache, kpe_cache, out, lse,
                                                return_lse, profiler_buffer, kv_len, page_table,
                                                return_lse_base_on_e, o_scale,
                                                ckv_scale=ckv_scale, ckv_scale_arr=ckv_scale_arr,
                                                kpe_scale=kpe_scale))

    def run_return_lse(self, q_nope, q_pe, ckv_cache, kpe_cache, *args, **kwargs):
        """run() with return_lse=True (an attnserve addition, as the GQA
        wrappers' run_return_lse; FlashInfer's MLA wrapper has none)."""
        return self.run(q_nope, q_pe, ckv_cache, kpe_cache, *args, return_lse=True, **kwargs)

    def run_async(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None,
                  return_lse: bool = False, profiler_buffer=None, kv_len=None,
                  page_table=None, return_lse_base_on_e: bool = False, o_scale=None, *,
                  ckv_scale=None, ckv_scale_arr=None, kpe_scale=None) -> AttentionFuture:
        """run(), returning an AttentionFuture as soon as the request is sent.
        o_scale (FlashInfer's dequantization scale of an FP8 output), ckv_scale
        and kpe_scale (of an FP8 cache) may only be None or 1.0: the output is
        bf16 or fp16, and the server keeps its cache's scales (set_kv_scales)."""
        fp8_scales = "the server applies its cache's own KV scales (client.set_kv_scales)"

        def unit(x):  # 1.0 (a float) is no scale at all
            return None if x is None or (not torch.is_tensor(x) and x == 1.0) else x
        _unsupported(profiler_buffer=(profiler_buffer, None, "no kernel profiler"),
                     kv_len=(kv_len, None, "the cutlass backend's layout: plan() has it"),
                     page_table=(page_table, None, "the cutlass backend's layout: plan() "
                                 "has it"),
                     o_scale=(unit(o_scale), None, "the scale of an FP8 output: attnserve "
                              "writes the output in q's 16-bit dtype"),
                     ckv_scale=(unit(ckv_scale), None, fp8_scales),
                     kpe_scale=(unit(kpe_scale), None, fp8_scales),
                     ckv_scale_arr=(ckv_scale_arr, None, fp8_scales))
        cache = self._cache
        if not isinstance(kpe_cache, LayerCache) or kpe_cache is not ckv_cache:
            if isinstance(ckv_cache, LayerCache) and isinstance(kpe_cache, LayerCache):
                raise ValueError("kpe_cache: the same layer as ckv_cache (kv_cache[layer]): the "
                                 "server keeps each token's c_kv and k_pe in one latent row")
            _layer_of(cache, kpe_cache, "kpe_cache")
        _layer_of(cache, ckv_cache, "ckv_cache")
        for name, t, width in (("q_nope", q_nope, cache.kv_lora_rank),
                               ("q_pe", q_pe, cache.qk_rope_head_dim)):
            if not torch.is_tensor(t):
                raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
            if t.dim() != 3 or t.shape[1] != cache.num_qo_heads or t.shape[2] != width:
                raise ValueError(f"{name} has shape {list(t.shape)}, must be [rows, num_heads="
                                 f"{cache.num_qo_heads}, {width}]")
        if q_pe.shape[0] != q_nope.shape[0] or q_pe.dtype != q_nope.dtype:
            raise ValueError(f"q_pe ({list(q_pe.shape)}, {q_pe.dtype}) must have q_nope's rows "
                             f"and dtype ({list(q_nope.shape)}, {q_nope.dtype})")
        if q_pe.device != q_nope.device:
            raise ValueError(f"q_pe is on {q_pe.device}, q_nope on {q_nope.device}")
        q = torch.cat([q_nope, q_pe], dim=-1)
        return self._run(q, ckv_cache, (), q_scale=None, k_scale=None, v_scale=None, out=out,
                         lse=lse, return_lse=return_lse, window_left=None, sinks=None,
                         causal=self._causal, lse_base="e" if return_lse_base_on_e else "2")


def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache,
                              kpe_cache, kv_indices, kv_indptr, kv_last_page_len) -> None:
    """FlashInfer's append_paged_mla_kv_cache into the server's latent cache:
    append_ckv [nnz, head_dim_ckv] (c_kv after its RMSNorm) and append_kpe
    [nnz, head_dim_kpe] (k_pe after rope) in the cache's dtype; row i goes to
    position positions[i] of request batch_indices[i], whose pages are
    kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (already including the
    appended rows, as in FlashInfer). ckv_cache = kpe_cache = kv_cache[layer].
    The rows are queued and reach the server with that layer's next run()
    (fused into its request) or kv_cache.flush()."""
    if not isinstance(ckv_cache, LayerCache):
        raise TypeError("ckv_cache: an attnserve.flashinfer.LayerCache (kv_cache[layer] of a "
                        f"PagedKVCache) expected, not {type(ckv_cache).__name__}")
    if kpe_cache is not ckv_cache:
        raise ValueError("kpe_cache: the same layer as ckv_cache (kv_cache[layer]): the server "
                         "keeps each token's c_kv and k_pe in one latent row")
    cache = ckv_cache.cache
    cache._check_open()
    if not cache.mla:
        raise ValueError("ckv_cache: the server computes grouped-query attention "
                         "(attention=gqa): use append_paged_kv_cache")
    nnz = None
    for name, t, width in (("append_ckv", append_ckv, cache.kv_lora_rank),
                           ("append_kpe", append_kpe, cache.qk_rope_head_dim)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
        if t.dim() != 2 or t.shape[1] != width:
            raise ValueError(f"{name} has shape {list(t.shape)}, must be [nnz, {width}]")
        if t.dtype != cache.dtype:
            raise ValueError(f"{name} has dtype {t.dtype}; the server's KV cache holds "
                             f"{cache.dtype}")
        nnz = t.shape[0] if nnz is None else nnz
        if t.shape[0] != nnz:
            raise ValueError(f"append_kpe has {t.shape[0]} rows, append_ckv {nnz}: they must "
                             "match")
    slots = _append_slots(cache, batch_indices, positions, kv_indices, kv_indptr,
                          kv_last_page_len, nnz)
    rows = torch.cat([append_ckv.detach(), append_kpe.detach().to(append_ckv.device)],
                     dim=-1).unsqueeze(1)
    cache._queue(ckv_cache.layer, slots, rows, None)
