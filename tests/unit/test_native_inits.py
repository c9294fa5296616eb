"""Dataclasses with a hand-written ``__init__`` keep it the one the dataclass would generate.

mypyc compiles a dataclass's own methods but leaves its generated ``__init__`` to the
interpreter (mypyc issue 817): for a frozen one each field costs an ``object.__setattr__`` call
from Python, ~1.3 µs for ``RoutingRequest``'s twelve. The values built on every request are
therefore declared ``@dataclass(..., init=False)`` with an explicit ``__init__``, which mypyc
compiles (``gateway.native``). This test reads the source: every such ``__init__`` takes the
class's fields in order, with the same annotations and defaults, and sets each field once from
its parameter (``object.__setattr__`` when frozen), so the fields stay the one definition and a
field added to the class without its parameter fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.routing.types import Candidate, LoadSnapshot, RoutingRequest

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"


def _explicit_init_dataclasses() -> list[tuple[Path, ast.ClassDef, bool]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "dataclass"
                        and any(k.arg == "init" and getattr(k.value, "value", True) is False
                                for k in dec.keywords)):
                    frozen = any(k.arg == "frozen" and getattr(k.value, "value", False) is True
                                 for k in dec.keywords)
                    found.append((path, node, frozen))
    return found


CLASSES = _explicit_init_dataclasses()


def test_the_request_paths_values_are_among_them() -> None:
    names = {node.name for _, node, _ in CLASSES}
    assert {"RoutingRequest", "Candidate", "ParsedRequest", "Reservation", "Route"} <= names


@pytest.mark.parametrize(("path", "node", "frozen"), CLASSES,
                         ids=[f"{p.stem}.{n.name}" for p, n, _ in CLASSES])
def test_init_takes_the_fields_in_order_and_sets_each_once(
        path: Path, node: ast.ClassDef, frozen: bool) -> None:
    source = path.read_text()

    def text(expr: ast.expr | None) -> str | None:
        return None if expr is None else ast.get_source_segment(source, expr)

    fields = [(st.target.id, text(st.annotation), text(st.value)) for st in node.body
              if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
              and not (text(st.annotation) or "").startswith("ClassVar")]
    inits = [st for st in node.body if isinstance(st, ast.FunctionDef) and st.name == "__init__"]
    assert len(inits) == 1, f"{node.name}: init=False needs its own __init__"
    args = inits[0].args
    assert not args.kwonlyargs and args.vararg is None and args.kwarg is None
    params = args.args[1:]
    defaults: list[ast.expr | None] = [None] * (len(params) - len(args.defaults))
    defaults += list(args.defaults)
    assert [(a.arg, text(a.annotation), text(d)) for a, d in zip(params, defaults, strict=True)] \
        == fields
    sets = []
    for st in inits[0].body:
        assert isinstance(st, ast.Expr if frozen else ast.Assign), ast.dump(st)
        if frozen:
            assert isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
            assert text(st.value.func) == "object.__setattr__"
            target, name, value = st.value.args
            assert text(target) == "self" and isinstance(name, ast.Constant)
            sets.append((name.value, text(value)))
        else:
            assert isinstance(st, ast.Assign) and isinstance(st.targets[0], ast.Attribute)
            sets.append((st.targets[0].attr, text(st.value)))
    assert sets == [(name, name) for name, _, _ in fields]


def test_the_built_values_behave_as_the_generated_init_made_them() -> None:
    """Frozen, equal and hashable by their fields, ``replace`` and defaults intact."""
    import dataclasses

    r = RoutingRequest("m", 3, 4, token_ids=(1, 2))
    assert dataclasses.replace(r, max_tokens=5) == RoutingRequest("m", 3, 5, token_ids=(1, 2))
    assert hash(r) == hash(RoutingRequest("m", 3, 4, token_ids=(1, 2)))
    assert r.reads_prefix_cache is True and r.request_id == ""
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.model = "other"  # type: ignore[misc]
    assert Candidate("w").load == LoadSnapshot()
    assert repr(Candidate("w")).startswith("Candidate(worker_id='w', load=LoadSnapshot(")
