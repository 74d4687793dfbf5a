"""Derivation and check of the degree-7 polynomial of `exp_tail_pd` (src/logitdiff/_kernel.cpp).

Remez exchange for the minimax *relative* error of e^r on [-ln2/2, ln2/2] (a hair wider),
in 50-digit arithmetic; the coefficients rounded to double are then checked on 200,001
evenly spaced points with exact (50-digit) Horner evaluation. Prints the coefficients and
the maximum relative error (4.03e-11 at the time of writing; the kernel takes 1.25e-9 as its
bound). Not a test: about a minute of mpmath.

    python bench/exp_tail_minimax.py
"""

import mpmath as mp

mp.mp.dps = 50
H = mp.log(2) / 2 * (1 + mp.mpf(2) ** -40)
DEG = 7


def err_fn(c):
    return lambda x: sum(c[k] * x**k for k in range(DEG + 1)) / mp.e**x - 1


def remez(iterations=20, grid_n=4000):
    xs = sorted(H * mp.cos(mp.pi * (2 * i + 1) / (2 * (DEG + 2))) for i in range(DEG + 2))
    grid = [-H + 2 * H * j / grid_n for j in range(grid_n + 1)]
    for _ in range(iterations):
        a, b = mp.matrix(DEG + 2, DEG + 2), mp.matrix(DEG + 2, 1)
        for i, x in enumerate(xs):  # p(x_i) - e^x_i = (-1)^i E e^x_i
            for k in range(DEG + 1):
                a[i, k] = x**k
            a[i, DEG + 1] = -((-1) ** i) * mp.e**x
            b[i] = mp.e**x
        sol = mp.lu_solve(a, b)
        c = [sol[k] for k in range(DEG + 1)]
        ev = [err_fn(c)(x) for x in grid]
        ext = [j for j in range(len(grid))
               if (j == 0 or abs(ev[j]) >= abs(ev[j - 1])) and (j == len(grid) - 1 or abs(ev[j]) >= abs(ev[j + 1]))]
        alt = []
        for j in ext:  # sign-alternating extrema, the larger of equal-sign neighbours
            if alt and mp.sign(ev[j]) == mp.sign(ev[alt[-1]]):
                if abs(ev[j]) > abs(ev[alt[-1]]):
                    alt[-1] = j
            else:
                alt.append(j)
        while len(alt) > DEG + 2:
            alt.pop(0 if abs(ev[alt[0]]) < abs(ev[alt[-1]]) else -1)
        if len(alt) == DEG + 2:
            xs = [grid[j] for j in alt]
    return c


def main():
    coeffs = [float(x) for x in remez()]
    print("coefficients c0..c7:", [repr(x) for x in coeffs])
    n = 200_001
    worst = mp.mpf(0)
    for j in range(n):
        x = -H + 2 * H * j / (n - 1)
        p = mp.mpf(0)
        for k in range(DEG, -1, -1):
            p = p * x + mp.mpf(coeffs[k])
        worst = max(worst, abs(p / mp.e**x - 1))
    print(f"max relative error of the double coefficients on {n:,} points: {mp.nstr(worst, 4)}")


if __name__ == "__main__":
    main()
