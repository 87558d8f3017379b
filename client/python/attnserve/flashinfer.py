"""FlashInfer's paged-KV attention API on attnserve (docs/flashinfer.md).

    import attnserve
    import attnserve.flashinfer as flashinfer      # instead of `import flashinfer`

    client = attnserve.Client("127.0.0.1:50051")
    kv_cache = flashinfer.PagedKVCache(client, max_num_pages=128)   # the server's cache
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(kv_cache, "NHD")
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads,
                 head_dim, page_size, q_data_type=torch.bfloat16)
    for layer in range(num_layers):
        flashinfer.append_paged_kv_cache(k, v, batch_indices, positions, kv_cache[layer],
                                         kv_indices, kv_indptr, kv_last_page_len)
        o = wrapper.run(q, kv_cache[layer])

The classes and functions have FlashInfer's names, signatures and defaults
(FlashInfer 0.6, python/flashinfer/decode.py, prefill.py, page.py), and every
argument means what FlashInfer's documentation says. Two differ, because
the server owns what a FlashInfer caller owns:

  * the KV cache: FlashInfer's caller allocates a tensor of max_num_pages
    pages per layer; here PagedKVCache(client, max_num_pages) allocates
    max_num_pages pages on the server (under a lease of its own), and
    kv_cache[layer] stands wherever FlashInfer takes a layer's cache tensor
    (run's paged_kv_cache, append_paged_kv_cache's). Page indices are the
    caller's, 0..max_num_pages-1, as into a FlashInfer cache tensor; the
    cache maps them to the server's page ids.
  * the workspace: the wrappers' first argument, float_workspace_buffer, is
    the PagedKVCache (the server plans in its own workspace).

An FP8 server (--kv_dtype=fp8_e4m3 or fp8_e5m2) is planned as FlashInfer's
FP8 cache is: q_data_type the queries' dtype (kv_cache.dtype), kv_data_type
the cache's (kv_cache.kv_dtype: torch.float8_e4m3fn or float8_e5m2).
append_paged_kv_cache takes rows in either: FP8 rows are stored as they are,
16-bit rows quantized by the server with its KV scales (set_kv_scales; 1.0
unless set). run()'s k_scale and v_scale multiply the logits and the output,
as FlashInfer's do, on top of the server's scales: an engine that quantizes
its rows itself and passes its scales to run() leaves the server's at 1.0.

Options attnserve does not support raise NotImplementedError naming them
(docs/flashinfer.md has the table); none is silently ignored.

plan() registers the step's layout with the server (CreatePlan) when the
first run() needs it, under the cache's lease, so that every layer's run()
sends only q (and that layer's appended K/V) with the plan's id; a step's
plans are released once its runs have their answers (at a later plan(), or
at close()). append_paged_kv_cache() queues the rows: they reach the
server with the next run() of that layer, fused into its Prefill (the rows
are written before the attention reads them, as in FlashInfer), or at
kv_cache.flush().

Transports (PagedKVCache(transport=...)):
  "grpc"     every run() is a Prefill over gRPC with the tensors inline;
  "shm"      q, the appended K/V, the output and the LSE go through a
             shared-memory region of this process (server on this host with
             --allow_shared_memory); the call is still gRPC;
  "channel"  the same region, and the calls go through a request channel
             (a ring the server polls): no gRPC call per layer;
  "cuda"     torch CUDA tensors stay on the GPU: a CUDA region, through a
             channel (a CUDA-backend server on this host); the caller's
             current stream is synchronized before each request is sent and
             the outputs are copied out on it (tests/python/
             test_flashinfer_cuda.py, run on an H200).
run_async() returns an AttentionFuture at once, so that an engine can do
its own work while the server computes; run() is run_async().result().
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - the module is torch's API
    raise ImportError("attnserve.flashinfer needs torch (FlashInfer's API takes torch "
                      "tensors): install python3-torch") from e

# The cache and its transports, and the wrappers' base, in modules of their
# own; their public names are this module's.
from attnserve._flashinfer_transport import AttentionFuture
from attnserve._flashinfer_cache import (TRANSPORTS, LayerCache, PagedKVCache,
                                         _append_slots, _check_geometry, _check_kv_layout, _int_arg,
                                         _check_layout, _ints, _seq_lens, _unsupported)
from attnserve._flashinfer_wrapper import _check_tensor, _Wrapper
# Multi-head latent attention (an MLA server): its wrapper and append.
from attnserve._flashinfer_mla import BatchMLAPagedAttentionWrapper, append_paged_mla_kv_cache
# flashinfer.cascade's merges of attention states (computed here, in torch).
from attnserve._flashinfer_cascade import merge_state, merge_state_in_place, merge_states

__all__ = ["PagedKVCache", "LayerCache", "AttentionFuture",
           "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
           "BatchMLAPagedAttentionWrapper", "append_paged_kv_cache",
           "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens",
           "merge_state", "merge_state_in_place", "merge_states", "TRANSPORTS"]


def _no_split(fixed_split_size):
    """FlashInfer's fixed_split_size, with its -1 (no fixed split, what
    engines pass by default) as None."""
    if not torch.is_tensor(fixed_split_size) and fixed_split_size == -1:
        return None
    return fixed_split_size


class BatchDecodeWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on attnserve.

    float_workspace_buffer: the attnserve.flashinfer.PagedKVCache (the
      server owns the cache and the workspace); every other argument as in
      FlashInfer. use_tensor_cores picks FlashInfer's kernel and changes no
      result: attnserve's server picks its own. use_cuda_graph, the CUDA-graph
      buffers, a backend other than "auto" and jit_args raise
      NotImplementedError.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, use_tensor_cores: bool = False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend: str = "auto",
                 jit_args: Optional[List[Any]] = None) -> None:
        _unsupported(
            use_cuda_graph=(use_cuda_graph, False, "no CUDA graphs: each run is a request"),
            paged_kv_indptr_buffer=(paged_kv_indptr_buffer, None, "CUDA-graph buffers"),
            paged_kv_indices_buffer=(paged_kv_indices_buffer, None, "CUDA-graph buffers"),
            paged_kv_last_page_len_buffer=(paged_kv_last_page_len_buffer, None,
                                           "CUDA-graph buffers"),
            backend=(backend, "auto", "the server picks its kernels"),
            jit_args=(jit_args, None, "custom JIT kernels"))
        super().__init__(float_workspace_buffer, kv_layout)
        self._use_tensor_cores = bool(use_tensor_cores)

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, indptr, indices, last_page_len, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None, data_type=None,
             sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
             rope_theta: Optional[float] = None, non_blocking: bool = True,
             block_tables=None, seq_lens=None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False, q_len_per_req: int = 1, *,
             window_right: int = 0) -> None:
        """Plans a decode step (FlashInfer's arguments and defaults): indptr
        [batch + 1], indices (page indices into the PagedKVCache,
        0..max_num_pages-1), last_page_len [batch]; the geometry must be the
        server's. rope_scale and rope_theta take effect only with a
        pos_encoding_mode other than "NONE", as in FlashInfer (which raises
        NotImplementedError here); non_blocking changes nothing (no copy to a
        device is made)."""
        _unsupported(
            pos_encoding_mode=(pos_encoding_mode, "NONE", "apply RoPE / ALiBi to q and k "
                               "before the call"),
            window_right=(window_right, 0, "no right window bound"),
            block_tables=(block_tables, None, "the trtllm-gen layout: use indptr / indices"),
            seq_lens=(seq_lens, None, "the trtllm-gen layout: use indptr / last_page_len"),
            fixed_split_size=(_no_split(fixed_split_size), None,
                              "the server splits KV its own way; -1, as None, is none"),
            disable_split_kv=(disable_split_kv, False, "the server splits KV its own way"))
        if _int_arg(q_len_per_req, "q_len_per_req") < 1:
            raise ValueError(f"q_len_per_req must be >= 1, got {q_len_per_req}")
        cache = self._cache
        _check_geometry(cache, num_qo_heads=(num_qo_heads, "num_qo_heads"),
                        num_kv_heads=(num_kv_heads, "num_kv_heads"),
                        head_dim=(head_dim, "head_dim"), page_size=(page_size, "page_size"))
        kv_indptr, kv_indices, kv_last = _check_layout(
            cache, indptr, indices, last_page_len, ("indptr", "indices", "last_page_len"))
        if data_type is not None:        # FlashInfer's rule for the deprecated argument
            if q_data_type is None:
                q_data_type = data_type
            if kv_data_type is None:
                kv_data_type = data_type
        if q_data_type is None:
            raise ValueError("q_data_type must be a dtype (FlashInfer's default: float16)")
        q_len = int(q_len_per_req)
        if q_len > 1:
            kv_lens = _seq_lens(kv_indptr, kv_last, cache.page_size)
            if kv_lens.size and kv_lens.min() < q_len:
                raise ValueError(f"q_len_per_req={q_len} requires kv_len >= q_len_per_req for "
                                 f"every request (the rows must already be appended), but a "
                                 f"request has kv_len={int(kv_lens.min())}")
        qo_indptr = np.arange(len(kv_last) + 1, dtype=np.int64) * q_len
        self._set_plan(qo_indptr, kv_indptr, kv_indices, kv_last, causal=q_len > 1,
                       sm_scale=sm_scale, window_left=window_left,
                       logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, o_data_type=o_data_type)
        self._q_len_per_req = q_len  # once the plan is taken: a refused one changes nothing

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse: bool = False, enable_pdl=None,
            window_left: Optional[int] = None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        """Decode attention of q [batch * q_len_per_req, num_qo_heads,
        head_dim] over paged_kv_cache (kv_cache[layer]): the output [same
        shape], or (output, lse [rows, num_qo_heads], base 2) with
        return_lse. enable_pdl is a CUDA launch detail and changes nothing.
        window_left must be None or the plan's (FlashInfer's rule)."""
        return self._now(lambda: self.run_async(
            q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
            lse=lse, return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left,
            sinks=sinks, q_len_per_req=q_len_per_req,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            kv_cache_sf=kv_cache_sf))

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    # FlashInfer's deprecated names (still called by engines): begin_forward
    # is plan; forward and forward_return_lse set the plan-time options they
    # are given, for this and later runs, then run; end_forward does nothing.
    begin_forward = plan

    def forward(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE", q_scale=None,
                k_scale=None, v_scale=None, window_left: int = -1,
                logits_soft_cap: Optional[float] = None, sm_scale: Optional[float] = None,
                rope_scale: Optional[float] = None, rope_theta: Optional[float] = None):
        return self._forward(q, paged_kv_cache, False, pos_encoding_mode=pos_encoding_mode,
                             q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                             window_left=window_left, logits_soft_cap=logits_soft_cap,
                             sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)

    def forward_return_lse(self, q, paged_kv_cache, pos_encoding_mode: str = "NONE",
                           q_scale=None, k_scale=None, v_scale=None, window_left: int = -1,
                           logits_soft_cap: Optional[float] = None,
                           sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                           rope_theta: Optional[float] = None):
        return self._forward(q, paged_kv_cache, True, pos_encoding_mode=pos_encoding_mode,
                             q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                             window_left=window_left, logits_soft_cap=logits_soft_cap,
                             sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)

    def run_async(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                  out=None, lse=None, return_lse: bool = False, enable_pdl=None,
                  window_left: Optional[int] = None, sinks=None, q_len_per_req=None,
                  skip_softmax_threshold_scale_factor=None,
                  kv_cache_sf=None) -> AttentionFuture:
        """run(), returning an AttentionFuture as soon as the request is sent."""
        _unsupported(
            skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None,
                                                 "no skip-softmax sparsity"),
            kv_cache_sf=(kv_cache_sf, None, "no NVFP4 KV cache"))
        if not self._planned:
            raise RuntimeError("BatchDecodeWithPagedKVCacheWrapper.run() before plan()")
        if window_left is not None and int(window_left) != self._window_left:
            raise ValueError(f"window_left={window_left} differs from plan()'s "
                             f"{self._window_left}: the decode wrapper's run() takes None or "
                             "the plan's value, as FlashInfer's")
        if q_len_per_req is not None and torch.is_tensor(q):
            expected = (len(self._qo_indptr) - 1) * int(q_len_per_req)
            if q.shape[0] != expected:
                raise ValueError(f"q.shape[0] ({q.shape[0]}) does not match batch_size * "
                                 f"q_len_per_req ({expected})")
        return self._run(q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                         window_left=None, sinks=sinks, causal=self._q_len_per_req > 1)


class BatchPrefillWithPagedKVCacheWrapper(_Wrapper):
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper on attnserve.

    float_workspace_buffer: the attnserve.flashinfer.PagedKVCache (the
      server owns the cache and the workspace); every other argument as in
      FlashInfer. use_cuda_graph, its buffers, custom masks, a backend other
      than "auto", jit_args and jit_kwargs raise NotImplementedError.
    """

    def __init__(self, float_workspace_buffer, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf=None, paged_kv_indptr_buf=None,
                 paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend: str = "auto",
                 jit_args: Optional[List[Any]] = None, jit_kwargs=None) -> None:
        graph = "CUDA-graph buffers"
        _unsupported(
            use_cuda_graph=(use_cuda_graph, False, "no CUDA graphs: each run is a request"),
            qo_indptr_buf=(qo_indptr_buf, None, graph),
            paged_kv_indptr_buf=(paged_kv_indptr_buf, None, graph),
            paged_kv_indices_buf=(paged_kv_indices_buf, None, graph),
            paged_kv_last_page_len_buf=(paged_kv_last_page_len_buf, None, graph),
            custom_mask_buf=(custom_mask_buf, None, "no custom masks"),
            mask_indptr_buf=(mask_indptr_buf, None, "no custom masks"),
            backend=(backend, "auto", "the server picks its kernels"),
            jit_args=(jit_args, None, "custom JIT kernels"),
            jit_kwargs=(jit_kwargs, None, "custom JIT kernels"))
        super().__init__(float_workspace_buffer, kv_layout)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: Optional[int] = None, custom_mask=None, packed_custom_mask=None,
             causal: bool = False, pos_encoding_mode: str = "NONE",
             use_fp16_qk_reduction: bool = False, sm_scale: Optional[float] = None,
             window_left: int = -1, logits_soft_cap: Optional[float] = None,
             rope_scale: Optional[float] = None, rope_theta: Optional[float] = None,
             q_data_type="float16", kv_data_type=None, o_data_type=None,
             non_blocking: bool = True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len: int = 0, max_item_len_ptr=None, seq_lens=None,
             seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
             max_sequence_kv=None, fixed_split_size: Optional[int] = None,
             disable_split_kv: bool = False) -> None:
        """Plans a prefill / append step (FlashInfer's arguments and
        defaults; causal defaults to False, as FlashInfer's; the mask is
        aligned bottom-right): qo_indptr [batch + 1], paged_kv_indptr
        [batch + 1], paged_kv_indices (page indices into the PagedKVCache),
        paged_kv_last_page_len [batch]. rope_scale and rope_theta take effect
        only with a pos_encoding_mode other than "NONE", as in FlashInfer
        (which raises NotImplementedError here); non_blocking changes nothing."""
        cache = self._cache
        _unsupported(
            head_dim_vo=(head_dim_vo if head_dim_vo != head_dim_qk else None, None,
                         "head_dim_vo must be head_dim_qk"),
            custom_mask=(custom_mask, None, "no custom masks: causal, windows"),
            packed_custom_mask=(packed_custom_mask, None, "no custom masks: causal, windows"),
            pos_encoding_mode=(pos_encoding_mode, "NONE", "apply RoPE / ALiBi to q and k "
                               "before the call"),
            use_fp16_qk_reduction=(use_fp16_qk_reduction, False, "the server accumulates in "
                                   "fp32"),
            prefix_len_ptr=(prefix_len_ptr, None, "no multi-item scoring"),
            token_pos_in_items_ptr=(token_pos_in_items_ptr, None, "no multi-item scoring"),
            token_pos_in_items_len=(token_pos_in_items_len, 0, "no multi-item scoring"),
            max_item_len_ptr=(max_item_len_ptr, None, "no multi-item scoring"),
            seq_lens=(seq_lens, None, "the trtllm-gen / cudnn layout: use the indptrs"),
            seq_lens_q=(seq_lens_q, None, "the trtllm-gen / cudnn layout: use the indptrs"),
            block_tables=(block_tables, None, "the trtllm-gen layout: use the indptrs"),
            max_token_per_sequence=(max_token_per_sequence, None, "cudnn only"),
            max_sequence_kv=(max_sequence_kv, None, "cudnn only"),
            fixed_split_size=(_no_split(fixed_split_size), None,
                              "the server splits KV its own way; -1, as None, is none"),
            disable_split_kv=(disable_split_kv, False, "the server splits KV its own way"))
        _check_geometry(cache, num_qo_heads=(num_qo_heads, "num_qo_heads"),
                        num_kv_heads=(num_kv_heads, "num_kv_heads"),
                        head_dim_qk=(head_dim_qk, "head_dim"), page_size=(page_size, "page_size"))
        kv_indptr, kv_indices, kv_last = _check_layout(
            cache, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
            ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        qo = _ints(qo_indptr, "qo_indptr")
        if q_data_type is None:
            raise ValueError("q_data_type must be a dtype (FlashInfer's default: float16)")
        self._set_plan(qo, kv_indptr, kv_indices, kv_last, causal=bool(causal),
                       sm_scale=sm_scale, window_left=window_left,
                       logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, o_data_type=o_data_type)

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
            out=None, lse=None, return_lse: bool = False, enable_pdl=None,
            window_left: Optional[int] = None, sinks=None, kv_cache_sf=None,
            skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
            uses_spcompress=None):
        """Prefill attention of q [qo_indptr[-1], num_qo_heads, head_dim] over
        paged_kv_cache (kv_cache[layer]): the output, or (output, lse base 2)
        with return_lse. window_left overrides the plan's for this call (-1:
        none); enable_pdl is a CUDA launch detail and changes nothing."""
        return self._now(lambda: self.run_async(
            q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, out=out,
            lse=lse, return_lse=return_lse, enable_pdl=enable_pdl, window_left=window_left,
            sinks=sinks, kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress))

    def run_return_lse(self, q, paged_kv_cache, *args, **kwargs):
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kwargs)

    # FlashInfer's deprecated names, as the decode wrapper's; forward's causal
    # (default False, as FlashInfer's) replaces the plan's too.
    begin_forward = plan

    def forward(self, q, paged_kv_cache, causal: bool = False, pos_encoding_mode: str = "NONE",
                use_fp16_qk_reduction: bool = False, k_scale=None, v_scale=None,
                window_left: int = -1, logits_soft_cap: Optional[float] = None,
                sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                rope_theta: Optional[float] = None):
        return self._forward(q, paged_kv_cache, False, causal=causal,
                             pos_encoding_mode=pos_encoding_mode,
                             use_fp16_qk_reduction=use_fp16_qk_reduction, k_scale=k_scale,
                             v_scale=v_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta)

    def forward_return_lse(self, q, paged_kv_cache, causal: bool = False,
                           pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                           k_scale=None, v_scale=None, window_left: int = -1,
                           logits_soft_cap: Optional[float] = None,
                           sm_scale: Optional[float] = None, rope_scale: Optional[float] = None,
                           rope_theta: Optional[float] = None):
        return self._forward(q, paged_kv_cache, True, causal=causal,
                             pos_encoding_mode=pos_encoding_mode,
                             use_fp16_qk_reduction=use_fp16_qk_reduction, k_scale=k_scale,
                             v_scale=v_scale, window_left=window_left,
                             logits_soft_cap=logits_soft_cap, sm_scale=sm_scale,
                             rope_scale=rope_scale, rope_theta=rope_theta)

    def run_async(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None,
                  out=None, lse=None, return_lse: bool = False, enable_pdl=None,
                  window_left: Optional[int] = None, sinks=None, kv_cache_sf=None,
                  skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
                  uses_spcompress=None) -> AttentionFuture:
        """run(), returning an AttentionFuture as soon as the request is sent."""
        _unsupported(
            kv_cache_sf=(kv_cache_sf, None, "no NVFP4 KV cache"),
            skip_softmax_threshold_scale_factor=(skip_softmax_threshold_scale_factor, None,
                                                 "no skip-softmax sparsity"),
            use_fp16_softmax=(use_fp16_softmax, None, "the server's softmax is fp32"),
            uses_spcompress=(uses_spcompress, None, "trtllm-gen's sparse compression"))
        if not self._planned:
            raise RuntimeError("BatchPrefillWithPagedKVCacheWrapper.run() before plan()")
        return self._run(q, paged_kv_cache, args, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                         window_left=window_left, sinks=sinks, causal=self._causal)


# ---------------------------------------------------------------- page.py
def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                          kv_indices, kv_indptr, kv_last_page_len,
                          kv_layout: str = "NHD") -> None:
    """FlashInfer's append_paged_kv_cache into the server's cache:
    append_key, append_value [nnz, num_kv_heads, head_dim] in the cache's
    dtype (an FP8 cache: kv_cache.dtype rows, which the server quantizes
    with its KV scales, or kv_cache.kv_dtype rows, stored as they are); row i goes to position positions[i] of request batch_indices[i],
    whose pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]] (which, as in
    FlashInfer, already include the appended rows). paged_kv_cache is
    kv_cache[layer]. The rows are queued and reach the server with that
    layer's next run() (fused into its request) or kv_cache.flush()."""
    if not isinstance(paged_kv_cache, LayerCache):
        raise TypeError("paged_kv_cache: an attnserve.flashinfer.LayerCache (kv_cache[layer] of "
                        f"a PagedKVCache) expected, not {type(paged_kv_cache).__name__}")
    cache = paged_kv_cache.cache
    cache._check_open()
    _check_kv_layout(kv_layout)
    if cache.mla:
        raise ValueError("paged_kv_cache: the server computes multi-head latent attention "
                         "(attention=mla), whose cache holds latent rows and no V: use "
                         "append_paged_mla_kv_cache")
    shape = None
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if not torch.is_tensor(t):
            raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
        if t.dim() != 3 or t.shape[1:] != (cache.num_kv_heads, cache.head_dim):
            raise ValueError(f"{name} has shape {list(t.shape)}, must be [nnz, "
                             f"num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}]")
        if t.dtype != cache.dtype and t.dtype != cache.kv_dtype:
            if cache.kv_fp8:
                raise ValueError(f"{name} has dtype {t.dtype}; the server's KV cache holds "
                                 f"{cache.kv_format} and takes {cache.dtype} rows (quantized "
                                 f"by the server with its KV scales) or {cache.kv_dtype} rows "
                                 "(stored as they are)")
            raise ValueError(f"{name} has dtype {t.dtype}; the server's KV cache holds "
                             f"{cache.dtype}")
        shape = shape or tuple(t.shape)
        if tuple(t.shape) != shape:
            raise ValueError(f"append_value has shape {list(t.shape)}, append_key "
                             f"{list(shape)}: they must match")
    if append_key.dtype != append_value.dtype:
        raise ValueError(f"append_key has dtype {append_key.dtype}, append_value "
                         f"{append_value.dtype}: they must match")
    nnz = shape[0]
    slots = _append_slots(cache, batch_indices, positions, kv_indices, kv_indptr,
                          kv_last_page_len, nnz)
    cache._queue(paged_kv_cache.layer, slots, append_key.detach().clone(),
                 append_value.detach().clone())


def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int):
    """FlashInfer's get_seq_lens: each request's KV length,
    max(pages - 1, 0) * page_size + kv_last_page_len."""
    indptr = torch.as_tensor(kv_indptr)
    last = torch.as_tensor(kv_last_page_len)
    return torch.clamp(indptr[1:] - indptr[:-1] - 1, min=0) * page_size + last


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int, batch_indices=None,
                                positions=None):
    """FlashInfer's get_batch_indices_positions: for each of the nnz rows of
    a ragged append (append_indptr [batch + 1]), its request and its position
    in it, the appended rows being the last of each request's seq_lens
    tokens. int32 tensors on append_indptr's device (filled in place when
    given)."""
    indptr = torch.as_tensor(append_indptr)
    device = indptr.device
    ind = indptr.to("cpu", torch.int64)
    lens = torch.as_tensor(seq_lens).to("cpu", torch.int64)
    batch = ind.numel() - 1
    if lens.numel() != batch:
        raise ValueError(f"seq_lens has {lens.numel()} entries, must have "
                         f"len(append_indptr) - 1 = {batch}")
    counts = ind[1:] - ind[:-1]
    if batch and (counts.min() < 0 or ind[0] != 0):
        raise ValueError("append_indptr must start at 0 and be non-decreasing")
    total = int(ind[-1]) if batch else 0
    if total > nnz:
        raise ValueError(f"append_indptr ends at {total}, past nnz={nnz}")
    if batch and int(lens.max()) > (1 << 31) - 1:  # positions are int32
        b = int(torch.argmax(lens))
        raise ValueError(f"seq_lens[{b}]={int(lens[b])} is past int32 (2^31 - 1)")
    b = torch.repeat_interleave(torch.arange(batch, dtype=torch.int64), counts)
    row = torch.arange(total, dtype=torch.int64) - ind[:-1][b]
    pos = lens[b] - counts[b] + row
    bi_out = torch.full((nnz,), -1, dtype=torch.int32)
    pos_out = torch.zeros((nnz,), dtype=torch.int32)
    bi_out[:total] = b.to(torch.int32)
    pos_out[:total] = pos.to(torch.int32)
    for name, given, made in (("batch_indices", batch_indices, bi_out),
                              ("positions", positions, pos_out)):
        if given is not None:
            _check_tensor(given, name, (nnz,), torch.int32, device)
    if batch_indices is not None:
        batch_indices.copy_(bi_out)
    else:
        batch_indices = bi_out.to(device)
    if positions is not None:
        positions.copy_(pos_out)
    else:
        positions = pos_out.to(device)
    return batch_indices, positions
