"""The calculator tool: arithmetic over numbers and + - * / ( ), parsed by a small recursive-descent
parser (never `eval`, no imports of user text). Exact rational arithmetic (`fractions.Fraction`);
every input gets an answer string, never an exception: a result, or `error: <why>` for text it
cannot read, an expression over `MAX_CHARS` characters or `MAX_DEPTH` nested parentheses, a
number over `MAX_DIGITS` digits, a value beyond `MAX_VALUE` or a division by zero. The limits bound
the work per call (at most `MAX_CHARS` tokens, each operation on numbers of bounded size), so no
input can hang it."""

from __future__ import annotations

import re
from fractions import Fraction

MAX_CHARS = 200
MAX_DEPTH = 16
MAX_DIGITS = 18
MAX_VALUE = 10**18
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(.))")


class CalcError(ValueError):
    pass


def calculate(expression: str) -> str:
    """The value of `expression` as text (an integer, else a decimal to 6 places), or `error: ...`."""
    try:
        return _format(_Parser(expression).parse())
    except CalcError as e:
        return f"error: {e}"


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    return "0" if text == "-0" else text


class _Parser:
    """expr := term (('+'|'-') term)*; term := unary (('*'|'/') unary)*;
    unary := '-' unary | '+' unary | atom; atom := number | '(' expr ')'"""

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise CalcError("the expression must be text")
        if len(text) > MAX_CHARS:
            raise CalcError(f"expression longer than {MAX_CHARS} characters")
        self.tokens, self.i, self.depth = _tokens(text), 0, 0

    def parse(self) -> Fraction:
        if not self.tokens:
            raise CalcError("empty expression")
        value = self.expr()
        if self.i < len(self.tokens):
            raise CalcError(f"unexpected {self.tokens[self.i]!r}")
        return value

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self):
        token = self.peek()
        self.i += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _checked(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/"):
            op, right = self.take(), self.unary()
            if op == "/" and right == 0:
                raise CalcError("division by zero")
            value = _checked(value * right if op == "*" else value / right)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("-", "+"):
            sign = -1 if self.take() == "-" else 1
            self.nest(1)
            value = sign * self.unary()
            self.nest(-1)
            return value
        return self.atom()

    def atom(self) -> Fraction:
        token = self.take()
        if isinstance(token, Fraction):
            return token
        if token == "(":
            self.nest(1)
            value = self.expr()
            if self.take() != ")":
                raise CalcError("missing ')'")
            self.nest(-1)
            return value
        raise CalcError("expression ends early" if token is None else f"unexpected {token!r}")

    def nest(self, step: int) -> None:
        self.depth += step
        if self.depth > MAX_DEPTH:
            raise CalcError(f"more than {MAX_DEPTH} levels of nesting")


def _tokens(text: str) -> list:
    """Numbers as Fractions, operators and parentheses as one-character strings."""
    out = []
    for number, other in _TOKEN.findall(text):
        if number:
            if len(number.replace(".", "")) > MAX_DIGITS:
                raise CalcError(f"a number longer than {MAX_DIGITS} digits")
            out.append(Fraction(number))
        elif other in "+-*/()":
            out.append(other)
        elif not other.isspace():
            raise CalcError(f"unexpected {other!r}")
    return out


def _checked(value: Fraction) -> Fraction:
    if abs(value) > MAX_VALUE or value.denominator > MAX_VALUE:
        raise CalcError(f"a value beyond {MAX_VALUE:.0e}")
    return value
