"""Ember's attention kernel: ``attention_forward`` behind ``ember::attention`` (ops/attention.py).

One program computes ``BLOCK_M`` query rows of one (batch, head): it walks the keys ``BLOCK_N`` at
a time, scores them on the tensor cores (``tl.dot``, float32 sums), adds the mask (additive) or
drops the masked keys (boolean, causal), and keeps a running maximum, sum and weighted sum of the
values (the online softmax), so the scores never reach memory. Every tensor is read through its
own strides, a broadcast mask through zero strides. A row whose every key is masked gives zeros
(the fused backends' answer; ATen's composite gives NaN). ``UPCAST`` is for Triton's interpreter
only: operands go to float32 first (it multiplies bfloat16 bits, not values). The row maxima and
sums go through ``tl.reduce`` with ``tl.standard``'s combine functions, which the interpreter runs
as numpy reductions (``tl.max``/``tl.sum`` are not callable from a module loaded for it; another
combine function runs element by element there, seconds a call). Load this file with
``runtime.kernels.load_module``.
"""

import triton
import triton.language as tl


@triton.jit
def attention_forward(q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr, H, LQ, LK, D, DV,
                      sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                      smb, smh, smm, smn, sob, soh, som, sod,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      SCALE: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, UPCAST: tl.constexpr):
    """``SCALE``: the scores' factor (a constant of the call site). ``MASK``: 0 none, 1 additive,
    2 boolean (True: attend). ``lse``: the rows' log-sum-exp of the scaled scores, float32,
    contiguous ``[batch * heads, LQ]``."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * sqb + h * sqh + rm[:, None] * sqm + rd[None, :] * sqd,
                mask=(rm[:, None] < LQ) & (rd[None, :] < D), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = k_ptr + b * skb + h * skh
    v_base = v_ptr + b * svb + h * svh
    m_base = mask_ptr + b * smb + h * smh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    hi = LK
    if CAUSAL:  # keys after a block's last query are masked for all its rows
        hi = tl.minimum(LK, (pid_m + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        rn = n0 + tl.arange(0, BLOCK_N)
        k = tl.load(k_base + rn[None, :] * skn + rd[:, None] * skd, mask=(rn[None, :] < LK) & (rd[:, None] < D),
                    other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * SCALE
        keep = (rn[None, :] < LK) & (rm[:, None] >= 0)
        if CAUSAL:
            keep = keep & (rn[None, :] <= rm[:, None])
        inside = (rm[:, None] < LQ) & (rn[None, :] < LK)
        if MASK == 1:
            s += tl.load(m_base + rm[:, None] * smm + rn[None, :] * smn, mask=inside, other=0.0).to(tl.float32)
        if MASK == 2:
            keep = keep & (tl.load(m_base + rm[:, None] * smm + rn[None, :] * smn, mask=inside, other=0) != 0)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row masked so far: nothing to rescale
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
        v = tl.load(v_base + rn[:, None] * svn + rdv[None, :] * svd, mask=(rn[:, None] < LK) & (rdv[None, :] < DV),
                    other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * sob + h * soh + rm[:, None] * som + rdv[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < LQ) & (rdv[None, :] < DV))
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(lse_ptr + bh.to(tl.int64) * LQ + rm, lse, mask=rm < LQ)
