"""Short competition-style math problems in LaTeX notation, made from templates (no benchmark
text): the register of contest problem sets (`$...$` formulas, "Compute", "Find", "Express
your answer as a common fraction"), where the word problems of math_prompts.py are prose.

    list(itertools.islice(competition_problems(seed=0), 3))
Seeded like math_prompts.word_problems: the same seed gives the same problems in order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

FRACTION = " Express your answer as a common fraction."
RADICAL = " Express your answer in simplest radical form."
OFFICES = ("vice-president", "treasurer")


def _poly(coeffs: list[int], var: str = "x") -> str:
    """LaTeX of sum(c * var^k), highest power first: [2, -3, 1] -> 2x^2 - 3x + 1."""
    terms, top = [], len(coeffs) - 1
    for i, c in enumerate(coeffs):
        if c == 0:
            continue
        k = top - i
        mono = "" if k == 0 else var if k == 1 else f"{var}^{{{k}}}" if k > 9 else f"{var}^{k}"
        mag = str(abs(c)) if abs(c) != 1 or k == 0 else ""
        sign = ("-" if c < 0 else "") if not terms else (" - " if c < 0 else " + ")
        terms.append(f"{sign}{mag}{mono}")
    return "".join(terms) or "0"


def _gauss(a: int, b: int) -> str:
    """The complex number a + bi in LaTeX."""
    return f"{a} {'-' if b < 0 else '+'} {abs(b)}i"


def _evaluate(r):
    f = _poly([r.randint(-5, 5) or 1, r.randint(-9, 9), r.randint(-9, 9)])
    return f"If $f(x) = {f}$, what is the value of $f({r.randint(-6, 6)})$?"


def _compose(r):
    a, b, c, d = (r.randint(-6, 6) or 2 for _ in range(4))
    return (f"Let $f(x) = {_poly([a, b])}$ and $g(x) = {_poly([c, 0, d])}$. What is "
            f"$f(g({r.randint(-4, 4)}))$?")


def _remainder_power(r):
    return (f"What is the remainder when ${r.randint(2, 19)}^{{{r.randint(10, 2026)}}}$ is "
            f"divided by ${r.randint(3, 13)}$?")


def _units_digit(r):
    return f"What is the units digit of ${r.randint(2, 99)}^{{{r.randint(5, 999)}}}$?"


def _divisors(r):
    n = r.choice((2, 3, 4, 6, 8, 12)) * r.choice((5, 7, 9, 10, 15, 21, 25, 30))
    return r.choice((f"How many positive divisors does ${n}$ have?",
                     f"What is the sum of the positive divisors of ${n}$?",
                     f"What is the largest prime factor of ${n * r.randint(2, 30)}$?"))


def _binomial(r):
    n = r.randint(5, 20)
    return f"Compute $\\dbinom{{{n}}}{{{r.randint(2, n - 2)}}}$."


def _arrangements(r):
    word = r.choice(("BANANA", "LEVEL", "COMMITTEE", "PEPPER", "ROTOR", "ALABAMA", "TOOTH",
                     "MISSISSIPPI", "BALLOON", "ELEVEN", "PARALLEL", "SEEDS"))
    return f"How many ways are there to arrange the letters of the word {word}?"


def _seating(r):
    n, k = r.randint(4, 9), r.randint(2, 3)
    return r.choice((f"In how many ways can {n} people sit around a round table if two seatings "
                     f"are the same when one is a rotation of the other?",
                     f"In how many ways can a president and a {OFFICES[k - 2]} "
                     f"be chosen from a club of {n * 3} members if no member can hold both "
                     f"offices?",
                     f"How many {k}-person committees can be chosen from a group of {n + 3} "
                     f"people?"))


def _radical(r):
    a, b = r.randint(2, 9), r.choice((2, 3, 5, 6, 7, 10))
    return r.choice((f"Simplify $\\sqrt{{{a * a * b}}}$.",
                     f"Rationalize the denominator: "
                     f"$\\frac{{{r.randint(1, 12)}}}{{\\sqrt{{{b}}}}}$." + RADICAL,
                     f"Simplify $\\sqrt{{{a * a * b}}} + \\sqrt{{{b * r.randint(2, 5) ** 2}}}$."))


def _repeating(r):
    digits = "".join(str(r.randint(0, 9)) for _ in range(r.randint(1, 3)))
    lead = r.choice(("0.", "0.", f"0.{r.randint(1, 9)}", f"{r.randint(1, 3)}."))
    return f"Express ${lead}\\overline{{{digits}}}$ as a common fraction in lowest terms."


def _base(r):
    n, b = r.randint(20, 2000), r.choice((2, 3, 4, 5, 6, 7, 8, 9))
    digits, m = "", n
    while m:
        digits, m = str(m % b) + digits, m // b
    return r.choice((f"Express ${n}_{{10}}$ in base ${b}$.",
                     f"Convert ${digits}_{{{b}}}$ to base 10."))


def _distance(r):
    x1, y1, x2, y2 = (r.randint(-10, 10) for _ in range(4))
    return r.choice((f"What is the distance between the points $({x1}, {y1})$ and $({x2}, {y2})$?"
                     + RADICAL,
                     f"Find the midpoint of the segment with endpoints $({x1}, {y1})$ and "
                     f"$({x2}, {y2})$.",
                     f"What is the slope of the line through $({x1}, {y1})$ and $({x2}, "
                     f"{y2 if x2 != x1 else y2 + 1})$?"))


def _triangle_area(r):
    pts = [(r.randint(-8, 8), r.randint(-8, 8)) for _ in range(3)]
    a, b, c = (f"$({x}, {y})$" for x, y in pts)
    return f"What is the area, in square units, of the triangle with vertices {a}, {b} and {c}?"


def _vieta(r):
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    eq = _poly([1, -(p + q), p * q])
    return r.choice((f"Let $a$ and $b$ be the roots of ${eq} = 0$. Find $a^2 + b^2$.",
                     f"What is the sum of all values of $x$ such that ${eq} = 0$?",
                     f"Find the product of the solutions of ${eq} = 0$."))


def _absolute(r):
    a, b = r.randint(-10, 10), r.randint(1, 12)
    return r.choice((f"Find the sum of all solutions of $|{_poly([1, a])}| = {b}$.",
                     f"How many integers $x$ satisfy $|{_poly([1, a])}| \\le {b}$?"))


def _inequality(r):
    lo, hi = sorted(r.sample(range(2, 400), 2))
    return r.choice((f"How many integers $n$ satisfy ${lo} < n^2 < {hi * 3}$?",
                     f"What is the smallest integer $x$ such that "
                     f"${_poly([r.randint(2, 9), r.randint(-20, 20)])} > {r.randint(10, 90)}$?"))


def _logarithm(r):
    b = r.choice((2, 3, 4, 5, 10))
    return r.choice((f"Evaluate $\\log_{{{b}}} {b ** r.randint(2, 6)}$.",
                     f"Solve for $x$: $\\log_{{{b}}}({_poly([1, r.randint(-9, 9)])}) = "
                     f"{r.randint(1, 3)}$."))


def _floor_ceil(r):
    a, b = r.randint(5, 99), r.randint(2, 9)
    op = r.choice(("\\left\\lfloor", "\\left\\lceil"))
    close = "\\right\\rfloor" if "floor" in op else "\\right\\rceil"
    return r.choice((f"Evaluate ${op} \\frac{{{a}}}{{{b}}} {close}$.",
                     f"Evaluate ${op} \\sqrt{{{a}}} {close}^2$."))


def _series(r):
    a, d, n = r.randint(-10, 20), r.randint(1, 9), r.randint(8, 60)
    return r.choice((f"What is the sum of the arithmetic series ${a} + {a + d} + {a + 2 * d} + "
                     f"\\cdots + {a + (n - 1) * d}$?",
                     f"Compute $\\sum_{{k=1}}^{{{n}}} ({_poly([d, a], 'k')})$.",
                     f"The first term of a geometric sequence is ${r.randint(1, 9)}$ and the "
                     f"common ratio is $\\frac{{1}}{{{r.randint(2, 5)}}}$. What is the sum of the "
                     f"infinite series?" + FRACTION))


def _modular(r):
    m = r.choice((5, 7, 9, 11, 13, 17))
    return r.choice((f"Find the inverse of ${r.randint(2, m - 1)}$ modulo ${m}$, as a residue "
                     f"between $0$ and ${m - 1}$.",
                     f"Solve the congruence ${r.randint(2, m - 1)}n \\equiv {r.randint(1, m - 1)} "
                     f"\\pmod{{{m}}}$, as a residue modulo ${m}$."))


def _complex(r):
    a, b, c, d = (r.randint(-7, 7) or 1 for _ in range(4))
    return r.choice((f"Simplify $({_gauss(a, b)})({_gauss(c, d)})$.",
                     f"Evaluate $i^{{{r.randint(5, 999)}}} + i^{{{r.randint(5, 999)}}}$.",
                     f"Find $|{_gauss(a, b)}|$."))


def _system(r):
    x, y = r.randint(-9, 9), r.randint(-9, 9)
    a, b = r.randint(1, 9), r.randint(1, 9)
    return (f"If ${a}x + {b}y = {a * x + b * y}$ and $x - y = {x - y}$, what is the value of "
            f"$x + y$?")


def _rational(r):
    a, b, c = r.randint(1, 9), r.randint(-9, 9), r.randint(-9, 9)
    return r.choice((f"Find all real $x$ such that "
                     f"$\\frac{{x^2 - {a * a}}}{{{_poly([1, b])}}} = 0$.",
                     f"What is the domain of $f(x) = \\frac{{{a}}}{{{_poly([1, b, c])}}}$? "
                     f"Express your answer in interval notation."))


def _polygon(r):
    n = r.randint(5, 20)
    return r.choice((f"What is the measure, in degrees, of each interior angle of a regular "
                     f"{n}-gon?",
                     f"How many diagonals does a convex polygon with ${n}$ sides have?",
                     f"A right triangle has legs of length ${r.randint(3, 20)}$ and "
                     f"${r.randint(3, 20)}$. What is the length of its hypotenuse?"))


def _probability(r):
    n = r.randint(2, 5)
    return r.choice((f"{n} fair coins are flipped. What is the probability that at least one "
                     f"comes up heads?" + FRACTION,
                     f"Two distinct integers are chosen from $1$ to ${r.randint(6, 30)}$. What "
                     f"is the probability that their sum is even?" + FRACTION,
                     f"A number is chosen at random from the first ${r.randint(20, 100)}$ "
                     f"positive integers. What is the probability that it is a multiple of "
                     f"${r.randint(3, 9)}$?" + FRACTION))


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _evaluate, _compose, _remainder_power, _units_digit, _divisors, _binomial, _arrangements,
    _seating, _radical, _repeating, _base, _distance, _triangle_area, _vieta, _absolute,
    _inequality, _logarithm, _floor_ceil, _series, _modular, _complex, _system, _rational,
    _polygon, _probability)


def competition_problems(seed: int = 0) -> Iterator[str]:
    """An endless, seeded stream of problems, the templates in turn (deduplicate downstream)."""
    r = random.Random(f"competition-{seed}")
    while True:
        for template in TEMPLATES:
            yield template(r)
