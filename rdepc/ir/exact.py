"""Exact polynomials with rational coefficients over named integer variables.

Elaboration evaluates spec expressions with these instead of sympy: they are exact,
immutable and cheap, so ``rdepc check`` proves a spec sound without importing sympy
(whose import alone takes longer than a check may). ``to_sympy`` builds the sympy
object term by term for the LayerSpec; no text is ever parsed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

Monomial = tuple[tuple[str, int], ...]  # sorted (variable, power) pairs; () is the constant term


@dataclass(frozen=True, slots=True)
class Poly:
    terms: tuple[tuple[Monomial, Fraction], ...]  # sorted, no zero coefficients

    @staticmethod
    def const(v: int | Fraction) -> Poly:
        v = Fraction(v)
        return Poly((((), v),) if v else ())

    @staticmethod
    def var(name: str) -> Poly:
        return Poly(((((name, 1),), Fraction(1)),))

    @staticmethod
    def _make(d: dict[Monomial, Fraction]) -> Poly:
        return Poly(tuple(sorted((m, c) for m, c in d.items() if c)))

    # --- arithmetic -----------------------------------------------------------------

    def __add__(self, other: Poly) -> Poly:
        d = dict(self.terms)
        for m, c in other.terms:
            d[m] = d.get(m, 0) + c
        return Poly._make(d)

    def __neg__(self) -> Poly:
        return Poly(tuple((m, -c) for m, c in self.terms))

    def __sub__(self, other: Poly) -> Poly:
        return self + (-other)

    def __mul__(self, other: Poly) -> Poly:
        d: dict[Monomial, Fraction] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                powers = dict(m1)
                for v, p in m2:
                    powers[v] = powers.get(v, 0) + p
                m = tuple(sorted(powers.items()))
                d[m] = d.get(m, 0) + c1 * c2
        return Poly._make(d)

    def scale(self, k: Fraction) -> Poly:
        return Poly._make({m: c * k for m, c in self.terms})

    # --- queries --------------------------------------------------------------------

    @property
    def is_const(self) -> bool:
        return all(m == () for m, _ in self.terms)

    @property
    def value(self) -> Fraction:
        """The value of a constant polynomial."""
        assert self.is_const, self
        return self.terms[0][1] if self.terms else Fraction(0)

    def __int__(self) -> int:
        assert self.is_whole, self
        return self.value.numerator

    @property
    def is_whole(self) -> bool:
        return self.is_const and self.value.denominator == 1

    @property
    def free(self) -> frozenset[str]:
        return frozenset(v for m, _ in self.terms for v, _ in m)

    @property
    def degree(self) -> int:
        return max((sum(p for _, p in m) for m, _ in self.terms), default=0)

    @property
    def integer_valued(self) -> bool:
        """Whole coefficients: integer for every integer value of the variables."""
        return all(c.denominator == 1 for _, c in self.terms)

    def coeff(self, var: str) -> Poly:
        """The coefficient of ``var`` in a polynomial of degree one in it."""
        return Poly._make({tuple(x for x in m if x[0] != var): c for m, c in self.terms if (var, 1) in m})

    def without(self, variables: frozenset[str] | set[str]) -> Poly:
        """The terms that involve none of ``variables``."""
        return Poly._make({m: c for m, c in self.terms if not any(v in variables for v, _ in m)})

    def subs(self, values: dict[str, int | Fraction]) -> Poly:
        d: dict[Monomial, Fraction] = {}
        for m, c in self.terms:
            k, rest = Fraction(c), []
            for v, p in m:
                if v in values:
                    k *= Fraction(values[v]) ** p
                else:
                    rest.append((v, p))
            d[tuple(rest)] = d.get(tuple(rest), 0) + k
        return Poly._make(d)

    def extremes(self, bounds: dict[str, int]) -> tuple[Fraction, Fraction]:
        """Min and max over the integers 1..bound of its one variable (exact for degree ≤ 2)."""
        if self.is_const:
            return self.value, self.value
        (v,) = self.free
        hi = bounds[v]
        points = {1, hi}
        if self.degree == 2:
            a = sum((c for m, c in self.terms if m == ((v, 2),)), Fraction(0))
            b = sum((c for m, c in self.terms if m == ((v, 1),)), Fraction(0))
            vertex = -b / (2 * a)
            if 1 <= vertex <= hi:
                points |= {math.floor(vertex), math.ceil(vertex)}
        values = [self.subs({v: p}).value for p in points]
        return min(values), max(values)

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for m, c in reversed(self.terms):
            names = "*".join(v if p == 1 else f"{v}^{p}" for v, p in m)
            if not names:
                parts.append(str(c))
            elif c == 1:
                parts.append(names)
            else:
                parts.append(f"{c}*{names}")
        return " + ".join(parts).replace("+ -", "- ")

    def to_sympy(self, symbols: dict):
        """The same polynomial as a sympy expression (``symbols`` maps names to sympy Symbols)."""
        import sympy as sp

        total = sp.Integer(0)
        for m, c in self.terms:
            term = sp.Rational(c.numerator, c.denominator)
            for v, p in m:
                term = term * symbols[v] ** p
            total = total + term
        return total
