"""A step-for-step numpy model of cuda_src/sample.cu's algorithm (order keys, 2^-40 fixed-point masses,
8-bit radix searches with the boundary group's arithmetic, the 128-bit draw target, the id lookup), so the
algorithm's exactness against reference.ddtree.sample_from_logits is tested on CPUs; the kernel itself is
tested against the reference on a GPU (tests/gpu/test_sample_exact.py)."""
from __future__ import annotations

import numpy as np

from ddtree_cupy.reference.ddtree import philox4x32

MASS_ONE = np.float32(2.0 ** 40)


def order_key(x: np.ndarray) -> np.ndarray:
    x = np.where(np.asarray(x, np.float32) == 0, np.float32(0), np.asarray(x, np.float32))   # -0 -> +0
    b = x.view(np.uint32)
    k = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)
    return np.where(np.isnan(x), np.uint32(0), k)


def fixed_mass(x: np.ndarray, m: np.float32, inv_t: np.float32) -> np.ndarray:
    d = (np.asarray(x, np.float32) - m).astype(np.float32)
    p = np.exp((d * inv_t).astype(np.float32)).astype(np.float32)
    out = (p * MASS_ONE).astype(np.float64).astype(np.uint64)
    out = np.where(d == 0, np.uint64(1 << 40), out)
    return np.where(np.isnan(x), np.uint64(0), out).astype(np.uint64)


class Kept:
    def __init__(self, active=False, key_floor=0, take=0, unit=0, count=0, mass=0):
        self.active, self.key_floor, self.take, self.unit, self.count, self.mass = \
            active, key_floor, take, unit, count, mass


def search(keys, masses, k: Kept, by_mass: bool, target: int, with_mass: bool) -> Kept:
    prefix, above_c, above_m = 0, 0, 0
    bin_c = bin_m = 0
    for shift in (24, 16, 8, 0):
        hi_mask = 0 if shift == 24 else (0xFFFFFFFF << (shift + 8)) & 0xFFFFFFFF
        sel = (keys & np.uint32(hi_mask)) == np.uint32(prefix & hi_mask)
        if k.active:
            sel &= keys > np.uint32(k.key_floor)
        bins = ((keys[sel] >> np.uint32(shift)) & np.uint32(255)).astype(np.int64)
        cnt = [0] * 256
        mass = [0] * 256
        for b, c in zip(*np.unique(bins, return_counts=True)):
            cnt[int(b)] += int(c)
        if with_mass:
            ms = masses[sel]
            for b in np.unique(bins):
                mass[int(b)] += int(ms[bins == b].astype(object).sum())
        if k.active and k.take > 0 and (k.key_floor & hi_mask) == (prefix & hi_mask):
            b = (k.key_floor >> shift) & 255
            cnt[b] += k.take
            if with_mass:
                mass[b] += k.unit * k.take
        acc_c, acc_m, chosen = above_c, above_m, None
        for b in range(255, -1, -1):
            w = mass[b] if by_mass else cnt[b]
            if cnt[b] > 0 and (acc_m if by_mass else acc_c) + w >= target:
                chosen = b
                break
            acc_c += cnt[b]
            acc_m += mass[b]
        assert chosen is not None, "target above the kept weight"
        prefix |= chosen << shift
        above_c, above_m, bin_c, bin_m = acc_c, acc_m, cnt[chosen], mass[chosen]
    unit = bin_m // bin_c if bin_c else 0
    need = target - (above_m if by_mass else above_c)
    take = need if not by_mass else ((need + unit - 1) // unit if unit else bin_c)
    take = max(1, min(bin_c, take))
    return Kept(True, prefix, take, unit, above_c + take, above_m + take * unit)


def sample_row(x: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, step: int) -> int:
    x = np.asarray(x, np.float32)
    V = x.shape[0]
    temp = np.float32(temperature)
    inv_t = np.float32(1.0) / temp if temp > 0 else np.float32(0)
    greedy = not temp > 0 or np.isinf(inv_t)
    m = np.float32(np.nanmax(x))
    keys = order_key(x)
    if greedy:
        k = search(keys, None, Kept(count=V), False, 1, False)
    else:
        masses = fixed_mass(x, m, inv_t)
        k = Kept(count=V, mass=int(masses.astype(object).sum()))
        if 0 < top_k < V:
            k = search(keys, masses, k, False, top_k, True)
        if np.float32(top_p) < 1:
            t = int(np.ceil(float(np.float32(top_p)) * float(k.mass)))
            k = search(keys, masses, k, True, max(1, min(t, k.mass)), True)
        ctr = np.array([step & 0xFFFFFFFF, (step >> 32) & 0xFFFFFFFF, 0, 0], np.uint32)
        x0 = int(philox4x32(ctr, (seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF))[0])
        t = ((k.mass * (2 * (x0 >> 8) + 1)) >> 25) + 1
        k = search(keys, masses, k, True, min(t, k.mass), True)
    ids = np.nonzero(keys == np.uint32(k.key_floor))[0]
    return int(ids[k.take - 1])
