"""The Triton programs of the fused output layer and label log-probabilities (launched by ``linear_logps``).

:func:`forward_program` gives each block of tokens one program that walks the
vocabulary tile by tile, folding each logits tile (:func:`_logits_tile`) into
running max / argmax, sum of exponentials, label logit and entropy.
:func:`grad_logits_program` recomputes the logits of one (token chunk, vocabulary
chunk) and writes ``d out / d logits`` for it.
"""

import triton
import triton.language as tl

__all__ = ["forward_program", "grad_logits_program"]


@triton.jit
def _accumulate_dot(
    acc,
    x_ptr,
    w_ptr,
    rows,
    cols,
    row_end,
    col_end,
    K,
    stride_x,
    stride_w,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``acc + x[rows] @ w[cols].T`` over ``K``; rows past ``row_end`` and columns past ``col_end`` count as zeros."""
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_x + k[None, :],
            mask=(rows[:, None] < row_end) & (k[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[None, :] * stride_w + k[:, None],
            mask=(k[:, None] < K) & (cols[None, :] < col_end),
            other=0.0,
        )
        acc = tl.dot(x.to(DOT_DTYPE), w.to(DOT_DTYPE), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _logits_tile(
    x_ptr,
    w_ptr,
    xr_ptr,
    wr_ptr,
    rows,
    cols,
    row_end,
    col_end,
    H,
    R,
    stride_x,
    stride_w,
    stride_xr,
    stride_wr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE_R: tl.constexpr,
    PRECISION_R: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The float32 logits of ``rows`` × ``cols``: the main operand pair plus, if any, the low-rank pair."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    acc = _accumulate_dot(
        acc, x_ptr, w_ptr, rows, cols, row_end, col_end, H, stride_x, stride_w, DOT_DTYPE, PRECISION, BLOCK_K
    )
    if HAS_LOW_RANK:
        acc = _accumulate_dot(
            acc,
            xr_ptr,
            wr_ptr,
            rows,
            cols,
            row_end,
            col_end,
            R,
            stride_xr,
            stride_wr,
            DOT_DTYPE_R,
            PRECISION_R,
            BLOCK_K,
        )
    return acc


@triton.jit
def forward_program(
    x_ptr,
    w_ptr,
    xr_ptr,
    wr_ptr,
    labels_ptr,
    logps_ptr,
    lse_ptr,
    argmax_ptr,
    entropy_ptr,
    N,
    V,
    H,
    R,
    stride_x,
    stride_w,
    stride_xr,
    stride_wr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE_R: tl.constexpr,
    PRECISION_R: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
    WITH_ENTROPY: tl.constexpr,
    IGNORE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Per token of one block: log-sum-exp, label log-prob, argmax and (``WITH_ENTROPY``) entropy of its logits."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    labels = tl.load(labels_ptr + rows, mask=rows < N, other=IGNORE)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)  # running max
    s = tl.zeros((BLOCK_N,), tl.float32)  # sum of exp(z - m)
    t = tl.zeros((BLOCK_N,), tl.float32)  # sum of exp(z - m) * (z - m), for the entropy
    picked = tl.zeros((BLOCK_N,), tl.float32)
    best = tl.zeros((BLOCK_N,), tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols[None, :] < V
        z = _logits_tile(
            x_ptr,
            w_ptr,
            xr_ptr,
            wr_ptr,
            rows,
            cols,
            N,
            V,
            H,
            R,
            stride_x,
            stride_w,
            stride_xr,
            stride_wr,
            DOT_DTYPE,
            PRECISION,
            DOT_DTYPE_R,
            PRECISION_R,
            HAS_LOW_RANK,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
        )
        z = tl.where(col_mask, z, float("-inf"))
        tile_max = tl.max(z, axis=1)
        # Strictly greater: the first maximum wins, as in torch.argmax.
        best = tl.where(tile_max > m, v0 + tl.argmax(z, axis=1), best)
        m_new = tl.maximum(m, tile_max)
        alpha = tl.exp(m - m_new)
        shifted = z - m_new[:, None]  # -inf past the vocabulary
        p = tl.exp(shifted)
        if WITH_ENTROPY:
            # Moving the reference from m to m_new shifts every earlier (z - m) by m - m_new (nothing yet: s = 0).
            shift = tl.where(s > 0, m - m_new, 0.0)
            t = alpha * (t + shift * s) + tl.sum(p * tl.where(col_mask, shifted, 0.0), axis=1)
        s = alpha * s + tl.sum(p, axis=1)
        m = m_new
        picked += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    log_s = tl.log(s)
    lse = m + log_s
    valid = labels != IGNORE
    row_mask = rows < N
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(logps_ptr + rows, tl.where(valid, picked - lse, 0.0), mask=row_mask)
    tl.store(argmax_ptr + rows, best, mask=row_mask)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, log_s - t / s, 0.0), mask=row_mask)


@triton.jit
def grad_logits_program(
    x_ptr,
    w_ptr,
    xr_ptr,
    wr_ptr,
    labels_ptr,
    lse_ptr,
    grad_logps_ptr,
    entropy_ptr,
    grad_entropy_ptr,
    out_ptr,
    row0,
    row_end,
    col0,
    col_end,
    H,
    R,
    stride_x,
    stride_w,
    stride_xr,
    stride_wr,
    stride_out,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_DTYPE_R: tl.constexpr,
    PRECISION_R: tl.constexpr,
    HAS_LOW_RANK: tl.constexpr,
    ENTROPY_GRAD: tl.constexpr,
    IGNORE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``out[r - row0, c - col0]`` = d (logps, entropy) / d logits[r, c], weighted by their incoming gradients."""
    rows = row0 + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = col0 + tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_mask = rows < row_end
    labels = tl.load(labels_ptr + rows, mask=row_mask, other=IGNORE)
    valid = labels != IGNORE
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    g = tl.where(valid, tl.load(grad_logps_ptr + rows, mask=row_mask, other=0.0), 0.0)
    z = _logits_tile(
        x_ptr,
        w_ptr,
        xr_ptr,
        wr_ptr,
        rows,
        cols,
        row_end,
        col_end,
        H,
        R,
        stride_x,
        stride_w,
        stride_xr,
        stride_wr,
        DOT_DTYPE,
        PRECISION,
        DOT_DTYPE_R,
        PRECISION_R,
        HAS_LOW_RANK,
        BLOCK_N,
        BLOCK_V,
        BLOCK_K,
    )
    log_p = z - lse[:, None]
    p = tl.exp(log_p)
    # d logp / d z = onehot(label) - softmax(z).
    grad = tl.where(cols[None, :] == labels[:, None], g[:, None], 0.0) - g[:, None] * p
    if ENTROPY_GRAD:
        g_entropy = tl.where(valid, tl.load(grad_entropy_ptr + rows, mask=row_mask, other=0.0), 0.0)
        entropy = tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)
        # d entropy / d z = -softmax(z) * (log_softmax(z) + entropy).
        grad -= g_entropy[:, None] * p * (log_p + entropy[:, None])
    offsets = (rows - row0).to(tl.int64)[:, None] * stride_out + (cols - col0)[None, :]
    tl.store(out_ptr + offsets, grad.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < col_end))
