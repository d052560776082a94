"""The arithmetic of a `multi` grader's `calculate_output`, parsed into a tree and evaluated by walking it:
numbers, grader names, + - * / ** (and ^ as power, as OpenAI's formulas write it), unary minus, parentheses
and the functions min, max, abs, floor, ceil, sqrt, exp, log. Nothing else parses; nothing is eval'd."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_FORMULA_CHARS = 1024
MAX_NODES = 256

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., float]] = {
    "min": min, "max": max, "abs": abs, "floor": math.floor, "ceil": math.ceil, "sqrt": math.sqrt,
    "exp": math.exp, "log": math.log,
}


class FormulaError(ValueError):
    pass


def parse_formula(text: str, names: set[str]) -> ast.Expression:
    """The checked tree of `text`; raises FormulaError naming what is not allowed."""
    if len(text) > MAX_FORMULA_CHARS:
        raise FormulaError(f"longer than {MAX_FORMULA_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**"), mode="eval")
    except SyntaxError as e:
        raise FormulaError(f"does not parse: {e.msg}") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_NODES:
        raise FormulaError(f"more than {MAX_NODES} terms")
    for node in nodes:
        if isinstance(node, ast.Expression | ast.Load | ast.operator | ast.unaryop):
            if isinstance(node, ast.operator) and type(node) not in _BINARY:
                raise FormulaError(f"operator {type(node).__name__} is not allowed")
            if isinstance(node, ast.unaryop) and not isinstance(node, ast.USub | ast.UAdd):
                raise FormulaError(f"operator {type(node).__name__} is not allowed")
        elif isinstance(node, ast.BinOp | ast.UnaryOp):
            continue
        elif isinstance(node, ast.Constant):
            if not isinstance(node.value, int | float) or isinstance(node.value, bool):
                raise FormulaError(f"{node.value!r} is not a number")
        elif isinstance(node, ast.Name):
            if node.id not in names and node.id not in _FUNCTIONS:
                raise FormulaError(f"{node.id!r} names no grader (graders: {sorted(names)})")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS or node.keywords:
                raise FormulaError(f"only the functions {sorted(_FUNCTIONS)} may be called")
            if not node.args:
                raise FormulaError(f"{node.func.id}() needs arguments")
        else:
            raise FormulaError(f"{type(node).__name__} is not allowed (numbers, grader names, + - * / ^, "
                               f"parentheses and {', '.join(sorted(_FUNCTIONS))})")
    for node in nodes:
        if isinstance(node, ast.Name) and node.id in _FUNCTIONS and not _is_callee(node, nodes):
            raise FormulaError(f"{node.id!r} is a function; call it")
    return tree


def _is_callee(name: ast.Name, nodes: list[ast.AST]) -> bool:
    return any(isinstance(n, ast.Call) and n.func is name for n in nodes)


def evaluate(tree: ast.Expression, values: dict[str, float]) -> float:
    """The formula's value; raises FormulaError for arithmetic without a result (division by zero, ...)."""
    try:
        result = float(_eval(tree.body, values))
    except (ArithmeticError, ValueError) as e:
        raise FormulaError(f"has no value here: {e}") from None
    if not math.isfinite(result):
        raise FormulaError(f"evaluated to {result}")
    return result


def _eval(node: ast.AST, values: dict[str, float]) -> float:
    if isinstance(node, ast.Constant):
        return float(node.value)
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp):
        operand = _eval(node.operand, values)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, values), _eval(node.right, values)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent larger than 64")
        return _BINARY[type(node.op)](left, right)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return float(_FUNCTIONS[node.func.id](*(_eval(a, values) for a in node.args)))
