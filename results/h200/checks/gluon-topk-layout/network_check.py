"""numpy emulation of topk_layout_sass.py's Gluon network (reshape/permute/split/join row-major), checked to sort
and to merge a run with candidates into the top T."""
import numpy as np
def swap_bits(x, s, R, N):
    y = x.reshape(R, N // (2 * s), 2, s).transpose(0, 1, 3, 2); a, b = y[..., 0], y[..., 1]
    return np.stack([b, a], -1).transpose(0, 1, 3, 2).reshape(R, N)
def cx(x, j, R, N):
    y = x.reshape(R, N // (2 * j), 2, j).transpose(0, 1, 3, 2); a, b = y[..., 0], y[..., 1]
    return np.stack([np.minimum(a, b), np.maximum(a, b)], -1).transpose(0, 1, 3, 2).reshape(R, N)
def flip_upper(x, s, k, R, N):
    y = x.reshape(R, N // k, 2, k // 2).transpose(0, 1, 3, 2); lo, up = y[..., 0], y[..., 1]
    up = swap_bits(up.reshape(R, N // 2), s, R, N // 2).reshape(R, N // k, k // 2)
    return np.stack([lo, up], -1).transpose(0, 1, 3, 2).reshape(R, N)
def flip_cx(x, lk, R, N):
    k = 1 << lk
    for l in range(lk - 1): x = flip_upper(x, 1 << l, k, R, N)
    x = cx(x, k // 2, R, N)
    for l in range(lk - 1): x = flip_upper(x, 1 << l, k, R, N)
    return x
def sort_asc(x, R, N, LOG):
    for lk in range(1, LOG + 1):
        x = flip_cx(x, lk, R, N)
        for i in range(lk - 1): x = cx(x, 1 << (lk - 2 - i), R, N)
    return x
def rev(x, R, N, LOG):
    for l in range(LOG): x = swap_bits(x, 1 << l, R, N)
    return x
rng = np.random.default_rng(0)
R, N, LOG = 64, 16, 4
for trial in range(200):
    run = np.sort(rng.integers(-1000, 1000, (R, N)), axis=1)
    cand = rng.integers(-1000, 1000, (R, N))
    s = sort_asc(cand, R, N, LOG)
    assert (s == np.sort(cand, axis=1)).all()
    m = np.maximum(run, rev(s, R, N, LOG))
    for i in range(LOG): m = cx(m, (N // 2) >> i, R, N)
    want = np.sort(np.concatenate([run, cand], 1), axis=1)[:, N:]
    assert (m == want).all()
print("network sorts and merges: ok (200 random trials of 64 rows x 16)")
