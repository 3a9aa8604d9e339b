"""Count the collectives in a compiled XLA program (its optimized HLO text).

    hlo = jax.jit(f).lower(*args).compile().as_text()      # or, before XLA's passes:
    hlo = jax.jit(f).lower(*args).compiler_ir("hlo").as_hlo_text()
    ops = collectives(hlo)                  # every all-reduce / all-gather / all-to-all / ... with its bytes
    in_loop, outside = split_by_layer_loop(hlo)
    bytes_per_step(hlo)                     # {"ici": {kind: bytes}, "dcn": {kind: bytes}} per chip, loops counted
    bytes_per_step_by_axis(hlo, dict(mesh.shape))   # {(kind, mesh axes, in a loop): bytes}

The decoder runs its layers in one `lax.fori_loop`, so the loop body (and what it calls) holds
one layer's collectives: tests assert Megatron's two all-reduces per layer there, and
`scripts/comm_model.py` turns the bytes into a per-token communication volume.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute", "ragged-all-to-all")

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # unindented "name (params) -> shape {"
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\(")
_ARRAY_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")


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


def _lines_by_computation(hlo_text: str):
    """(computation, instruction line) for every line of the program's text but the computations'
    headers."""
    computation = ""
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and not line[:1].isspace():
            computation = header.group(1)
            continue
        yield computation, line


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective op of the program, in text order."""
    ops, shapes = [], {}
    for computation, line in _lines_by_computation(hlo_text):
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


_CALLEES = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation)="
                      r"(\{[^}]*\}|%?[\w.\-]+)")


def _call_graph(hlo_text: str) -> dict[str, set[str]]:
    """computation -> the computations its instructions call (every one of a while's condition and body)."""
    calls: dict[str, set[str]] = {}
    for computation, line in _lines_by_computation(hlo_text):
        calls.setdefault(computation, set())
        for group in _CALLEES.findall(line):
            calls[computation].update(n.strip().lstrip("%") for n in group.strip("{}").split(",") if n.strip())
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
    calls = _call_graph(hlo_text)
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


# ----------------------------------------------------------------------------- DCN and ICI, per step
# A program compiled for several TPU slices (a multi-slice topology: jaxinfer.aot.targets) sends what
# crosses slices over the data-center network as host-transfer `send`s handled by the "megascale"
# runtime, one per collective (a ppermute is a ONE_TO_ONE transfer, a psum an ALL_REDUCE); what
# stays inside a slice is an ordinary collective over the ICI links.
_MEGASCALE = re.compile(r'_xla_host_transfer_handler_name="xla_megascale_runtime"')
_TRANSFER_TYPE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_SEND = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\((\w+\[[\d,]*\])[^=]*?\)\s+send\(")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ENTRY = re.compile(r"^ENTRY\s+%?([\w.\-]+)")


def dcn_transfers(hlo_text: str) -> list[Collective]:
    """Every transfer of a compiled multi-slice TPU program that crosses slices (over DCN): kind
    "collective-permute" for a ONE_TO_ONE transfer (a ppermute), else the collective it carries
    ("all-reduce", "all-gather", ...); bytes: the buffer one chip sends."""
    ops = []
    for computation, line in _lines_by_computation(hlo_text):
        m = _SEND.match(line)
        if not m or not _MEGASCALE.search(line):
            continue
        transfer = _TRANSFER_TYPE.search(line)
        kind = transfer.group(1) if transfer else "ONE_TO_ONE"
        kind = "collective-permute" if kind == "ONE_TO_ONE" else kind.lower().replace("_", "-")
        ops.append(Collective(kind, _shape_bytes(m.group(2)), computation))
    return ops


_CONSTANT = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*[su](?:32|64)\[\]\S*\s+constant\((-?\d+)\)")
_TUPLE = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*\(.*\)\s+tuple\(%?([\w.\-]+)")
_WHILE_OPERAND = re.compile(r"\bwhile\(%?([\w.\-]+)\).*\bcondition=%?([\w.\-]+)")
_LT_CONSTANT = re.compile(r"^\s*ROOT\s.*compare\((?:\S+\s+)?%?[\w.\-]+,\s*(?:\S+\s+)?%?([\w.\-]+)\),\s*direction=LT")


def _trip_counts(hlo_text: str) -> dict[str, int]:
    """while body -> its trip count: XLA's known_trip_count when recorded (XLA:CPU, GPU), else read
    from a `fori_loop`'s shape (the TPU compiler keeps none): a condition `counter < constant N`,
    the counter starting at the constant in the loop's initial tuple (0 when not a constant).
    Loops of another shape count once."""
    constants, first_of_tuple, bound_of_condition = {}, {}, {}
    for computation, line in _lines_by_computation(hlo_text):
        if m := _CONSTANT.match(line):
            constants[m.group(1)] = int(m.group(2))
        elif m := _TUPLE.match(line):
            first_of_tuple[m.group(1)] = m.group(2)
        elif m := _LT_CONSTANT.match(line):
            bound_of_condition[computation] = m.group(1)
    trips = {}
    for line in hlo_text.splitlines():
        m = _WHILE_BODY.search(line)
        if not m:
            continue
        body, count, operand = m.group(1), _TRIP_COUNT.search(line), _WHILE_OPERAND.search(line)
        bound = constants.get(bound_of_condition.get(operand.group(2), "")) if operand else None
        if count:
            trips[body] = int(count.group(1))
        elif bound is not None:
            trips[body] = max(bound - constants.get(first_of_tuple.get(operand.group(1), ""), 0), 1)
        else:
            trips[body] = 1
    return trips


def executions(hlo_text: str) -> dict[str, int]:
    """computation -> how many times one run of the program runs it: a while body its loop's
    trip count (`_trip_counts`) times its caller's, everything else as often as its caller."""
    calls = _call_graph(hlo_text)
    trips = _trip_counts(hlo_text)
    entry = ""
    for line in hlo_text.splitlines():
        header = _ENTRY.match(line)
        if header:
            entry = header.group(1)
            break
    if not entry:
        return {}
    reachable = _reachable(entry, calls)  # (the call graph is acyclic)
    callers = {name: 0 for name in reachable}  # the call graph is a DAG: add up in topological order
    for name in reachable:
        for callee in calls.get(name, ()):
            callers[callee] = callers.get(callee, 0) + 1
    times, ready = {entry: 1}, [entry]
    while ready:
        name = ready.pop()
        for callee in calls.get(name, ()):
            times[callee] = times.get(callee, 0) + times[name] * trips.get(callee, 1)
            callers[callee] -= 1
            if callers[callee] == 0:
                ready.append(callee)
    return times


def bytes_per_step(hlo_text: str) -> dict[str, dict[str, int]]:
    """{"ici": {kind: bytes}, "dcn": {kind: bytes}} of one run of a compiled program, per chip:
    each collective's buffer (the result; a DCN transfer's what it sends) times how often its
    computation runs (`executions`). On one slice everything is "ici"."""
    times = executions(hlo_text)
    out: dict[str, dict[str, int]] = {"ici": {}, "dcn": {}}
    for link, ops in (("ici", collectives(hlo_text)), ("dcn", dcn_transfers(hlo_text))):
        for op in ops:
            out[link][op.kind] = out[link].get(op.kind, 0) + op.bytes * times.get(op.computation, 1)
    return out


# ----------------------------------------------------------------------------- which mesh axes
_GROUPS_LIST = re.compile(r"\b(?:replica_groups|source_target_pairs)=\{((?:\{[\d,\s]*\},?\s*)*)\}")
_GROUPS_IOTA = re.compile(r"\breplica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _groups(line: str, num_devices: int) -> list[list[int]]:
    """The device groups of a collective's HLO line: its replica groups (all devices when empty),
    or a collective-permute's (source, target) pairs."""
    if m := _GROUPS_IOTA.search(line):
        shape = [int(d) for d in m.group(1).split(",")]
        ids = np.arange(math.prod(int(d) for d in m.group(2).split(","))).reshape([int(d) for d in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(d) for d in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    if m := _GROUPS_LIST.search(line):
        groups = [[int(i) for i in g.split(",") if i.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
        if any(groups):
            return groups
    return [list(range(num_devices))]


def mesh_axes_of(groups: list[list[int]], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (names of `mesh_shape`, in its order: a Mesh's `.shape`) along which the
    devices of some group differ, device ids being positions in the mesh (row-major, as the step's
    HLO numbers them)."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), sizes)).T if group else np.zeros((0, len(sizes)))
        varying.update(names[a] for a in range(len(sizes)) if len(coords) and len(set(coords[:, a])) > 1)
    return tuple(n for n in names if n in varying)


def bytes_per_step_by_axis(hlo_text: str, mesh_shape: dict[str, int]) -> dict[tuple[str, tuple[str, ...], bool], int]:
    """{(kind, mesh axes, in a loop): bytes} of one run of a program over a mesh (`mesh_shape`: a
    Mesh's `.shape`), per device: each collective's buffer times how often its computation runs,
    filed under the axes its groups span ("tensor" for Megatron's all-reduces, "pipeline" for the
    stage-to-stage permutes, ...) and whether it sits in a while loop (the decoder's layers: in
    the step's program the loops that hold collectives are the layer loops)."""
    times = executions(hlo_text)
    calls = _call_graph(hlo_text)
    looped = set().union(*(_reachable(body, calls) for body in while_bodies(hlo_text)))
    num_devices = math.prod(mesh_shape.values())
    ops = iter(collectives(hlo_text))
    out: dict[tuple[str, tuple[str, ...]], int] = {}
    for line in hlo_text.splitlines():  # collectives() keeps text order: pair each with its line
        m = _INSTRUCTION.match(line)
        if not m or m.group(3).removesuffix("-start") not in COLLECTIVE_KINDS or m.group(3).endswith("-done"):
            continue
        op = next(ops)
        key = (op.kind, mesh_axes_of(_groups(line, num_devices), mesh_shape), op.computation in looped)
        out[key] = out.get(key, 0) + op.bytes * times.get(op.computation, 1)
    return out
