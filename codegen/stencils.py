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
    return tuple(sp.nsimplify(w) for w in fornberg([sp.Integer(o) for o in offsets], derivative))


@functools.lru_cache(maxsize=None)
def _generic_weights(n: int, derivative: int) -> tuple[tuple[sp.Symbol, ...], tuple[sp.Expr, ...]]:
    xs = sp.symbols(f"x0:{n}")
    return xs, tuple(fornberg(list(xs), derivative))


def weights_at(node_times: Sequence[sp.Expr], derivative: int) -> list[sp.Expr]:
    """Weights of derivative k at time 0 over nodes at the given (symbolic) relative times.

    The symbolic Fornberg recurrence is derived once per (points, derivative) on generic
    node symbols and then substituted, so each row costs one substitution.
    """
    xs, generic = _generic_weights(len(node_times), derivative)
    mapping = dict(zip(xs, node_times))
    return [w.xreplace(mapping) for w in generic]
