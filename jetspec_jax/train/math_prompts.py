"""Math word problems made from templates with random names and numbers (no benchmark text).

    list(itertools.islice(word_problems(seed=0), 3))
Each template draws its numbers so that the answer is a whole number or a short fraction; the
same seed gives the same problems in the same order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from fractions import Fraction

NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor",
         "Wen", "Ximena", "Yusuf", "Zoe", "Amara", "Bruno", "Carmen", "Dmitri", "Esi", "Felix")
ITEMS = ("apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "cards",
         "shells", "balloons", "cupcakes", "notebooks", "oranges", "bottles", "toy cars", "beads")
PLACES = ("the market", "a bakery", "the school fair", "a bookshop", "the hardware store",
          "a garden centre", "the corner shop", "an online store")
ASKS = ("", " Show your reasoning step by step.", " Explain your answer.", " Solve it step by step.",
        " Give the final answer at the end.", " Show your work.")


def _signed(n: int) -> str:
    return f"+ {n}" if n >= 0 else f"- {-n}"


def _frac(r: random.Random) -> Fraction:
    d = r.randint(2, 12)
    return Fraction(r.randint(1, d - 1), d)


def _shopping(r):
    n, a, b, c = r.choice(NAMES), r.randint(2, 9), r.randint(2, 30), r.randint(2, 9)
    return (f"{n} buys {a} {r.choice(ITEMS)} at ${b} each and {c} more at ${r.randint(2, 30)} "
            f"each at {r.choice(PLACES)}. {n} pays with a ${r.choice((100, 200, 500))} bill. "
            f"How much change does {n} get?")


def _sharing(r):
    n, m, k = r.choice(NAMES), r.randint(2, 9), r.randint(3, 40)
    return (f"{n} has {m * k + r.randint(0, m - 1)} {r.choice(ITEMS)} and shares them equally "
            f"among {m} friends. How many does each friend get, and how many are left over?")


def _fraction_of(r):
    n, f, g = r.choice(NAMES), _frac(r), _frac(r)
    total = f.denominator * g.denominator * r.randint(1, 6)
    return (f"{n} had {total} {r.choice(ITEMS)}. {n} gave away {f} of them and then sold {g} of "
            f"what was left. How many are left now?")


def _fraction_arith(r):
    f, g, op = _frac(r), _frac(r), r.choice(("+", "-", "*", "/"))
    return f"Compute {f} {op} {g} and write the result as a fraction in lowest terms."


def _percent_discount(r):
    p, d = r.randint(20, 400), r.choice((5, 10, 15, 20, 25, 30, 40, 50))
    return (f"A jacket costs ${p}. It is on sale for {d}% off, and then a {r.randint(2, 12)}% "
            f"sales tax is added to the sale price. What is the final price?")


def _percent_change(r):
    a, b = r.randint(10, 500), r.randint(10, 500)
    thing = r.choice(("the price of a ticket", "a town's population", "a salary",
                      "the number of visitors", "a phone's battery life in hours"))
    return f"If {thing} changes from {a} to {b}, what is the percentage change?"


def _percent_of(r):
    return (f"What is {r.choice((5, 12, 15, 20, 25, 35, 40, 60, 75, 120))}% of "
            f"{r.randint(2, 900)}?")


def _linear(r):
    x, a, b = r.randint(-20, 20), r.randint(2, 15), r.randint(-50, 50)
    return f"Solve for x: {a}x {_signed(b)} = {a * x + b}."


def _linear_both_sides(r):
    x, a, c = r.randint(-15, 15), r.randint(2, 12), r.randint(1, 11)
    if a == c:
        a += 1
    b = r.randint(-30, 30)
    d = a * x + b - c * x
    return f"Solve {a}x {_signed(b)} = {c}x {_signed(d)} for x, and check your solution."


def _system(r):
    x, y = r.randint(-9, 9), r.randint(-9, 9)
    a, b, c, d = (r.randint(1, 7) for _ in range(4))
    if a * d == b * c:
        d += 1
    return (f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and "
            f"{c}x - {d}y = {c * x - d * y}.")


def _quadratic(r):
    p, q = r.randint(-9, 9), r.randint(-9, 9)
    return f"Find the roots of x^2 {-(p + q):+d}x {p * q:+d} = 0."


def _speed(r):
    n, v, t = r.choice(NAMES), r.randint(3, 90), r.randint(2, 9)
    return (f"{n} travels {v * t} km in {t} hours. At the same speed, how long would it take to "
            f"travel {v * r.randint(2, 12)} km?")


def _meeting(r):
    a, b, h = r.randint(30, 90), r.randint(30, 90), r.randint(1, 5)
    return (f"Two trains leave stations {(a + b) * h} km apart at the same time and travel "
            f"toward each other at {a} km/h and {b} km/h. After how many hours do they meet?")


def _work(r):
    n, m = r.sample(NAMES, 2)
    a, b = r.randint(2, 12), r.randint(2, 12)
    return (f"{n} can paint a fence in {a} hours and {m} can paint it in {b} hours. How long "
            f"does it take them working together?")


def _average(r):
    k = r.randint(4, 7)
    scores = [r.randint(50, 100) for _ in range(k)]
    return (f"{r.choice(NAMES)}'s test scores are {', '.join(map(str, scores))}. What score is "
            f"needed on the next test to raise the average to {sum(scores) // k + r.randint(1, 5)}?")


def _ratio(r):
    n, m = r.sample(NAMES, 2)
    a, b, k = r.randint(1, 9), r.randint(1, 9), r.randint(2, 20)
    return (f"{n} and {m} share ${(a + b) * k} in the ratio {a}:{b}. How much does each of them "
            f"get?")


def _area(r):
    w, h = r.randint(2, 40), r.randint(2, 40)
    shape = r.choice(("rectangular garden", "rectangular room", "rectangular field"))
    return (f"A {shape} is {w} m long and {h} m wide. What are its area and its perimeter? "
            f"How many square tiles of side {r.choice((0.5, 1, 2))} m would cover it?")


def _circle(r):
    return (f"A circle has a {r.choice(('radius', 'diameter'))} of {r.randint(1, 50)} cm. "
            f"Find its circumference and area (use pi = 3.14).")


def _interest(r):
    p, rate, y = r.randint(5, 200) * 100, r.randint(1, 12), r.randint(1, 10)
    kind = r.choice(("simple", "compound (yearly)"))
    return f"How much is ${p} worth after {y} years at {rate}% {kind} interest?"


def _ages(r):
    n, m = r.sample(NAMES, 2)
    a, k, y = r.randint(3, 20), r.randint(2, 4), r.randint(2, 15)
    return (f"{n} is {k} times as old as {m}. In {y} years, {n} will be {k * a + y} years old. "
            f"How old is {m} now?")


def _clock(r):
    h, m, d = r.randint(1, 12), r.randint(0, 59), r.randint(20, 400)
    return (f"A movie starts at {h}:{m:02d} and lasts {d} minutes. At what time does it end?")


def _sequence(r):
    a, d, n = r.randint(-20, 20), r.randint(2, 12), r.randint(10, 60)
    terms = ", ".join(str(a + d * i) for i in range(4))
    return (f"What is term number {n} of the sequence {terms}, ...? What is the sum of its "
            f"first {n} terms?")


def _gcd_lcm(r):
    a, b = r.randint(6, 300), r.randint(6, 300)
    return r.choice((f"Find the greatest common divisor and the least common multiple of {a} "
                     f"and {b}.", f"Write {a * b} as a product of prime factors."))


def _powers(r):
    a, m, n = r.randint(2, 9), r.randint(2, 6), r.randint(2, 6)
    return f"Simplify ({a}^{m} * {a}^{n}) / {a}^{r.randint(1, m + n)} and give its value."


def _probability(r):
    red, blue, green = r.randint(1, 12), r.randint(1, 12), r.randint(0, 9)
    return (f"A bag holds {red} red, {blue} blue and {green} green balls. Two balls are drawn "
            f"without replacement. What is the probability that both are "
            f"{r.choice(('red', 'blue'))}?")


def _dice(r):
    k = r.randint(2, 12)
    return f"Two fair six-sided dice are rolled. What is the probability that the sum is {k}?"


def _units(r):
    a = r.randint(2, 500)
    pair = r.choice((("kilometres", "metres"), ("hours", "seconds"), ("kilograms", "grams"),
                     ("litres", "millilitres"), ("feet", "inches"), ("days", "minutes")))
    return f"Convert {a} {pair[0]} to {pair[1]}."


def _recipe(r):
    a, b, c = r.randint(2, 8), r.randint(2, 12), r.choice((2, 3, 4, 6))
    return (f"A recipe for {c} people needs {a} cups of flour and {b} eggs. How much flour and "
            f"how many eggs are needed for {c * r.randint(2, 5) + r.randint(0, 1) * c // 2} "
            f"people?")


def _budget(r):
    n, w, h, s = r.choice(NAMES), r.randint(8, 30), r.randint(5, 40), r.randint(50, 900)
    return (f"{n} earns ${w} per hour and works {h} hours a week. How many weeks will it take "
            f"{n} to save ${s * 10} if {n} saves {r.choice((10, 20, 25, 50))}% of each "
            f"week's pay?")


TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping, _sharing, _fraction_of, _fraction_arith, _percent_discount, _percent_change,
    _percent_of, _linear, _linear_both_sides, _system, _quadratic, _speed, _meeting, _work,
    _average, _ratio, _area, _circle, _interest, _ages, _clock, _sequence, _gcd_lcm, _powers,
    _probability, _dice, _units, _recipe, _budget)


def word_problems(seed: int = 0) -> Iterator[str]:
    """An endless, seeded stream of problems, the templates in turn (repeats are possible:
    deduplicate downstream)."""
    r = random.Random(f"math-{seed}")
    while True:
        for template in TEMPLATES:
            yield template(r) + r.choice(ASKS)
