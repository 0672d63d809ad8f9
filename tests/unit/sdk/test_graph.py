"""Declaring and walking a graph (dynamo.sdk.service, dynamo.sdk.graph), and the ``dynamo`` umbrella command."""

from __future__ import annotations

import pytest

from dynamo.sdk import api, async_on_shutdown, async_on_start, depends, endpoint, service
from dynamo.sdk.cli.main import main as dynamo_main
from dynamo.sdk.graph import GraphError, walk
from dynamo.sdk.service import Dependency, spec_of


@service(dynamo={"namespace": "ns"}, workers=2, resources={"cpu": 2}, image="img:1")
class Leaf:
    @endpoint()
    async def generate(self, req: str):
        yield req

    @endpoint(name="other")
    async def second(self, req: str):
        yield req

    @async_on_start
    async def up(self) -> None: ...

    @async_on_shutdown
    async def down(self) -> None: ...


@service
class Mid:
    leaf = depends(Leaf)

    @endpoint
    async def generate(self, req: str):
        yield req


@service(dynamo={"namespace": "ns"})
class Top:
    mid = depends(Mid)
    leaf = depends(Leaf)

    @api()
    async def ask(self, text: str):
        yield text


def test_decorators_record_what_the_class_declares():
    spec = spec_of(Leaf)
    assert (spec.name, spec.namespace, spec.workers) == ("Leaf", "ns", 2)
    assert set(spec.endpoints()) == {"generate", "other"}
    assert [f.__name__ for f in spec.hooks("start")] == ["up"]
    assert [f.__name__ for f in spec.hooks("shutdown")] == ["down"]
    assert spec.service_args() == {"workers": 2, "resources": {"cpu": 2}, "image": "img:1"}
    assert spec_of(Mid).namespace == "dynamo"  # the default namespace
    assert set(spec_of(Top).apis()) == {"ask"}
    assert isinstance(Top.mid, Dependency)  # on the class: the edge itself


def test_walk_orders_dependencies_first_without_repeats():
    graph = walk(Top)
    assert [s.name for s in graph.order] == ["Leaf", "Mid", "Top"]
    assert graph.edges == {"Top": ["Mid", "Leaf"], "Mid": ["Leaf"], "Leaf": []}


def test_link_adds_edges_and_a_cycle_is_named():
    @service
    class A:
        pass

    @service
    class B:
        pass

    @service
    class C:
        pass

    assert A.link(B).link(C) is C  # type: ignore[attr-defined]
    assert [s.name for s in walk(A).order] == ["C", "B", "A"]
    C.link(A)  # type: ignore[attr-defined]
    with pytest.raises(GraphError, match="^cycle in depends: A -> B -> C -> A$"):
        walk(A)


def test_not_a_service_and_bad_workers_are_errors():
    with pytest.raises(TypeError, match="not a @service class"):
        depends(int)
    with pytest.raises(ValueError, match="workers must be"):
        service(workers=0)(type("X", (), {}))


def test_umbrella_command(capsys):
    assert dynamo_main(["--help"]) == 0
    assert "serve" in capsys.readouterr().out
    assert dynamo_main(["walk"]) == 2
    assert "unknown command 'walk'" in capsys.readouterr().err
