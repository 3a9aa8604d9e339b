"""Count the collectives in a compiled XLA program (its optimized HLO text).

    hlo = jax.jit(f).lower(*args).compile().as_text()      # or, before XLA's passes:
    hlo = jax.jit(f).lower(*args).compiler_ir("hlo").as_hlo_text()
    ops = collectives(hlo)                  # every all-reduce / all-gather / all-to-all / ... with its bytes
    in_loop, outside = split_by_layer_loop(hlo)

The decoder runs its layers in one `lax.fori_loop`, so the loop body (and what it calls) holds
one layer's collectives: tests assert Megatron's two all-reduces per layer there, and
`scripts/comm_model.py` turns the bytes into a per-token communication volume.
"""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute", "ragged-all-to-all")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented "name (params) -> shape {"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_ARRAY_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)=\{?([%\w.\-, ]+)\}?")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # "all-reduce", "all-gather", ... (async "-start" halves counted once, "-done" not)
    bytes: int  # size of its result (per device); a ragged all-to-all's: of what it may send (its operand)
    computation: str  # the HLO computation it sits in


def _shape_bytes(shape: str) -> int:
    total = 0
    for dtype, dims in _ARRAY_SHAPE.findall(shape):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of the program, in text order."""
    ops, computation, shapes = [], "", {}
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line[:1].isspace():
            computation = header.group(1)
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, shape, op = m.groups()
        shapes[name] = shape
        kind = op.removesuffix("-start")
        if kind == "ragged-all-to-all":  # its result is the receive buffer; what it sends is at most its operand
            operand = line[m.end():].split(",", 1)[0].strip()  # "gather.3", or "f32[26,16]{1,0} %gather.3"
            shape = operand if _ARRAY_SHAPE.search(operand) else shapes.get(operand.lstrip("%"), "")
        if kind in COLLECTIVE_KINDS and not op.endswith("-done"):
            ops.append(Collective(kind, _shape_bytes(shape), computation))
    return ops


def _calls(hlo_text: str) -> dict[str, set[str]]:
    """computation -> the computations its instructions call (loop bodies, branches, calls)."""
    calls: dict[str, set[str]] = {}
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line[:1].isspace():
            computation = header.group(1)
            calls.setdefault(computation, set())
            continue
        for group in _CALLED.findall(line):
            calls.setdefault(computation, set()).update(name.strip().lstrip("%") for name in group.split(",") if name.strip())
    return calls


def _reachable(start: str, calls: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(calls.get(name, ()))
    return seen


def split_by_layer_loop(hlo_text: str) -> tuple[list[Collective], list[Collective]]:
    """(collectives of one trip of the decoder's layer loop, all the others). The layer loop is
    the while loop whose body, with everything it calls, holds the most collectives."""
    ops = collectives(hlo_text)
    calls = _calls(hlo_text)
    best: set[str] = set()
    for body in while_bodies(hlo_text):
        inside = _reachable(body, calls)
        if sum(op.computation in inside for op in ops) > sum(op.computation in best for op in ops):
            best = inside
    return [op for op in ops if op.computation in best], [op for op in ops if op.computation not in best]


def while_bodies(hlo_text: str) -> list[str]:
    """Names of the body computations of every while loop, in text order."""
    return _WHILE_BODY.findall(hlo_text)


_COPY = re.compile(r"=\s*\w+\[([\d,]+)\]\S*\s+copy(?:-start)?\(")


def pool_sized_copies(hlo_text: str, pool_elements: int) -> int:
    """How many `copy` ops of the optimized program move an array of `pool_elements` elements (one
    device's KV pool, k or v): a step that updates its donated cache in place has none."""
    return sum(math.prod(int(d) for d in m.group(1).split(",")) == pool_elements for m in _COPY.finditer(hlo_text))
