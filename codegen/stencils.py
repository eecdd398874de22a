"""Finite-difference stencils: point offsets (findiff convention) and Fornberg weights."""
from __future__ import annotations

import functools
from typing import Sequence

import sympy as sp


def stencil_size(derivative: int, accuracy: int, difference: str) -> int:
    """Number of points n of a stencil for derivative k with accuracy a (findiff convention)."""
    if difference == "backward":
        return derivative + accuracy
    if difference == "central":
        return 2 * ((derivative + 1) // 2) - 1 + accuracy
    raise ValueError(f"difference={difference!r} is invalid: allowed 'backward', 'central'")


def stencil_offsets(derivative: int, accuracy: int, difference: str) -> list[int]:
    """Row offsets of the stencil's points relative to the row where the derivative is taken."""
    n = stencil_size(derivative, accuracy, difference)
    if difference == "backward":
        return list(range(-n + 1, 1))
    half = (n - 1) // 2
    return list(range(-half, half + 1))


def fornberg(nodes: Sequence[sp.Expr], derivative: int, at: sp.Expr = sp.Integer(0)) -> list[sp.Expr]:
    """Weights w_i with f^(k)(at) ≈ Σ w_i f(nodes[i]) (Fornberg 1988), exact for any node set.

    Works on numbers (exact rationals) and on symbols alike.
    """
    n = len(nodes)
    if derivative >= n:
        raise ValueError(f"derivative {derivative} needs at least {derivative + 1} points, got {n}")
    c = [[sp.Integer(0)] * (derivative + 1) for _ in range(n)]
    c[0][0] = sp.Integer(1)
    c1 = sp.Integer(1)
    c4 = nodes[0] - at
    for i in range(1, n):
        mn = min(i, derivative)
        c2 = sp.Integer(1)
        c5 = c4
        c4 = nodes[i] - at
        for j in range(i):
            c3 = nodes[i] - nodes[j]
            c2 = c2 * c3
            if j == i - 1:
                for k in range(mn, 0, -1):
                    c[i][k] = c1 * (k * c[i - 1][k - 1] - c5 * c[i - 1][k]) / c2
                c[i][0] = -c1 * c5 * c[i - 1][0] / c2
            for k in range(mn, 0, -1):
                c[j][k] = (c4 * c[j][k] - k * c[j][k - 1]) / c3
            c[j][0] = c4 * c[j][0] / c3
        c1 = c2
    return [c[i][derivative] for i in range(n)]


@functools.lru_cache(maxsize=None)
def uniform_weights(offsets: tuple[int, ...], derivative: int) -> tuple[sp.Rational, ...]:
    """Exact rational weights on integer offsets (unit spacing, derivative at offset 0)."""
    return tuple(sp.Rational(w) for w in fornberg([sp.Integer(o) for o in offsets], derivative))


def lagrange_weights(node_times: Sequence[sp.Expr], derivative: int) -> list[sp.Expr]:
    """Weights of derivative k at time 0 over nodes at the given relative times (closed form).

    w_i = k! (-1)^(n-1-k) e_{n-1-k}({x_j}_{j≠i}) / Π_{j≠i} (x_i - x_j), with e_m the
    elementary symmetric polynomial: compact in the node-time symbols, so derivatives and
    CSE stay cheap (the recurrence form grows into very large expressions on symbols).
    """
    n = len(node_times)
    if derivative >= n:
        raise ValueError(f"derivative {derivative} needs at least {derivative + 1} points, got {n}")
    m = n - 1 - derivative
    sign = -1 if m % 2 else 1
    prefix = _symmetric_polynomials(node_times, m)
    suffix = _symmetric_polynomials(node_times[::-1], m)[::-1]
    weights = []
    for i, xi in enumerate(node_times):
        # e_m of the other nodes from those before i and those after it: Σ_a e_a(before) e_(m-a)(after)
        e_m = sp.Add(*[prefix[i][a] * suffix[i + 1][m - a] for a in range(m + 1)])
        denominator = sp.Mul(*[xi - x for j, x in enumerate(node_times) if j != i])
        weights.append(sign * sp.factorial(derivative) * e_m / denominator)
    return weights


def _symmetric_polynomials(xs: Sequence[sp.Expr], m: int) -> list[list[sp.Expr]]:
    """e_0..e_m of the first r values, for r = 0..len(xs), by e_a(x_1..x_r) = e_a(x_1..x_(r-1)) +
    x_r e_(a-1)(x_1..x_(r-1)): each a short sum over shared smaller ones, where the expanded
    polynomial has C(n-1, m) products (330 of 7 factors for 12 nodes, derivative 4), which
    every later stage (CSE, the dt derivatives, the tapes, the compiler) paid for."""
    table = [[sp.Integer(1)] + [sp.Integer(0)] * m]
    for x in xs:
        last = table[-1]
        table.append([last[0]] + [last[a] + x * last[a - 1] for a in range(1, m + 1)])
    return table
