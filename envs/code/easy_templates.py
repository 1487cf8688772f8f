"""The templates of the `easy` dataset (envs/code/easy.py): small string, list and arithmetic functions.

A template draws one instance from a `random.Random`: its constants (`key`, what makes two
instances different tasks), the docstring's sentence, the reference body and the argument tuples of
its tests. Most are "a rule per item, then an aggregate", so the helper/entry split of the code env
is natural (aux: the per-item rule or a parsing step, main: the loop). `heldout=True` templates
never appear in training. Names are drawn by easy.py, so a template never picks its own.
"""
from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable

WORDS = ("apple", "tree", "sky", "river", "stone", "moon", "queen", "box", "jazz", "lemon", "owl", "idea",
         "crab", "unit", "echo", "pixel", "zebra", "fig", "mango", "yak", "cloud", "dust", "ice", "van")


@dataclass(frozen=True)
class Spec:
    key: tuple  # the constants: two instances with the same key are the same task
    doc: str  # the docstring's first sentence(s)
    body: str  # the reference body, indented by 4 spaces
    args: list[tuple]  # test inputs (the first few are the visible examples)


@dataclass(frozen=True)
class Template:
    name: str
    kind: str  # string | list | arithmetic
    names: tuple[str, ...]  # entry-point names; easy.py keeps the last one for held-out instances
    params: tuple[str, ...]  # annotated parameters; `{x}` is replaced by a name from PARAM_NAMES
    returns: str
    draw: Callable[[random.Random], Spec]
    heldout: bool = False


PARAM_NAMES = {"text": ("text", "s", "sentence"), "nums": ("nums", "numbers", "values"), "n": ("n", "num")}
TEMPLATES: list[Template] = []


def template(kind: str, names: tuple[str, ...], params: tuple[str, ...], returns: str, heldout: bool = False):
    def register(draw: Callable[[random.Random], Spec]) -> Callable[[random.Random], Spec]:
        TEMPLATES.append(Template(draw.__name__, kind, names, params, returns, draw, heldout))
        return draw
    return register


# ------------------------------------------------------------------------------------ inputs


def sentence(rng: random.Random, lo: int = 2, hi: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def sentences(rng: random.Random, count: int = 6) -> list[tuple]:
    return [("",)] + [(sentence(rng),) for _ in range(count - 1)]


def starting_with(rng: random.Random, c: str) -> list[tuple]:
    """Sentences, the last with words that start with `c` (few of WORDS do)."""
    return sentences(rng) + [(f"{c}{rng.choice(WORDS)} {sentence(rng)} {c}{rng.choice(WORDS)}",)]


def int_lists(rng: random.Random, lo: int = -5, hi: int = 20, count: int = 6) -> list[tuple]:
    return [([],)] + [([rng.randint(lo, hi) for _ in range(rng.randint(1, 7))],) for _ in range(count - 1)]


def quoted(letters: str) -> str:
    return ", ".join(repr(c) for c in letters)


# ------------------------------------------------------------------------------------ strings


@template("string", ("count_letters", "letter_count", "count_matching_letters", "tally_letters"),
          ("{text}: str",), "int")
def count_letters(rng: random.Random) -> Spec:
    letters = "aeiou" if rng.random() < 0.3 else "".join(sorted(rng.sample(string.ascii_lowercase, 3)))
    return Spec((letters,), f"Return how many characters of {{text}} are one of {quoted(letters)}.",
                f"    return sum(1 for c in {{text}} if c in {letters!r})\n",
                sentences(rng) + [(f"{sentence(rng, 1, 2)} {letters[::-1]}",)])


@template("string", ("replace_letter", "swap_letter", "substitute_letter", "change_letter"), ("{text}: str",), "str")
def replace_letter(rng: random.Random) -> Spec:
    old, new = rng.sample("aeioustrnlm", 2)
    return Spec((old, new), f"Return {{text}} with every {old!r} replaced by {new!r}.",
                f"    return {{text}}.replace({old!r}, {new!r})\n",
                sentences(rng) + [(f"{rng.choice(WORDS)} {old}{rng.choice(WORDS)}{old}",)])


@template("string", ("long_words", "words_longer_than", "select_words", "pick_words"), ("{text}: str",), "list[str]")
def long_words(rng: random.Random) -> Spec:
    more = rng.random() < 0.5
    k = rng.randint(3, 4) if more else rng.randint(4, 5)  # words have 3 to 5 letters: no rule keeps all
    rule = f"more than {k}" if more else f"fewer than {k}"
    op = ">" if more else "<"
    return Spec((k, more), f"Return the words of {{text}} (split on spaces) that have {rule} letters, in order.",
                f"    return [w for w in {{text}}.split() if len(w) {op} {k}]\n", sentences(rng))


@template("string", ("count_starting_with", "words_starting_with", "count_initial", "initial_count"),
          ("{text}: str",), "int")
def count_starting_with(rng: random.Random) -> Spec:
    c = rng.choice("abcdefilmqrstuvyz")
    return Spec((c,), f"Return how many words of {{text}} (split on spaces) start with {c!r}.",
                f"    return sum(1 for w in {{text}}.split() if w.startswith({c!r}))\n",
                starting_with(rng, c))


@template("string", ("shout_words", "upper_words_with", "highlight_words", "emphasize_words"),
          ("{text}: str",), "str")
def shout_words(rng: random.Random) -> Spec:
    c = rng.choice("aeiouxyz")
    return Spec((c,), f"Return the words of {{text}} (split on spaces) joined by single spaces, each word "
                      f"that contains {c!r} in upper case.",
                f"    return ' '.join(w.upper() if {c!r} in w else w for w in {{text}}.split())\n", sentences(rng))


@template("string", ("initials", "first_letters", "acronym", "word_initials"), ("{text}: str",), "str")
def initials(rng: random.Random) -> Spec:
    sep, upper = rng.choice([".", "-", "", " ", "_", "/"]), rng.random() < 0.5
    case = "upper-cased " if upper else ""
    first = "w[0].upper()" if upper else "w[0]"
    return Spec((sep, upper), f"Return the {case}first letters of the words of {{text}} (split on spaces), "
                              f"joined by {sep!r}.",
                f"    return {sep!r}.join({first} for w in {{text}}.split())\n", sentences(rng))


@template("string", ("longest_word_with", "longest_starting", "max_word_length", "longest_initial"),
          ("{text}: str",), "int", heldout=True)
def longest_word_with(rng: random.Random) -> Spec:
    c = rng.choice("abcdefilmqrstuvyz")
    return Spec((c,), f"Return the length of the longest word of {{text}} (split on spaces) that starts with "
                      f"{c!r}, or 0 if there is none.",
                f"    return max((len(w) for w in {{text}}.split() if w.startswith({c!r})), default=0)\n",
                starting_with(rng, c))


@template("string", ("mask_vowels", "hide_vowels", "cover_vowels", "blank_vowels"), ("{text}: str",), "str",
          heldout=True)
def mask_vowels(rng: random.Random) -> Spec:
    mark = rng.choice("*#?_+")
    return Spec((mark,), f"Return {{text}} with every vowel (a, e, i, o, u) replaced by {mark!r}.",
                f"    return ''.join({mark!r} if c in 'aeiou' else c for c in {{text}})\n", sentences(rng))


# ------------------------------------------------------------------------------------ lists


@template("list", ("sum_multiples", "total_of_multiples", "add_multiples", "multiples_sum"),
          ("{nums}: list[int]",), "int")
def sum_multiples(rng: random.Random) -> Spec:
    k, keep = rng.randint(2, 9), rng.random() < 0.6
    rule = "divisible" if keep else "not divisible"
    op = "==" if keep else "!="
    return Spec((k, keep), f"Return the sum of the numbers in {{nums}} that are {rule} by {k}.",
                f"    return sum(x for x in {{nums}} if x % {k} {op} 0)\n", int_lists(rng) + [([*range(1, 11)],)])


@template("list", ("count_above", "count_large", "how_many_above", "tally_above"), ("{nums}: list[int]",), "int")
def count_above(rng: random.Random) -> Spec:
    t, op = rng.randint(-3, 12), rng.choice([">", ">=", "<", "<="])
    words = {">": "greater than", ">=": "at least", "<": "less than", "<=": "at most"}[op]
    same = {">": (">", t), ">=": (">", t - 1), "<": ("<", t), "<=": ("<", t + 1)}[op]  # x >= 6 is x > 5
    return Spec(same, f"Return how many numbers in {{nums}} are {words} {t}.",
                f"    return sum(1 for x in {{nums}} if x {op} {t})\n", int_lists(rng) + [([t - 1, t, t + 1],)])


@template("list", ("clamp_all", "clip_values", "bound_values", "limit_all"), ("{nums}: list[int]",), "list[int]")
def clamp_all(rng: random.Random) -> Spec:
    lo = rng.randint(-5, 5)
    hi = lo + rng.randint(2, 12)
    return Spec((lo, hi), f"Return a list with each number of {{nums}} clamped to the range {lo} to {hi} "
                          f"(smaller numbers become {lo}, larger ones {hi}).",
                f"    return [min(max(x, {lo}), {hi}) for x in {{nums}}]\n", int_lists(rng, -10, 25))


@template("list", ("running_best", "running_total", "prefix_values", "cumulative"), ("{nums}: list[int]",),
          "list[int]")
def running(rng: random.Random) -> Spec:
    op = rng.choice(["max", "min", "sum"])
    what = {"max": "largest number", "min": "smallest number", "sum": "sum of the numbers"}[op]
    step = {"max": "max(acc, x)", "min": "min(acc, x)", "sum": "acc + x"}[op]
    body = (f"    out = []\n    for i, x in enumerate({{nums}}):\n"
            f"        acc = x if i == 0 else {step}\n        out.append(acc)\n    return out\n")
    return Spec((op,), f"Return a list whose i-th item is the {what} among the first i + 1 items of {{nums}}.",
                body, int_lists(rng))


@template("list", ("scale_shift", "transform_all", "affine_all", "rescale"), ("{nums}: list[int]",), "list[int]")
def scale_shift(rng: random.Random) -> Spec:
    a, b = rng.choice([-3, -2, 2, 3, 4, 5, 10]), rng.randint(-9, 9)
    expr = f"x * {a} + {b}" if b >= 0 else f"x * {a} - {-b}"
    return Spec((a, b), f"Return a list with each number x of {{nums}} replaced by {expr}.",
                f"    return [{expr} for x in {{nums}}]\n", int_lists(rng))


@template("list", ("keep_between", "in_range", "filter_range", "select_between"), ("{nums}: list[int]",),
          "list[int]")
def keep_between(rng: random.Random) -> Spec:
    lo = rng.randint(-3, 8)
    hi = lo + rng.randint(2, 10)
    return Spec((lo, hi), f"Return the numbers of {{nums}} that are between {lo} and {hi} (both included), in order.",
                f"    return [x for x in {{nums}} if {lo} <= x <= {hi}]\n",
                int_lists(rng) + [([hi + 1, lo, hi, lo - 1],)])


@template("list", ("first_index_above", "find_first_above", "index_above", "locate_above"),
          ("{nums}: list[int]",), "int")
def first_index_above(rng: random.Random) -> Spec:
    t = rng.randint(0, 15)
    body = f"    for i, x in enumerate({{nums}}):\n        if x > {t}:\n            return i\n    return -1\n"
    return Spec((t,), f"Return the index of the first number in {{nums}} that is greater than {t}, or -1 if "
                      f"there is none.", body, int_lists(rng) + [([t - 1, t, t + 1, t + 2],)])


@template("list", ("pair_results", "neighbour_op", "adjacent_values", "combine_neighbours"),
          ("{nums}: list[int]",), "list[int]")
def pair_results(rng: random.Random) -> Spec:
    op = rng.choice(["+", "*", "max", "min"])
    what = {"+": "sum", "*": "product", "max": "larger", "min": "smaller"}[op]
    expr = f"a {op} b" if op in "+*" else f"{op}(a, b)"
    return Spec((op,), f"Return a list with the {what} of each pair of neighbouring numbers of {{nums}} "
                       f"(one item fewer than {{nums}}).",
                f"    return [{expr} for a, b in zip({{nums}}, {{nums}}[1:])]\n", int_lists(rng))


# One-comprehension templates (issue 32's tuning, docs/environments.md): with only the templates above the
# untrained 2-agent team of SmolLM2-135M passed 5% of sampled training paths (13 of 17 measured
# templates never), and a list comprehension is what it gets right most often (scale_shift, long_words).
# One-method string templates were tried and dropped: `count_word` passed 0 of 40 paths.
@template("list", ("add_to_all", "shift_all", "offset_all", "add_constant"), ("{nums}: list[int]",), "list[int]")
def add_to_all(rng: random.Random) -> Spec:
    k = rng.choice([k for k in range(-9, 10) if k])
    expr = f"x + {k}" if k > 0 else f"x - {-k}"
    return Spec((k,), f"Return a list with {k} added to each number of {{nums}}." if k > 0 else
                f"Return a list with {-k} subtracted from each number of {{nums}}.",
                f"    return [{expr} for x in {{nums}}]\n", int_lists(rng))


@template("list", ("keep_above", "only_above", "select_above", "filter_above"), ("{nums}: list[int]",), "list[int]")
def keep_above(rng: random.Random) -> Spec:
    t = rng.randint(-3, 12)
    return Spec((t,), f"Return the numbers of {{nums}} that are greater than {t}, in order.",
                f"    return [x for x in {{nums}} if x > {t}]\n", int_lists(rng) + [([t - 1, t, t + 1],)])


@template("list", ("keep_multiples", "only_multiples", "select_multiples", "multiples_of"), ("{nums}: list[int]",),
          "list[int]")
def keep_multiples(rng: random.Random) -> Spec:
    k = rng.randint(2, 9)
    return Spec((k,), f"Return the numbers of {{nums}} that are divisible by {k}, in order.",
                f"    return [x for x in {{nums}} if x % {k} == 0]\n", int_lists(rng) + [([*range(1, 11)],)])


@template("list", ("total_times", "scaled_sum", "sum_times", "times_total"), ("{nums}: list[int]",), "int")
def total_times(rng: random.Random) -> Spec:
    k = rng.choice([-3, -2, 2, 3, 4, 5, 6, 7, 10])
    return Spec((k,), f"Return the sum of the numbers in {{nums}}, times {k}.",
                f"    return sum({{nums}}) * {k}\n", int_lists(rng))


@template("list", ("power_all", "raise_all", "powers_of", "exponentiate"), ("{nums}: list[int]",), "list[int]")
def power_all(rng: random.Random) -> Spec:
    p = rng.randint(2, 5)
    return Spec((p,), f"Return a list with each number x of {{nums}} replaced by x ** {p}.",
                f"    return [x ** {p} for x in {{nums}}]\n", int_lists(rng, -4, 9))


@template("list", ("product_above", "multiply_large", "product_of_large", "large_product"),
          ("{nums}: list[int]",), "int", heldout=True)
def product_above(rng: random.Random) -> Spec:
    t = rng.randint(0, 9)
    body = f"    out = 1\n    for x in {{nums}}:\n        if x > {t}:\n            out *= x\n    return out\n"
    return Spec((t,), f"Return the product of the numbers in {{nums}} that are greater than {t} (1 if there are "
                      f"none).", body, int_lists(rng, -5, 15) + [([t, t + 1, t + 2],)])


@template("list", ("scaled_steps", "step_sizes", "differences_times", "scaled_differences"),
          ("{nums}: list[int]",), "list[int]", heldout=True)
def scaled_steps(rng: random.Random) -> Spec:
    k = rng.randint(2, 6)
    return Spec((k,), f"Return a list with each number of {{nums}} minus the number before it, times {k} "
                      f"(one item fewer than {{nums}}).",
                f"    return [(b - a) * {k} for a, b in zip({{nums}}, {{nums}}[1:])]\n", int_lists(rng))


# ------------------------------------------------------------------------------------ arithmetic


def naturals(rng: random.Random, hi: int = 9999, count: int = 6) -> list[tuple]:
    return [(0,)] + [(rng.randint(1, hi),) for _ in range(count - 1)]


@template("arithmetic", ("sum_big_digits", "digit_total", "add_digits_above", "big_digit_sum"), ("{n}: int",), "int")
def sum_big_digits(rng: random.Random) -> Spec:
    d = rng.randint(0, 7)
    return Spec((d,), f"Return the sum of the digits of the non-negative integer {{n}} that are greater than {d}.",
                f"    return sum(int(c) for c in str({{n}}) if int(c) > {d})\n", naturals(rng, 99999) + [(123456789,)])


@template("arithmetic", ("count_digit", "digit_occurrences", "how_many_digits", "tally_digit"), ("{n}: int",), "int")
def count_digit(rng: random.Random) -> Spec:
    d = rng.randint(0, 9)
    args = [(0,)] + [(int("".join(rng.choice(f"{d}{d}0123456789") for _ in range(rng.randint(1, 6)))),)
                     for _ in range(5)]
    return Spec((d,), f"Return how many times the digit {d} appears in the non-negative integer {{n}}.",
                f"    return str({{n}}).count({str(d)!r})\n", args)


@template("arithmetic", ("sum_of_multiples_upto", "multiples_total", "add_multiples_upto", "sum_upto"),
          ("{n}: int",), "int")
def sum_multiples_upto(rng: random.Random) -> Spec:
    a = rng.randint(2, 6)
    b = rng.choice([b for b in range(a + 1, 10) if b % a])  # "by 2 or by 4" would be "by 2"
    return Spec((a, b), f"Return the sum of the whole numbers from 1 to {{n}} (included) that are divisible by "
                        f"{a} or by {b}.",
                f"    return sum(i for i in range(1, {{n}} + 1) if i % {a} == 0 or i % {b} == 0)\n",
                naturals(rng, 60))


@template("arithmetic", ("fizz_words", "word_counting", "count_with_word", "say_numbers"), ("{n}: int",),
          "list[str]")
def fizz_words(rng: random.Random) -> Spec:
    k, word = rng.randint(2, 7), rng.choice(["fizz", "buzz", "pop", "ping", "hop", "zap"])
    return Spec((k, word), f"Return a list of strings for the numbers 1 to {{n}} (included): {word!r} for a "
                           f"number divisible by {k}, else the number itself as a string.",
                f"    return [{word!r} if i % {k} == 0 else str(i) for i in range(1, {{n}} + 1)]\n",
                naturals(rng, 12))


@template("arithmetic", ("clamp", "clip", "bound", "limit"), ("{n}: int",), "int")
def clamp(rng: random.Random) -> Spec:
    lo = rng.randint(-10, 10)
    hi = lo + rng.randint(1, 20)
    args = [(lo - 3,), (hi + 4,), (lo,), (hi,), (rng.randint(lo, hi),), (rng.randint(-30, 30),)]
    rng.shuffle(args)
    return Spec((lo, hi), f"Return {{n}} limited to the range {lo} to {hi}: {lo} if it is smaller, {hi} if it is "
                          f"larger, else {{n}} itself.",
                f"    return min(max({{n}}, {lo}), {hi})\n", args)


@template("arithmetic", ("sum_of_kth", "multiples_series", "first_multiples_sum", "series_total"),
          ("{n}: int",), "int")
def first_multiples(rng: random.Random) -> Spec:
    k = rng.randint(2, 12)
    return Spec((k,), f"Return the sum of the first {{n}} positive multiples of {k} ({k}, {2 * k}, {3 * k}, ...).",
                f"    return sum({k} * i for i in range(1, {{n}} + 1))\n", naturals(rng, 30))


@template("arithmetic", ("count_digit_sum_multiples", "digit_sum_count", "count_by_digit_sum", "digit_sum_hits"),
          ("{n}: int",), "int", heldout=True)
def count_digit_sum_multiples(rng: random.Random) -> Spec:
    k = rng.randint(2, 9)
    return Spec((k,), f"Return how many of the whole numbers from 1 to {{n}} (included) have a digit sum "
                      f"divisible by {k}.",
                f"    return sum(1 for i in range(1, {{n}} + 1) if sum(int(c) for c in str(i)) % {k} == 0)\n",
                naturals(rng, 80) + [(99,)])
