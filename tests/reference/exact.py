"""Exact rationals for hand-computed expectations (tests of the recurrent
families, item 6 of issue 35): arithmetic stays in ``fractions.Fraction``; the
few transcendental functions the spec's equations call (exp, log1p, sqrt,
sin, cos, erf) come back as Fractions within 10^-60 of the true value, from
Python's ``decimal`` at 80 digits (exp, ln and sqrt correctly rounded there;
sin, cos and erf by their Taylor series). 10^-60 is 40 orders below a
float32 rounding, so to any test here these values are exact.

``f32(x)`` is the Fraction of a float32 literal of the spec (``0.1f``,
``1e-5f``, ``0.999f``): the spec computes with those values, not with the
decimal ones.
"""
import decimal
from fractions import Fraction

import numpy as np

_CTX = decimal.Context(prec=80)


def _dec(x):
    x = Fraction(x)
    return _CTX.divide(decimal.Decimal(x.numerator), decimal.Decimal(x.denominator))


def f32(literal):
    """The exact value of a float32 constant."""
    return Fraction(float(np.float32(literal)))


def exp(x):
    return Fraction(_CTX.exp(_dec(x)))


def log1p(x):
    return Fraction(_CTX.ln(_CTX.add(decimal.Decimal(1), _dec(x))))


def sqrt(x):
    return Fraction(_CTX.sqrt(_dec(x)))


def _series(x, first, ratio):
    """sum of the terms t_0 = first, t_n = t_(n-1) * ratio(n), until they
    stop mattering at 80 digits."""
    with decimal.localcontext(_CTX):
        total, term, n = decimal.Decimal(0), first, 0
        while True:
            total += term
            n += 1
            term = term * ratio(n)
            if term == 0 or abs(term) < abs(total) * decimal.Decimal(10) ** -78:
                return Fraction(total + term)


def sin(x):
    x = _dec(x)
    return _series(x, x, lambda n: -x * x / ((2 * n) * (2 * n + 1)))


def cos(x):
    x = _dec(x)
    return _series(x, decimal.Decimal(1), lambda n: -x * x / ((2 * n - 1) * (2 * n)))


def _pi():
    """Machin: pi = 16 atan(1/5) - 4 atan(1/239)."""
    def atan_inv(k):
        return _series(None, _CTX.divide(1, k), lambda n: -decimal.Decimal(2 * n - 1) / ((2 * n + 1) * k * k))
    return 16 * atan_inv(5) - 4 * atan_inv(239)


PI = _pi()


def erf(x):
    """2/sqrt(pi) * sum_n (-1)^n x^(2n+1) / (n! (2n+1)), for |x| up to ~6
    (beyond that the alternating terms would eat the 80 digits)."""
    assert abs(x) < 6, x
    d = _dec(x)
    with decimal.localcontext(_CTX):
        total, power, n = decimal.Decimal(0), d, 0          # power = (-1)^n x^(2n+1) / n!
        while True:
            term = power / (2 * n + 1)
            total += term
            if term == 0 or abs(term) < decimal.Decimal(10) ** -78:
                break
            n += 1
            power = -power * d * d / n
    return 2 / sqrt(PI) * Fraction(total)


def trim(x):
    """x to the nearest multiple of 2^-256 (10^-77): applied to a model's
    carried values (residual stream, states, caches) after every step so the
    Fractions do not grow without bound over a sequence; 16 orders below the
    transcendental values' own 10^-60."""
    if isinstance(x, (list, tuple)):
        return [trim(v) for v in x]
    return Fraction(round(Fraction(x) * 2 ** 256), 2 ** 256)


def to_f64(values):
    """Fractions (nested lists) to a float64 array, for comparisons."""
    def floats(v):
        return [floats(u) for u in v] if isinstance(v, (list, tuple)) else float(v)
    return np.array(floats(values), np.float64)
