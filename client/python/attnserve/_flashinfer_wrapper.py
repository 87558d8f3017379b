"""The base of attnserve.flashinfer's wrappers (plan once, run per layer):
the plan's checks and server plan, and run()'s request."""

from __future__ import annotations

import math
import threading
import weakref
from typing import Optional

import numpy as np

import torch  # attnserve.flashinfer, which imports this module, says when it is missing

from attnserve.layout import AttentionOptions, PrefillLayout
from attnserve.errors import AttnserveError, NotFound, outcome_unknown
from attnserve._flashinfer_transport import AttentionFuture, _Request
from attnserve._flashinfer_cache import (PagedKVCache, _HeldPlans, _check_kv_layout,
                                         _float_arg, _int_arg, _kv_format, _layer_of,
                                         _torch_dtype, _unsupported)


class _Wrapper:
    """What the two wrappers share: the step's layout, its server plans,
    and run()."""

    _kind = ""
    _mla = False   # BatchMLAPagedAttentionWrapper: the cache of an MLA server

    def __init__(self, float_workspace_buffer, kv_layout: str):
        if not isinstance(float_workspace_buffer, PagedKVCache):
            raise TypeError(
                "float_workspace_buffer: an attnserve.flashinfer.PagedKVCache expected (the "
                "server owns the KV cache and the workspace), not "
                f"{type(float_workspace_buffer).__name__}")
        if float_workspace_buffer.mla != self._mla:
            if float_workspace_buffer.mla:
                raise ValueError("float_workspace_buffer: the server computes multi-head latent "
                                 "attention (attention=mla): use BatchMLAPagedAttentionWrapper")
            raise ValueError("float_workspace_buffer: the server computes grouped-query "
                             "attention (attention=gqa): use BatchDecodeWithPagedKVCacheWrapper "
                             "or BatchPrefillWithPagedKVCacheWrapper")
        _check_kv_layout(kv_layout)
        self._cache = float_workspace_buffer
        self._kv_layout = kv_layout
        self._planned = False
        self._plans: dict = {}           # append slots (bytes) -> server plan id
        self._runs: list = []            # AttentionFutures of runs under self._plans
        # Plans of earlier steps, each with the runs made under it: released
        # once those have their answers (a run may still be queued when the
        # next plan() comes, and must not find its plan gone).
        self._retired: list = []         # [(plan ids, futures)]
        self._releases: list = []        # ReleasePlan calls in flight
        # Every server plan id this wrapper holds (in _plans or _retired):
        # given back to the cache's ledger if the wrapper is dropped without
        # close(), and released by the cache's next CreatePlan.
        self._held = _HeldPlans()
        weakref.finalize(self, float_workspace_buffer._server_plans.abandon, self._held)
        self._layouts: dict = {}
        self._tls = threading.local()    # .blocking: inside run() (see _now)

    def _now(self, start):
        """run(): run_async() started by start(), its call made blocking where
        it goes over gRPC (a blocking call costs less than a future waited for
        at once: Client._call_now), and its result."""
        self._tls.blocking = True
        try:
            future = start()
        finally:
            self._tls.blocking = False
        return future.result()

    @property
    def kv_cache(self) -> PagedKVCache:
        return self._cache

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer) -> None:
        """FlashInfer's: the workspace buffers of later plans. The server keeps
        attnserve's workspace, so torch tensors are taken and not used; a
        PagedKVCache must be this wrapper's own (a wrapper stays with its
        cache: make another wrapper for another cache)."""
        if isinstance(float_workspace_buffer, PagedKVCache):
            if float_workspace_buffer is not self._cache:
                raise ValueError("float_workspace_buffer: a PagedKVCache other than this "
                                 "wrapper's: a wrapper stays with the cache it was made with")
        elif not torch.is_tensor(float_workspace_buffer):
            raise TypeError("float_workspace_buffer: a torch tensor or this wrapper's "
                            f"PagedKVCache expected, not {type(float_workspace_buffer).__name__}")
        if not torch.is_tensor(int_workspace_buffer):
            raise TypeError("int_workspace_buffer: a torch tensor expected, not "
                            f"{type(int_workspace_buffer).__name__}")

    def _set_plan(self, qo_indptr: np.ndarray, kv_indptr, kv_indices, kv_last, *,
                  causal: bool, sm_scale, window_left, logits_soft_cap, q_data_type,
                  kv_data_type, o_data_type) -> None:
        cache = self._cache
        cache._check_open()
        q_dt = _torch_dtype(q_data_type, "q_data_type")
        kv_given = kv_data_type if kv_data_type is not None else q_dt
        kv_format = _kv_format(kv_given, "kv_data_type")
        o_dt = _torch_dtype(o_data_type if o_data_type is not None else q_dt, "o_data_type")
        if kv_format != cache.kv_format:
            if not cache.kv_fp8:
                raise ValueError(f"kv_data_type={kv_given}, but the server's KV cache holds "
                                 f"{cache.dtype} (its --kv_dtype); FlashInfer's q_data_type "
                                 f"defaults to float16: pass q_data_type={cache.dtype}")
            raise ValueError(f"kv_data_type={kv_given}, but the server's KV cache holds "
                             f"{cache.kv_format} (its --kv_dtype): pass kv_data_type="
                             f"{cache.kv_dtype}, and q_data_type={cache.dtype} (its --q_dtype)")
        if q_dt != cache.dtype:
            if not cache.kv_fp8:
                raise NotImplementedError(f"attnserve does not support q_data_type={q_dt} with "
                                          f"kv_data_type={kv_given}: q travels in the cache's "
                                          "dtype")
            raise NotImplementedError(f"attnserve does not support q_data_type={q_dt} here: "
                                      f"the server takes queries in {cache.dtype} (its "
                                      "--q_dtype)")
        if o_dt != q_dt:
            raise NotImplementedError(f"attnserve does not support o_data_type={o_dt}: the "
                                      f"output has q's dtype ({q_dt})")
        window_left, cap, sm_scale = _checked_options(window_left, logits_soft_cap, sm_scale)
        if len(qo_indptr) != len(kv_last) + 1:
            raise ValueError(f"qo_indptr has {len(qo_indptr)} entries, must have batch_size + 1 "
                             f"= {len(kv_last) + 1}")
        if qo_indptr[0] != 0 or np.any(np.diff(qo_indptr) < 0):
            raise ValueError("qo_indptr must start at 0 and be non-decreasing")
        self._release_plans()
        self._qo_indptr, self._kv_indptr = qo_indptr, kv_indptr
        self._kv_indices, self._kv_last = kv_indices, kv_last
        self._total_q = int(qo_indptr[-1])
        self._causal = bool(causal)
        self._sm_scale = None if sm_scale is None else float(sm_scale)
        self._window_left = int(window_left)
        self._soft_cap = cap
        self._q_dtype = q_dt
        self._planned = True

    # ------------------------------------------------------------ FlashInfer's old names
    def _forward(self, q, paged_kv_cache, return_lse: bool, *, causal=None,
                 pos_encoding_mode="NONE", use_fp16_qk_reduction=False, q_scale=None,
                 k_scale=None, v_scale=None, window_left=-1, logits_soft_cap=None,
                 sm_scale=None, rope_scale=None, rope_theta=None):
        """FlashInfer's deprecated forward(): the plan-time options it is
        given replace the plan's (for this and later runs, as FlashInfer's
        do), then run()."""
        _unsupported(
            pos_encoding_mode=(pos_encoding_mode, "NONE", "apply RoPE / ALiBi to q and k "
                               "before the call"),
            use_fp16_qk_reduction=(use_fp16_qk_reduction, False, "the server accumulates in "
                                   "fp32"))
        if not self._planned:
            raise RuntimeError(f"{type(self).__name__}.forward() before begin_forward() / plan()")
        window, cap, scale = _checked_options(window_left, logits_soft_cap, sm_scale)
        self._window_left, self._soft_cap, self._sm_scale = window, cap, scale
        if causal is not None:
            self._causal = bool(causal)
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                        return_lse=return_lse)

    def end_forward(self) -> None:
        """FlashInfer's deprecated end_forward(): does nothing (plan() and
        close() release the server plans)."""

    # ------------------------------------------------------------ server plans
    # Retired steps whose runs are not all answered, past which plan() waits
    # for the oldest (so that a caller who never reads run_async's results
    # still holds a bounded number of server plans).
    _MAX_RETIRED = 4

    def _release_plans(self, wait: bool = False) -> None:
        """Retires the last step's server plans; each step's go once its runs
        have their answers (wait: once they have them, waiting here)."""
        self._settle_releases()
        if self._plans:
            self._retired.append((list(self._plans.values()), self._runs))
        self._plans, self._layouts, self._runs = {}, {}, []
        rpc = self._cache.rpc
        keep = []
        for i, (plan_ids, runs) in enumerate(self._retired):
            if wait or i < len(self._retired) - self._MAX_RETIRED:
                for f in runs:
                    f._complete()   # its answer or error kept for its result()
            elif not all(f.done() for f in runs):
                keep.append((plan_ids, runs))
                continue
            for plan_id in plan_ids:
                self._held.ids.discard(plan_id)
                self._cache._server_plans.forget(plan_id)
                try:
                    self._releases.append(rpc._call_future(rpc._req_release_plan(plan_id), None))
                except AttnserveError:
                    self._cache._server_plans.doubt()  # the next CreatePlan releases it
        self._retired = keep
        # What a finalizer would have to wait for: the runs this wrapper still
        # keeps (results it holds, nothing more).
        self._held.runs[:] = [f for _, runs in keep for f in runs]

    def _settle_releases(self) -> None:
        for call in self._releases:
            try:
                call.result()
            except NotFound:
                pass  # gone already (idle timeout, lease ended): released either way
            except AttnserveError as e:
                if outcome_unknown(e):
                    self._cache._server_plans.doubt()  # the next CreatePlan releases it
        self._releases = []

    def _server_plan(self, slots: Optional[np.ndarray]):
        """The plan id of this step's layout with `slots` appended, made at
        its first use; None when the appends must go apart (a third kind of
        append in one step)."""
        key = b"" if slots is None else slots.tobytes()
        plan_id = self._plans.get(key)
        if plan_id is None:
            if key and len(self._plans) >= 2:
                return None
            plan_id = self._cache._server_plans.create(self._qo_indptr, self._kv_indptr,
                                                       self._kv_indices, self._kv_last,
                                                       slots if slots is not None else [])
            self._plans[key] = plan_id
            self._held.ids.add(plan_id)
        return plan_id

    def close(self) -> None:
        """Releases this wrapper's server plans now (the cache's close() does too)."""
        if self._cache._closed:
            self._plans, self._runs, self._retired, self._releases = {}, [], [], []
            self._held.ids.clear()
            self._held.runs.clear()
            return
        self._release_plans(wait=True)
        self._settle_releases()

    # ------------------------------------------------------------ run
    def _run(self, q, paged_kv_cache, args, *, q_scale, k_scale, v_scale, out, lse,
             return_lse, window_left, sinks, causal, lse_base: str = "2") -> AttentionFuture:
        cache = self._cache
        cache._check_open()
        if not self._planned:
            raise RuntimeError(f"{type(self).__name__}.run() before plan()")
        if args:
            raise NotImplementedError(f"attnserve does not support run()'s *args ({len(args)} "
                                      "given): they are a custom JIT kernel's arguments")
        layer = _layer_of(cache, paged_kv_cache)
        if not torch.is_tensor(q):
            raise TypeError(f"q: a torch tensor expected, not {type(q).__name__}")
        want = (self._total_q, cache.num_qo_heads, cache.head_dim)
        if tuple(q.shape) != want:
            raise ValueError(f"q has shape {list(q.shape)}, the plan needs {list(want)} "
                             "(total query rows, num_qo_heads, head_dim)")
        if q.dtype != self._q_dtype:
            raise ValueError(f"q has dtype {q.dtype}, which does not match the q_data_type "
                             f"{self._q_dtype} given to plan()")
        if out is not None:
            _check_tensor(out, "out", (*q.shape[:2], cache.v_head_dim), self._q_dtype, q.device)
        if lse is not None:
            _check_tensor(lse, "lse", q.shape[:2], torch.float32, q.device)
        scale = self._sm_scale if self._sm_scale is not None else 1.0 / math.sqrt(cache.head_dim)
        for name, s in (("q_scale", q_scale), ("k_scale", k_scale)):
            if s is not None:
                scale *= _scalar(s, name)
        v_scale = None if v_scale is None else _scalar(v_scale, "v_scale")
        window = self._window_left if window_left is None else _int_arg(window_left,
                                                                         "window_left")
        if window < -1:
            raise ValueError(f"window_left={window_left} must be >= -1 (-1: no window)")
        sink_values = None
        if sinks is not None:
            sink_values = (sinks.detach().to("cpu", torch.float32).reshape(-1).numpy()
                           if torch.is_tensor(sinks) else np.asarray(sinks, np.float32).reshape(-1))
            if len(sink_values) != cache.num_qo_heads:
                raise ValueError(f"sinks has {len(sink_values)} entries, must have num_qo_heads "
                                 f"= {cache.num_qo_heads}")
        options = None
        if window != -1 or self._soft_cap != 0 or sink_values is not None:
            options = AttentionOptions(window_left=window if window != -1 else None,
                                       logits_soft_cap=self._soft_cap or None,
                                       sinks=sink_values)
        runs = cache._take(layer, self._kv_indices)
        if len(runs) > 1:       # rows of both kinds (q dtype, FP8): the earlier ones apart
            cache._write(layer, runs[:-1], after=runs[-1:])
        appended = runs[-1] if runs else None
        k = v = None
        slots = None
        if appended is not None:
            slots, k, v = appended
        try:
            plan_id = self._server_plan(slots)
            if plan_id is None:                 # a third kind of append this step: apart
                cache.rpc.write_kv(layer, slots, k, v)
                appended = slots = k = v = None
                plan_id = self._server_plan(None)
            key = (plan_id, scale, lse_base, bool(causal))
            layout = self._layouts.get(key)
            if layout is None:
                layout = PrefillLayout.for_plan(plan_id, self._total_q,
                                                0 if slots is None else len(slots),
                                                sm_scale=scale, causal=causal, lse_base=lse_base)
                self._layouts[key] = layout
            request = _Request(layer=layer, q=q, layout=layout, k=k, v=v, options=options,
                               out=out, lse=lse, want_lse=bool(return_lse), v_scale=v_scale,
                               blocking=getattr(self._tls, "blocking", False))
            future = cache._transport.submit(request)
        except BaseException:
            if appended is not None:            # not sent: queued again, first
                cache._requeue(layer, [appended])
            raise
        if appended is not None:
            # A call that failed (refused, or its outcome unknown: writing the
            # rows again is harmless) queues its rows again, first, once its
            # failure is read: the next run() of the layer or flush() writes them.
            future._on_error = lambda e: cache._requeue(layer, [appended])
        if len(self._runs) >= 256:              # a plan run for many steps
            self._runs = [f for f in self._runs if not f.done()]
        self._runs.append(future)
        self._held.runs.append(future)
        return future


def _checked_options(window_left, logits_soft_cap, sm_scale):
    """plan()'s window_left, logits_soft_cap and sm_scale, checked as the
    server checks them: (window_left, cap (0: none), sm_scale or None)."""
    window_left = _int_arg(window_left, "window_left")
    if window_left < -1:
        raise ValueError(f"window_left={window_left} must be >= -1 (-1: no window)")
    cap = 0.0 if logits_soft_cap is None else _float_arg(logits_soft_cap, "logits_soft_cap")
    if not (cap == 0 or 1e-30 <= cap <= 1e30):
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be None or 0 (no "
                         "soft-cap) or in [1e-30, 1e30]")
    if sm_scale is not None:
        sm_scale = _float_arg(sm_scale, "sm_scale")
        if not (math.isfinite(sm_scale) and abs(sm_scale) <= 1e30):
            raise ValueError(f"sm_scale={sm_scale} must be finite with |sm_scale| <= 1e30 "
                             "(the server's bound)")
    return window_left, cap, sm_scale


def _scalar(x, name: str) -> float:
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise NotImplementedError(f"attnserve does not support a {name} of {x.numel()} "
                                      "values (per-head scales): one scale only")
        x = x.item()
    value = _float_arg(x, name)
    if not math.isfinite(value):
        raise ValueError(f"{name}={x} must be finite")
    return value


def _check_tensor(t, name: str, shape, dtype, device) -> None:
    if not torch.is_tensor(t):
        raise TypeError(f"{name}: a torch tensor expected, not {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {list(t.shape)}, must be {list(shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} has dtype {t.dtype}, must be {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, must be on q's device {device}")
